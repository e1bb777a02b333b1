"""A tiny interpreter for the straight-line b32 PTX blocks our kernels pass to
tl.inline_asm_elementwise (mov, shr, lop3, prmt, fma.rn.bf16x2), so CPU tests can run the asm text
itself: Triton's interpreter cannot execute inline PTX. Values are Python ints (32-bit registers)."""
import re
import struct

import torch


def _bf16(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _to_bf16_bits(v: float) -> int:
    # round to nearest even, through torch (float64 -> bf16 rounds the exact value once for our
    # operands: q * s + z with a 4-bit q and 8-bit s, z is exact in float64)
    t = torch.tensor([v], dtype=torch.float64).to(torch.bfloat16)
    return int(t.view(torch.int16).item()) & 0xFFFF


def _lop3(a, b, c, lut):
    out = 0
    for idx in range(8):
        if lut >> idx & 1:
            out |= (a if idx & 4 else ~a) & (b if idx & 2 else ~b) & (c if idx & 1 else ~c)
    return out & 0xFFFFFFFF


def _prmt(a, b, sel):
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def _fma_bf16x2(a, b, c):
    halves = [_to_bf16_bits(_bf16(a >> s) * _bf16(b >> s) + _bf16(c >> s)) for s in (0, 16)]
    return halves[0] | halves[1] << 16


def run(asm: str, args: list[int], n_out: int) -> list[int]:
    """Execute `asm` with $0..$(n_out-1) as outputs and $n_out.. bound to `args`; -> outputs."""
    regs = {f"${n_out + i}": v & 0xFFFFFFFF for i, v in enumerate(args)}

    def val(tok):
        tok = tok.strip()
        if tok.startswith("0x"):
            return int(tok, 16)
        return int(tok) if tok.isdigit() else regs[tok]

    for line in asm.split(";"):
        line = line.strip().strip("{}").strip()
        if not line or line.startswith(".reg"):
            continue
        op, _, rest = line.partition(" ")
        ops = [t.strip() for t in rest.split(",")]
        d, src = ops[0], ops[1:]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1]) if not re.fullmatch(r"\d+", src[1]) else val(src[0]) >> int(src[1])
        elif op == "lop3.b32":
            regs[d] = _lop3(val(src[0]), val(src[1]), val(src[2]), int(src[3], 16))
        elif op == "prmt.b32":
            regs[d] = _prmt(val(src[0]), val(src[1]), int(src[2], 16))
        elif op == "fma.rn.bf16x2":
            regs[d] = _fma_bf16x2(val(src[0]), val(src[1]), val(src[2]))
        else:
            raise NotImplementedError(f"ptx_lite: {op}")
    return [regs[f"${i}"] for i in range(n_out)]
