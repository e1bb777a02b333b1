"""W4A16 for 1..8 rows on the tensor cores, the weights streamed through shared memory (Gluon).

kernels/mma_w4a16.py feeds the int4 codes to `mma.sync` from registers, and ptxas hoists every
weight load of a program ahead of its mmas: E4B's gate|up (`2x4d5p9f`) takes 210 registers, two
programs a multiprocessor, and 640 programs run in ~2.4 waves that each load, then multiply, then
exit (12.2 us for 27.8 MB, where reading the bytes takes 5.9). Here a few persistent programs a
multiprocessor walk the program tiles pid, pid + P, ..., and each warp keeps DEPTH groups of its
words in flight in a ring of shared-memory stages (`cp.async`, one commit group a stage), across
tile boundaries: a stage is read back by the thread that copied it, then refilled DEPTH - 1 groups
ahead. The weight words stay in `mma_w4a16.pack_mma`'s fragment order and the arithmetic is that
kernel's (the same mma asm, the same factored scale / zero form, summed in the same order), so the
outputs are bit-equal to `mma_w4a16` with the same warps. x (the B operand) and its sums (sum x per
group, by the ones-mma) are loaded once per program: they do not depend on the tile.

The first DEPTH - 1 stages are asked for before the PDL wait. `smem_w4a16` launches (CUDA only:
Gluon has no interpreter; `mma_w4a16_ref` is the twin), `SmemConfig` holds warps, depth and
programs per multiprocessor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from .mma_w4a16 import EPILOGUES, ONES_ASM, TILE_ASM, MmaWeight, _check_x


@gluon.jit
def _pdl(PDL: gl.constexpr, what: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise(what + "; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _copy_stage(wbuf, sbuf, stage, w_ptr, sz_ptr, w_off, s_off, w_ok, s_ok, it, u: gl.constexpr, ok,
                KB: gl.constexpr, NGK: gl.constexpr, BG: gl.constexpr, SG: gl.constexpr):
    """Stage u of program tile `it` (groups u SG .. u SG + SG - 1: their BG word blocks and scale / zero
    words) into ring stage `stage`, one commit group; nothing copied where not ok (a tile past the
    last: the stage keeps stale words, never stored)."""
    for gg in gl.static_range(SG):
        for b in gl.static_range(BG):
            cp.async_copy_global_to_shared(wbuf.index((stage * SG + gg) * BG + b),
                                           w_ptr + w_off + (it * KB + (u * SG + gg) * BG + b) * 128, mask=w_ok & ok)
        cp.async_copy_global_to_shared(sbuf.index(stage * SG + gg), sz_ptr + s_off + (it * NGK + u * SG + gg) * 16,
                                       mask=s_ok & ok)
    cp.commit_group()


@gluon.jit
def _x_group(x_base, g: gl.constexpr, BG: gl.constexpr, W: gl.constexpr, L: gl.constexpr):
    """Group g's B operand words (xa, xb: BG each, [W, 1, 32, 4]) and its sums of x by the ones-mma."""
    xa = ()
    xb = ()
    s = gl.zeros([W, 1, 32, 4], gl.float32, L)
    for b in gl.static_range(BG):
        a_ = gl.expand_dims(gl.load(x_base + (g * BG + b) * 32), 1)
        b_ = gl.expand_dims(gl.load(x_base + (g * BG + b) * 32 + 4), 1)
        xa = xa + (a_,)
        xb = xb + (b_,)
        s += gl.inline_asm_elementwise(ONES_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,f,f,f,f",
                                       [a_, b_, gl.zeros([W, 1, 32, 4], gl.float32, L)], dtype=gl.float32,
                                       is_pure=True, pack=4)
    return xa, xb, s


