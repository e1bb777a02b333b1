"""A local Hugging Face checkpoint directory: config.json + one or many safetensors shards.

Key layouts: Gemma4ForConditionalGeneration (`model.language_model.*` beside vision/audio towers),
Gemma4ForCausalLM / Gemma3ForCausalLM (`model.*`). Every key and shape is checked from the shard
headers before a byte is allocated, so bad input fails with nothing half-done; then tensors are
copied one at a time into parameters allocated on the target device (no second full copy).
A compressed-tensors int4 checkpoint (`quantization_config` in config.json) is detected here: its
packed linears become Int4Linear modules, mapped and checked the same way (weights/compressed.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..model import ModelConfig, empty_model, read_config_json
from ..model.config import ConfigError


class CheckpointError(ValueError):
    pass


_PREFIXES = ("model.language_model.", "model.")
# other modalities' towers in a ConditionalGeneration checkpoint
_OTHER = re.compile(r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio|multi_modal_projector)\.")
# transformers' _keys_to_ignore_on_load_unexpected for KV-shared layers
_SHARED_KV = re.compile(r"^layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


@dataclass
class LoadReport:
    path: str
    shards: int
    loaded: int = 0
    ignored_shared_kv: list[str] = field(default_factory=list)
    skipped_other_modalities: int = 0
    skipped_tied_head: bool = False
    quantization: dict | None = None  # a compressed-tensors checkpoint: its scheme and layer counts

    def summary(self) -> str:
        s = (f"{self.path}: {self.loaded} tensors from {self.shards} shard(s); ignored "
             f"{len(self.ignored_shared_kv)} KV-shared k/v keys, {self.skipped_other_modalities} "
             f"other-modality keys" + ("; tied lm_head skipped" if self.skipped_tied_head else ""))
        q = self.quantization
        if q:
            s += (f"; {q['int4_layers']} linears int4 as stored (compressed-tensors, group {q['group_size']}, "
                  f"{'symmetric' if q['symmetric'] else 'asymmetric'}), {q['dense_linears']} dense")
            if q["fp32_scale_layers"]:
                s += f", {q['fp32_scale_layers']} with fp32 scales/zeros (zero point not exact in the scale dtype)"
        return s


def _shards(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{index}: unreadable shard index ({e})") from e
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            raise CheckpointError(f"{root}: shard index names missing files {missing}")
        return [root / f for f in files]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    return files


def _headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    out[k] = (f, tuple(sf.get_slice(k).get_shape()))
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return out


def _prefix(header: dict, path: str) -> str:
    prefix = next((p for p in _PREFIXES if any(k.startswith(p + "layers.") for k in header)), None)
    if prefix is None:
        raise CheckpointError(f"{path}: no decoder layers under {list(_PREFIXES)}: not a Gemma text checkpoint")
    return prefix


def plan_load(cfg: ModelConfig, header: dict, expected: dict[str, tuple[int, ...]], report: LoadReport):
    """Map checkpoint keys to model names; raise naming every missing, unexpected or misshaped key."""
    prefix = _prefix(header, report.path)
    shared = {s.index for s in cfg.layer_specs() if not s.stores_kv}
    plan, unexpected, shapes = {}, [], []
    for key, (f, shape) in header.items():
        if key == "lm_head.weight" and cfg.tie_embeddings:
            report.skipped_tied_head = True
            continue
        if _OTHER.match(key):
            report.skipped_other_modalities += 1
            continue
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name is None or name not in expected:
            m = _SHARED_KV.match(name or "")
            if m and int(m.group(1)) in shared:
                report.ignored_shared_kv.append(key)
                continue
            unexpected.append(key)
            continue
        if tuple(expected[name]) != shape:
            shapes.append(f"{key}: checkpoint {list(shape)} vs model {list(expected[name])}")
        plan[name] = (f, key)
    missing = sorted(set(expected) - set(plan))
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(prefix + m for m in missing[:20])}"
                        + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(sorted(unexpected)[:20])}"
                        + (" ..." if len(unexpected) > 20 else ""))
    if shapes:
        problems.append("shape mismatch: " + "; ".join(shapes[:20]))
    if problems:
        raise CheckpointError(f"{report.path}: " + " | ".join(problems))
    return plan


@torch.no_grad()
def load_hf(path: str | Path, device="cpu", dtype=torch.bfloat16, cfg: ModelConfig | None = None):
    """-> (model, LoadReport). Raises ConfigError / CheckpointError with the reason."""
    root = Path(path).expanduser()
    if not root.exists():
        raise CheckpointError(f"{root}: no such directory")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    try:
        cfg = cfg or read_config_json(root)
    except PermissionError as e:
        raise CheckpointError(f"{root}: unreadable ({e})") from e
    from .compressed import read_scheme

    scheme = read_scheme(root)  # None: a dense checkpoint
    files = _shards(root)
    header = _headers(files)
    report = LoadReport(str(root), len(files))
    with torch.device("meta"):
        from ..model.decoder import Gemma4Model
        meta = Gemma4Model(cfg)
    expected = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    packed, int4_plan, on_meta = {}, {}, None
    if scheme is not None:
        linears = {n: (m.out_features, m.in_features) for n, m in meta.named_modules() if isinstance(m, nn.Linear)}
        packed = scheme.plan(str(root), header, _prefix(header, str(root)), linears, expected)
    plan = plan_load(cfg, header, expected, report)
    if packed:
        int4_plan = {n: plan.pop(n) for n in list(plan) if n.rpartition(".")[0] in packed}
        scheme.check(str(root), packed, int4_plan)
        backend = "triton" if torch.device(device).type == "cuda" else "torch"  # as quant=int4 on each device
        on_meta = lambda m: scheme.swap(m, packed, backend)  # noqa: E731
    model = empty_model(cfg, device, dtype, on_meta=on_meta)
    targets = model.state_dict()
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (f, key) in plan.items():
        by_file.setdefault(f, []).append((name, key))
    for f, items in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name, key in items:
                targets[name].copy_(sf.get_tensor(key))
                report.loaded += 1
    if scheme is not None:
        fp32 = scheme.fill(model, packed, int4_plan)
        report.loaded += len(int4_plan)
        report.quantization = {**scheme.describe(), "int4_layers": len(packed), "fp32_scale_layers": fp32,
                               "dense_linears": sum(isinstance(m, nn.Linear) for m in model.modules())}
    model.init_buffers()
    return model, report


def load_tokenizer(path: str | Path):
    """The tokenizer saved beside the weights, or None if the directory has none."""
    root = Path(path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(root))


__all__ = ["load_hf", "load_tokenizer", "CheckpointError", "ConfigError", "LoadReport"]
