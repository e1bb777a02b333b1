"""A tiny interpreter for the straight-line b32 PTX blocks our kernels pass to
tl.inline_asm_elementwise (mov, shr, lop3, prmt, fma.rn.bf16x2; warp-wide: mma.sync m16n8k16 bf16
with fp32 accumulators), so CPU tests can run the asm text itself: Triton's interpreter cannot
execute inline PTX. Values are Python ints (32-bit registers; fp32 ones as their bits)."""
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


def _val(regs: dict, tok: str) -> int:
    tok = tok.strip()
    if tok.startswith("0x"):
        return int(tok, 16)
    return int(tok) if tok.isdigit() else regs[tok]


def _instructions(asm: str):
    """(op, operand text) per instruction: the block's braces and .reg lines dropped, operand groups
    ({$0, $1}) kept."""
    for line in asm.split(";"):
        line = line.strip()
        line = line[1:].strip() if line.startswith("{") else line
        if line and line != "}" and not line.startswith(".reg"):
            op, _, rest = line.partition(" ")
            yield op, rest


def _step(regs: dict, op: str, rest: str) -> None:
    """One b32 instruction on one lane's registers (immediates, the LOP3 table and the PRMT selector
    included, read as operands)."""
    d, *src = [t.strip() for t in rest.split(",")]
    v = [_val(regs, t) for t in src]
    if op == "mov.b32":
        regs[d] = v[0]
    elif op == "shr.b32":
        regs[d] = v[0] >> v[1]
    elif op == "lop3.b32":
        regs[d] = _lop3(v[0], v[1], v[2], v[3])
    elif op == "prmt.b32":
        regs[d] = _prmt(v[0], v[1], v[2])
    elif op == "fma.rn.bf16x2":
        regs[d] = _fma_bf16x2(v[0], v[1], v[2])
    else:
        raise NotImplementedError(f"ptx_lite: {op}")


def run(asm: str, args: list[int], n_out: int) -> list[int]:
    """Execute `asm` with $0..$(n_out-1) as outputs and $n_out.. bound to `args`; -> outputs."""
    regs = {f"${n_out + i}": v & 0xFFFFFFFF for i, v in enumerate(args)}
    for op, rest in _instructions(asm):
        _step(regs, op, rest)
    return [regs[f"${i}"] for i in range(n_out)]

_MMA_OP = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _mma_warp(a_regs, b_regs, c_regs):
    """mma.m16n8k16 (row-major A 16x16 bf16, col-major B 16x8 bf16, fp32 C / D) from the 32 lanes'
    fragments, as the PTX ISA lays them out: lane l = g*4 + t holds A[g + 8 (i%2), t*2 + 8 (i//2) + h]
    in half h of register i, B[t*2 + 8 i + h, g] in half h of register i, C[g + 8 (i//2), t*2 + i%2]
    in register i. -> the lanes' 4 D registers. Products and sums in float64, rounded to fp32 once."""
    A = [[0.0] * 16 for _ in range(16)]
    B = [[0.0] * 8 for _ in range(16)]
    C = [[0.0] * 8 for _ in range(16)]
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(4):
            for h in range(2):
                A[g + 8 * (i % 2)][t * 2 + 8 * (i // 2) + h] = _bf16(a_regs[lane][i] >> (16 * h))
                C[g + 8 * (i // 2)][t * 2 + i % 2] = _f32(c_regs[lane][i])
        for i in range(2):
            for h in range(2):
                B[t * 2 + 8 * i + h][g] = _bf16(b_regs[lane][i] >> (16 * h))
    out = []
    for lane in range(32):
        g, t = divmod(lane, 4)
        d = []
        for i in range(4):
            r, n = g + 8 * (i // 2), t * 2 + i % 2
            d.append(_f32_bits(C[r][n] + sum(A[r][k] * B[k][n] for k in range(16))))
        out.append(d)
    return out


def run_warp(asm: str, lane_args: list[list[int]], n_out: int) -> list[list[int]]:
    """Execute `asm` on 32 lanes in lock step ($0..$(n_out-1) outputs, $n_out.. bound to each lane's
    args); mma.sync reads every lane's fragments at once. -> each lane's outputs."""
    regs = [{f"${n_out + i}": v & 0xFFFFFFFF for i, v in enumerate(args)} for args in lane_args]
    assert len(regs) == 32, "a warp is 32 lanes"

    def group(text):  # "{$0, $1}" -> ["$0", "$1"]
        return [t.strip() for t in text.strip().strip("{}").split(",")]

    for op, rest in _instructions(asm):
        if op != _MMA_OP:
            for lane_regs in regs:
                _step(lane_regs, op, rest)
            continue
        d, a, b, c = (group(x) for x in re.findall(r"\{[^}]*\}", rest))
        res = _mma_warp(*([[_val(regs[ln], x) for x in grp] for ln in range(32)] for grp in (a, b, c)))
        for ln in range(32):
            for reg, v in zip(d, res[ln]):
                regs[ln][reg] = v
    return [[regs[ln][f"${i}"] for i in range(n_out)] for ln in range(32)]