@gluon.jit
def _smem_w4a16_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, M, HALF, stride_xm, stride_om, NPT,
                       K: gl.constexpr, GROUP: gl.constexpr, T: gl.constexpr, W: gl.constexpr, EPI: gl.constexpr,
                       DEPTH: gl.constexpr, SG: gl.constexpr, NITER: gl.constexpr, PDL: gl.constexpr,
                       XREG: gl.constexpr = True):
    """Program pid: program tiles pid + i P (i < NITER; past NPT masked) of T 16-row tiles (EPI 1: the
    gate tile and its up tile HALF rows on); warp w sums K slice w of W for both tiles."""
    _pdl(PDL, "griddepcontrol.launch_dependents")
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    BG: gl.constexpr = GROUP // 64  # 64-k word blocks a group
    KB: gl.constexpr = K // 64  # word blocks of a 16-row tile
    NGK: gl.constexpr = K // GROUP  # groups of a tile
    NG: gl.constexpr = K // W // GROUP  # groups of a warp's K slice
    NU: gl.constexpr = NG // SG  # ring stages a program tile (SG groups each)
    L: gl.constexpr = gl.BlockedLayout([1, T, 1, 4], [1, 1, 32, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    LS: gl.constexpr = gl.BlockedLayout([1, T, 1, 2], [1, 1, 32, 1], [W, 1, 1, 1], [3, 2, 1, 0])
    SH: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [3, 2, 1, 0])
    wbuf = gl.allocate_shared_memory(gl.int32, [DEPTH * SG * BG, W, T, 32, 4], SH)
    sbuf = gl.allocate_shared_memory(gl.int32, [DEPTH * SG, W, T, 32, 2], SH)

    # [W, T, 32, 4] word offsets: warp w's K slice of tile t, lane l's 4 words (one 16-byte copy)
    w4 = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L))))[:, None, None, None]
    t4 = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L))))[None, :, None, None]
    l4 = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L))))[None, None, :, None]
    j4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L))))[None, None, None, :]
    if EPI == 1:  # row tile it (gate) and it + HALF / 16 (up)
        t_rows = t4 * (HALF // 16)
        tstep = 1
    else:  # row tiles it * T + t
        t_rows = t4
        tstep = T
    w_off = ((t_rows * KB + w4 * (NG * BG)) * 32 + l4) * 4 + j4
    # [W, T, 32, 2] scale / zero words: the lane's rows g and g + 8 (one 8-byte copy)
    ws = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LS))))[:, None, None, None]
    ts = gl.arange(0, T, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LS))))[None, :, None, None]
    ls = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LS))))[None, None, :, None]
    cs = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LS))))[None, None, None, :]
    if EPI == 1:
        s_rows = ts * (HALF // 16)
    else:
        s_rows = ts
    s_off = ((s_rows * NGK + ws * NG) * 8 + ls // 4) * 2 + cs
    w_ok = w_off >= 0
    s_ok = s_off >= 0

    # the stream: position q = i NU + u is stage u of program tile pid + i P; ring stage q % DEPTH
    for q0 in gl.static_range(DEPTH - 1):  # before the wait: the weights are not the previous kernel's
        ok = (q0 // NU < NITER) & (pid + (q0 // NU) * P < NPT)
        _copy_stage(wbuf, sbuf, q0, w_ptr, sz_ptr, w_off, s_off, w_ok, s_ok, (pid + (q0 // NU) * P) * tstep, q0 % NU,
                    ok, KB, NGK, BG, SG)
    _pdl(PDL, "griddepcontrol.wait")

    # x as the B operand, once a program: lane g*4 + tq, 16 consecutive x of row g (rows past M: row M - 1)
    # per 64-k block of the warp's slice, words tq*8 + 0..3 (xa) and + 4..7 (xb); and sum x per group
    LX: gl.constexpr = gl.SliceLayout(1, L)
    wx = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))[:, None, None]
    lx = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))[None, :, None]
    jx = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))[None, None, :]
    x32 = x_ptr.to(gl.pointer_type(gl.int32))
    x_base = x32 + gl.minimum(lx // 4, M - 1) * (stride_xm // 2) + wx * (K // W // 2) + (lx % 4) * 8 + jx
    xa = ()
    xb = ()
    xs = ()
    if XREG:  # x and its sums in registers for every tile of the program
        for g in gl.static_range(NG):
            a_, b_, s_ = _x_group(x_base, g, BG, W, L)
            xa = xa + a_
            xb = xb + b_
            xs = xs + (s_,)

    l2 = gl.arange(0, 32, layout=gl.SliceLayout(1, gl.SliceLayout(0, gl.SliceLayout(0, L))))[:, None]
    e2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L))))[None, :]
    m2 = (l2 % 4) * 2 + e2 % 2  # the B column = the x row of an accumulator element
    r2 = l2 // 4 + 8 * (e2 // 2)  # its row in the 16-row tile
    DT: gl.constexpr = out_ptr.dtype.element_ty
    for i in range(NITER):
        acc = gl.zeros([W, T, 32, 4], gl.float32, L)
        for u in gl.static_range(NU):
            q = i * NU + u
            # refill the stage read DEPTH - 1 positions ago with position q + DEPTH - 1 (its tile and stage)
            i1 = i + (u + DEPTH - 1) // NU
            ok = (i1 < NITER) & (pid + i1 * P < NPT)
            _copy_stage(wbuf, sbuf, (q + DEPTH - 1) % DEPTH, w_ptr, sz_ptr, w_off, s_off, w_ok, s_ok,
                        (pid + i1 * P) * tstep, (u + DEPTH - 1) % NU, ok, KB, NGK, BG, SG)
            cp.wait_group(DEPTH - 1)
            stage = q % DEPTH
            for gg in gl.static_range(SG):
                if XREG:
                    ga = ()
                    gb = ()
                    for b in gl.static_range(BG):
                        ga = ga + (xa[(u * SG + gg) * BG + b],)
                        gb = gb + (xb[(u * SG + gg) * BG + b],)
                    gs = xs[u * SG + gg]
                else:  # loaded again per tile (L1), fewer registers held
                    ga, gb, gs = _x_group(x_base, u * SG + gg, BG, W, L)
                p = gl.zeros([W, T, 32, 4], gl.float32, L)
                for b in gl.static_range(BG):
                    wv = wbuf.index((stage * SG + gg) * BG + b).load(L)
                    p += gl.inline_asm_elementwise(TILE_ASM, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,r,r,r,r,f,f,f,f",
                                                   [wv, ga[b], gb[b],
                                                    gl.zeros([W, T, 32, 4], gl.float32, L)],
                                                   dtype=gl.float32, is_pure=True, pack=4)
                szv = sbuf.index(stage * SG + gg).load(LS)
                sz4 = gl.convert_layout(gl.reshape(gl.join(szv, szv), [W, T, 32, 4]), L)
                sc = (sz4 << 16).to(gl.float32, bitcast=True)
                zc = (sz4 & -65536).to(gl.float32, bitcast=True)
                acc += sc * p + (zc - 128.0 * sc) * gs
        y = gl.sum(acc, axis=0)  # [T, 32, 4]: the warps' K slices
        it = pid + i * P
        if EPI == 1:
            tsel = gl.arange(0, T, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(0, L))))[:, None, None]
            gate = gl.sum(gl.where(tsel == 0, y, 0.0), axis=0)
            up = gl.sum(gl.where(tsel == 1, y, 0.0), axis=0)
            out = _rnd(_gelu_tanh(_rnd(gate, DT)), DT) * _rnd(up, DT)
            gl.store(out_ptr + m2 * stride_om + it * 16 + r2, out.to(DT), mask=(m2 < M) & (it < NPT))
        else:
            t3 = gl.arange(0, T, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(0, L))))[:, None, None]
            rows = (it * T + t3) * 16 + r2[None, :, :]
            gl.store(out_ptr + m2[None, :, :] * stride_om + rows, y.to(DT), mask=(m2[None, :, :] < M) & (it < NPT))


