"""compressed-tensors "pack-quantized" int4 checkpoints (llm-compressor outputs, int4 QAT releases),
loaded by `weights/hf.py` into Int4Linear modules with no re-quantization and no rounding.

Per quantized linear X (W [N, K], groups of G consecutive k), instead of X.weight:
    X.weight_packed      int32 [N, K/8]          code i of a word in bits 4i..4i+3, stored = q + 8 (q in -8..7)
    X.weight_scale       [N, K/G]                bf16 / fp16 / fp32
    X.weight_shape       int [2]                 (N, K)
    X.weight_zero_point  int32 [ceil(N/8), K/G]  asymmetric only: packed along N, stored = zp + 8
    w = (stored - stored_zp) * scale             (stored_zp = 8 when symmetric)
Ours (fastgemma.kernels.w4a16): w = q * scales + zeros, q in 0..15, scales / zeros [K/G, N]. So
q = stored (an int32's little-endian bytes are our uint8 [N, K/2]: low nibble = even k), scales =
scale^T in the checkpoint's dtype, zeros = -stored_zp * scale^T. -8 * s is exact in any binary float;
an asymmetric zp * s (4 + 8 significant bits in bf16) may not be, and then that layer keeps fp32
scales / zeros (4 + 11 <= 24 bits: exact).
The shard headers say which layers are packed; `ignore` is checked against them, not trusted.
"""
from __future__ import annotations

import json
import re
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..kernels.int4_pack import GROUP_SIZES
from ..transforms.quant import Int4Linear
from .hf import CheckpointError

SUPPORTED = ("compressed-tensors 'pack-quantized' int4 weights: num_bits 4, type int, strategy group, "
             f"group_size {'/'.join(map(str, GROUP_SIZES))}, no activation / KV-cache quantization")
_PACKED = ".weight_packed"
_DTYPES = {"weight_packed": {"I32"}, "weight_scale": {"BF16", "F16", "F32"}, "weight_shape": {"I64", "I32"},
           "weight_zero_point": {"I32"}}


def _refuse(where: str, what: str, found) -> CheckpointError:
    return CheckpointError(f"{where}: quantization_config {what} is {found!r}; supported: {SUPPORTED}")


