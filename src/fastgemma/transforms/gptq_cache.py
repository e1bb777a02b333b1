"""GPTQ's codes kept on disk, so that a model is calibrated once per weights and settings, not per run.

A file per key under `cache_root()/gptq/<key>.safetensors` (the cache of weights/gguf.py:
`$FASTGEMMA_CACHE`, else `$XDG_CACHE_HOME/fastgemma`, else `~/.cache/fastgemma`): for each quantized
linear `<name>.qweight` (packed int4, kernels/int4_pack), `<name>.scales`, `<name>.zeros`; the describe()
facts of the run that made it in the metadata. The key is a SHA-256 over what decides the codes: the
model's parameters and persistent buffers before quantization (name, shape, dtype and 4,096 values taken
at a stride from each), the quantized linears' names, the settings (group size, damping, act-order, window,
true-sequential, clip search), the calibration sequences' ids and the calibration procedure's version
(`PROCEDURE`). A file that cannot be read is ignored (and rewritten).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from ..kernels.int4_pack import pack_int4, unpack_int4

log = logging.getLogger(__name__)

SAMPLE = 4096  # values of each tensor in the fingerprint
PROCEDURE = 2  # 2: one calibration forward for every layer (1: a forward per decoder layer)


def cache_dir() -> Path:
    from ..weights.gguf import cache_root

    return cache_root() / "gptq"


@torch.no_grad()
def key(model, names: list[str], settings: dict, seqs: list[list[int]]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"names": names, "settings": settings, "procedure": PROCEDURE}, sort_keys=True).encode())
    h.update(json.dumps(seqs).encode())
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(sample.float().cpu().numpy().tobytes() if sample.is_floating_point()
                 else sample.long().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def load(k: str, device) -> tuple[dict, dict, Path] | None:
    """({name: (codes [N, K] uint8, scales, zeros)}, facts, path) or None."""
    from safetensors import safe_open

    path = cache_dir() / f"{k}.safetensors"
    if not path.is_file():
        return None
    try:
        out = {}
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            facts = json.loads(f.metadata()["facts"])
            for tname in f.keys():
                name, part = tname.rsplit(".", 1)
                out.setdefault(name, {})[part] = f.get_tensor(tname)
        codes = {n: (unpack_int4(p["qweight"]), p["scales"], p["zeros"]) for n, p in out.items()}
    except Exception as err:  # a truncated or foreign file: calibrate again
        log.warning("gptq cache: %s unreadable (%s); calibrating again", path, err)
        return None
    return codes, facts, path


def save(k: str, codes: dict, facts: dict) -> Path | None:
    """Write atomically; on an unwritable cache, warn and go on (the run does not need the file)."""
    from safetensors.torch import save_file

    path = cache_dir() / f"{k}.safetensors"
    tensors = {}
    for name, (q, s, z) in codes.items():
        tensors[f"{name}.qweight"] = pack_int4(q).contiguous().cpu()
        tensors[f"{name}.scales"] = s.contiguous().cpu()
        tensors[f"{name}.zeros"] = z.contiguous().cpu()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        save_file(tensors, tmp, metadata={"facts": json.dumps(facts)})
        os.replace(tmp, path)
    except OSError as err:
        log.warning("gptq cache: could not write %s (%s)", path, err)
        return None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return path