@gluon.jit
def _rnd(x, DT: gl.constexpr):
    return x.to(DT).to(gl.float32)


@gluon.jit
def _gelu_tanh(x):
    """kernels/fused_gemv.py's gelu_tanh, the same operations: x sigmoid(2 z)."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + gl.exp(gl.minimum(-2.0 * z, 80.0)))


@dataclass(frozen=True)
class SmemConfig:
    """warps: the split of K (each warp K / warps, a multiple of the group); depth: ring stages (groups
    in flight a warp, one of them being read); per_sm: programs a multiprocessor (at most the program tiles);
    groups: groups of K a ring stage (dividing a warp's groups)."""
    warps: int = 4
    depth: int = 8
    per_sm: int = 2
    groups: int = 1
    xreg: bool = True


def smem_w4a16(x: torch.Tensor, weight: MmaWeight, epilogue: str = "none", config: SmemConfig | None = None,
               pdl: bool = False) -> torch.Tensor:
    """x [M, K] (M <= 8, bf16) @ the int4 weight^T -> [M, N] (GeGLU: [M, N / 2]); `mma_w4a16`'s sums."""
    from .gemv import pdl_args, sm_count

    cfg = config or SmemConfig()
    N, K, G = weight.N, weight.K, weight.group_size
    _check_x(x, K)
    if epilogue not in EPILOGUES:
        raise ValueError(f"smem_w4a16: epilogue {epilogue!r} not in {sorted(EPILOGUES)}")
    if K % (cfg.warps * G):
        raise ValueError(f"smem_w4a16: K={K} does not split into {cfg.warps} warps of whole {G}-groups")
    if cfg.depth < 2:
        raise ValueError(f"smem_w4a16: depth must be >= 2, got {cfg.depth}")
    if (K // cfg.warps // G) % cfg.groups:
        raise ValueError(f"smem_w4a16: {cfg.groups} groups a stage do not divide a warp's {K // cfg.warps // G}")
    epi = EPILOGUES[epilogue]
    T = 2
    n_tiles = N // 16 // T
    out = torch.empty(x.shape[0], N // 2 if epi == 1 else N, device=x.device, dtype=x.dtype)
    programs = min(n_tiles, cfg.per_sm * sm_count(x.device))
    niter = -(-n_tiles // programs)
    _smem_w4a16_kernel[(programs,)](x, weight.words, weight.sz, out, x.shape[0], N // 2, x.stride(0), out.stride(0),
                                    n_tiles, K=K, GROUP=G, T=T, W=cfg.warps, EPI=epi, DEPTH=cfg.depth, SG=cfg.groups, XREG=cfg.xreg,
                                    NITER=niter, num_warps=cfg.warps, **pdl_args(pdl, x.device))
    return out


# ---------------------------------------------------------------------------------------------
# benchmark (CUDA only; not a test)

def parse_smem(text: str) -> SmemConfig:
    """'wWdDpP[gG]' (warps, ring depth, programs a multiprocessor, groups a stage), e.g. 'w4d8p2', 'w4d2p2g5'."""
    import re

    m = re.fullmatch(r"\s*w(\d+)d(\d+)p(\d+)(?:g(\d+))?(l)?\s*", text)
    if not m:
        raise ValueError(f"smem config {text!r}: wWARPSdDEPTHpPER_SM[gGROUPS][l], e.g. 'w4d8p2' or 'w4d2p2g5l'")
    w, d, p, g, lazy = m.groups()
    return SmemConfig(int(w), int(d), int(p), int(g or 1), not lazy)


def bench_smem(cases: dict | None = None, ms=(1, 8), configs: list[str] | None = None, group_size: int = 128,
               timer=None, device: str = "cuda", pdl: bool = True) -> list[dict]:
    """Each case (name -> (N, K, mode) of kernels/fused_w4a16.E4B_CASES; default gate|up) at each row
    count: the shipped `mma_w4a16` config against this kernel's `configs`, weights rotated out of L2,
    every output checked against the twin first (and compared bit for bit with the shipped kernel's).
    Prints a table; returns one dict per (case, rows, kernel)."""
    from .bench_util import WRONG_REL_ERR, copies_past_l2, max_rel_err, timed_candidate, timer_or_graphs
    from .fused_w4a16 import E4B_CASES
    from .mma_w4a16 import format_config, mma_config, mma_w4a16, mma_w4a16_ref
    from .read_floor import read_floor
    from .w4a16 import pack_int4, quantize_int4

    dev = torch.device(device)
    timer = timer_or_graphs(timer, "bench_smem")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}  int4 on the tensor cores, words through shared memory vs the "
          f"shipped kernel (us; weights rotated out of L2; {'PDL' if pdl else 'plain'})")
    print(f"{'case':>10} {'M':>2} | {'kernel':<28} | {'us':>7} | {'TB/s':>5} | check")
    for name, (N, K, mode) in (cases or {"gate|up": E4B_CASES["gate|up"]}).items():
        epi = "geglu" if mode == "geglu" else "none"
        w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        q, sc, zr = quantize_int4(w, group_size)
        qw = pack_int4(q)
        mw = MmaWeight.from_codes(q, sc, zr, group_size)
        nbytes = (mw.words.numel() + mw.sz.numel()) * 4
        bufs = [(MmaWeight(mw.words.clone(), mw.sz.clone(), N, K, group_size),)
                for _ in range(copies_past_l2(nbytes, dev))]
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
            ref = mma_w4a16_ref(x, qw, sc, zr, group_size, epi)
            shipped = mma_config(N, K, M, epi)
            runs = [(f"shipped mma {format_config(shipped) if shipped else 'default'}",
                     lambda mw_: mma_w4a16(x, mw_, epi, None, pdl))]
            runs += [(f"smem {c}", lambda mw_, c=c: smem_w4a16(x, mw_, epi, parse_smem(c), pdl)) for c in configs or ()]
            runs.append(("read the words only (floor)", lambda mw_: read_floor(mw_.words, 8192, 8, pdl)))
            base = None
            for label, call in runs:
                run = timed_candidate(call, bufs, timer, label)
                if run is None:
                    continue
                got, us = run
                floor = "floor" in label
                err = float("nan") if floor else max_rel_err(got, ref)
                ok = floor or err < WRONG_REL_ERR
                if base is None:
                    base = got
                same = "" if floor or got is base else (" =shipped" if torch.equal(got, base) else " !=shipped")
                tbs = (mw.words.numel() * 4 if floor else nbytes) / us / 1e6
                rows.append(dict(case=name, N=N, K=K, M=M, kernel=label, us=us, tb_s=tbs, max_rel_err=err, ok=ok))
                check = "-" if floor else f"{'ok' if ok else 'WRONG'} {err:.1e}{same}"
                print(f"{name:>10} {M:>2} | {label:<28} | {us:7.2f} | {tbs:5.2f} | {check}")
        del bufs
    return rows


def main(argv=None):
    import argparse

    from .fused_w4a16 import E4B_CASES

    ap = argparse.ArgumentParser(description="int4 words through shared memory against the shipped tensor-core kernel")
    ap.add_argument("--cases", default="gate|up", help="names of kernels/fused_w4a16.E4B_CASES ('_' for spaces), ','")
    ap.add_argument("--rows", default="1,8", help="activation rows, joined by ','")
    ap.add_argument("--configs", default="w4d8p2,w4d6p2,w4d4p3,w4d10p2,w4d12p1",
                    help="'wWdDpP' joined by ',' (warps, ring depth, programs a multiprocessor)")
    a = ap.parse_args(argv)
    names = [c.replace("_", " ") for c in a.cases.split(",") if c]
    if bad := [n for n in names if n not in E4B_CASES]:
        raise SystemExit(f"--cases: {bad} not among {sorted(E4B_CASES)}")
    configs = [c for c in a.configs.split(",") if c]
    for c in configs:
        parse_smem(c)
    bench_smem({n: E4B_CASES[n] for n in names}, tuple(int(r) for r in a.rows.split(",")), configs)


if __name__ == "__main__":
    main()