@dataclass(frozen=True)
class PackQuantized:
    """The checked `quantization_config` of a pack-quantized int4 checkpoint."""
    group_size: int
    symmetric: bool
    ignore: tuple[str, ...] = ()

    def ignores(self, name: str) -> bool:
        # compressed-tensors' match_name: "re:<regex>" is re.match'ed, anything else is an exact module name
        return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in self.ignore)

    def describe(self) -> dict:
        return {"format": "compressed-tensors pack-quantized", "num_bits": 4, "group_size": self.group_size,
                "symmetric": self.symmetric, "ignore": list(self.ignore)}

    def plan(self, where: str, header: dict, prefix: str, linears: dict[str, tuple[int, int]],
             expected: dict) -> dict[str, tuple[int, int]]:
        """Replace X.weight in `expected` by the packed keys of every linear the header packs.
        -> {model name: (N, K)} of those layers. Keys outside the text model are left to plan_load."""
        G, packed, problems = self.group_size, {}, []
        for key in header:
            if not key.endswith(_PACKED):
                continue
            base = key[: -len(_PACKED)]
            name = base[len(prefix):] if base.startswith(prefix) else None
            if name is None or name + ".weight" not in expected:
                continue  # another tower, a KV-shared layer's k/v, or unknown: plan_load names or counts it
            if self.ignores(base):
                problems.append(f"{base} is packed but quantization_config.ignore lists it")
            elif name not in linears:
                problems.append(f"{base} is packed but is not a linear layer (only linear layers can be int4)")
            elif linears[name][1] % G:
                problems.append(f"{base}: K={linears[name][1]} is not a multiple of group_size {G}")
            else:
                N, K = packed[name] = linears[name]
                del expected[name + ".weight"]
                expected.update({name + _PACKED: (N, K // 8), name + ".weight_scale": (N, K // G),
                                 name + ".weight_shape": (2,)})
                if not self.symmetric:
                    expected[name + ".weight_zero_point"] = (-(-N // 8), K // G)
        if problems:
            raise CheckpointError(f"{where}: " + "; ".join(problems[:10]) + (" ..." if len(problems) > 10 else ""))
        return packed

    def check(self, where: str, packed: dict[str, tuple[int, int]], plan: dict) -> None:
        """Dtypes and weight_shape values, from the files, before anything is allocated."""
        problems = []
        with _Files() as files:
            for name, (f, key) in plan.items():
                layer, _, field = name.rpartition(".")
                dt = files.open(f).get_slice(key).get_dtype()
                if dt not in _DTYPES[field]:
                    problems.append(f"{key}: dtype {dt}, expected {'/'.join(sorted(_DTYPES[field]))}")
                elif field == "weight_shape" and (shape := files.open(f).get_tensor(key).tolist()) != list(packed[layer]):
                    problems.append(f"{key} is {shape}, the model's layer is {list(packed[layer])}")
        if problems:
            raise CheckpointError(f"{where}: " + "; ".join(problems[:10]))

    def swap(self, model, packed: dict[str, tuple[int, int]], backend: str) -> None:
        """On the meta device: each packed nn.Linear becomes an Int4Linear of the same shape."""
        for name, (N, K) in packed.items():
            parent, _, child = name.rpartition(".")
            dtype = model.get_submodule(name).weight.dtype
            setattr(model.get_submodule(parent), child,
                    Int4Linear(K, N, self.group_size, backend=backend, dtype=dtype, device="meta"))

    @torch.no_grad()
    def fill(self, model, packed: dict[str, tuple[int, int]], plan: dict) -> int:
        """Copy each packed layer into its (allocated) Int4Linear. -> how many keep fp32 scales / zeros."""
        promoted = 0
        with _Files() as files:
            def get(key):
                f, k = plan[key]
                return files.open(f).get_tensor(k)

            for name in packed:
                mod = model.get_submodule(name)
                scale = get(name + ".weight_scale")
                zp = None if self.symmetric else get(name + ".weight_zero_point")
                qweight, scales, zeros = to_int4(get(name + _PACKED), scale, zp)
                mod.qweight.copy_(qweight)
                mod.set_scales(scales.to(mod.qweight.device), zeros.to(mod.qweight.device))
                promoted += scales.dtype != scale.dtype
        return promoted


class _Files(ExitStack):
    """Each shard opened once (a layer's packed codes and scales may sit in different shards)."""

    def __init__(self):
        super().__init__()
        self._handles: dict[Path, object] = {}

    def open(self, f: Path):
        if f not in self._handles:
            self._handles[f] = self.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        return self._handles[f]


def to_int4(packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None):
    """compressed-tensors (weight_packed int32 [N, K/8], weight_scale [N, K/G], weight_zero_point
    int32 [ceil(N/8), K/G] or None) -> ours (qweight uint8 [N, K/2], scales [K/G, N], zeros [K/G, N])."""
    N = packed.shape[0]
    qweight = packed.contiguous().view(torch.uint8)  # [N, K/2]: byte j of a word = codes 2j | 2j+1 << 4
    if sys.byteorder == "big":
        qweight = qweight.view(N, -1, 4).flip(-1).reshape(N, -1)
    if zero_point is None:
        zp = torch.tensor(8.0, device=scale.device)
    else:  # word [r, c] holds zp[8r + i, c] in bits 4i..4i+3
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=zero_point.device)
        zp = ((zero_point.unsqueeze(1) >> shifts[:, None]) & 0xF).flatten(0, 1)[:N].float()
    zeros = -(zp * scale.float())  # [N, K/G], exact in fp32
    dtype = scale.dtype if torch.equal(zeros.to(scale.dtype).float(), zeros) else torch.float32
    return qweight, scale.t().to(dtype).contiguous(), zeros.t().to(dtype).contiguous()


def read_scheme(root: Path) -> PackQuantized | None:
    """The checkpoint's quantization, or None for a dense one. Anything we cannot load exactly
    (another method or format, 8-bit, channel strategy, activation quantization ...) is refused."""
    f = Path(root) / "config.json"
    try:
        d = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # read_config_json reports a broken config.json
    q = d.get("quantization_config") if isinstance(d, dict) else None
    return None if q is None else parse_scheme(q, str(f))


def parse_scheme(q: dict, where: str = "config.json") -> PackQuantized:
    if not isinstance(q, dict):
        raise _refuse(where, "(the whole entry)", q)
    if q.get("quant_method") != "compressed-tensors":
        raise _refuse(where, "quant_method", q.get("quant_method"))
    for key in ("kv_cache_scheme", "transform_config"):
        if q.get(key):
            raise _refuse(where, key, q[key])
    if (q.get("sparsity_config") or {}).get("format", "dense") != "dense":
        raise _refuse(where, "sparsity_config.format", q["sparsity_config"]["format"])
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, "config_groups", groups)
    found = set()
    for gname, g in groups.items():
        fmt = g.get("format") or q.get("format")
        if fmt != "pack-quantized":
            raise _refuse(where, f"format ({gname})", fmt)
        for key in ("input_activations", "output_activations"):
            if g.get(key):
                raise _refuse(where, f"{gname}.{key}", g[key])
        w = g.get("weights") or {}
        for key, ok in (("num_bits", {4}), ("type", {"int"}), ("strategy", {"group"}),
                        ("group_size", set(GROUP_SIZES)), ("dynamic", {False, None}),
                        ("actorder", {None, "weight", "static"})):
            if w.get(key) not in ok:
                raise _refuse(where, f"{gname}.weights.{key}", w.get(key))
        found.add((w["group_size"], bool(w.get("symmetric", True))))
    if len(found) > 1:
        raise _refuse(where, "(group_size, symmetric) across config_groups", sorted(found))
    (G, symmetric), = found
    ignore = q.get("ignore") or []
    if not all(isinstance(p, str) for p in ignore):
        raise _refuse(where, "ignore", ignore)
    return PackQuantized(G, symmetric, tuple(ignore))


__all__ = ["PackQuantized", "parse_scheme", "read_scheme", "to_int4", "SUPPORTED"]
