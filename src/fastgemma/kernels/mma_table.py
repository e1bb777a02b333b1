"""The tensor-core int4 kernel's configs (kernels/mma_w4a16.py): `MmaConfig`, the tables of the E4B shapes
on the H200 (`MMA_CONFIGS` by shape and row count, `INVARIANT_CONFIGS` under fuse.batch_invariant), their
text form (`parse_config`, `parse_table`: the benchmarks' --mma-table), the lookup a launch makes
(`mma_config`), what a config cannot launch (`config_problem`) and the CUDA entries' build or fallback
(`settle_cuda_entries`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ROWS = 8  # activation rows: the B operand's 8 columns


@dataclass(frozen=True)
class MmaConfig:
    """tiles: 16-row tiles per program (2 for GeGLU: gate and up); warps: the split of K (each warp
    K / warps, a multiple of the group size); depth: groups of weight words in flight per warp (all
    of its K slice when that is fewer); iters: program tiles per program, each next one's words
    loaded while the current one is summed (iters > 1 needs every group in flight: depth >= the
    groups of a warp's slice); splits: programs per program tile, each 1/splits of K (its warps split
    that), the tile's last one to finish adding the partials (iters 1 only); persist: R > 0 runs the
    persistent kernel, at most R programs per multiprocessor, each a stream of program tiles with
    `depth` groups in flight per warp across its tiles (iters and splits 1); fresh: the persistent kernel
    starts each 64-k block's mma chain from zero (shorter dependent chains); hw: hardware warps per
    program (0: `warps`). The program's tensors hold warps x tiles lane rows of 32; with fewer hardware
    warps each thread holds several of them (more loads in flight per thread, more registers), with
    warps x tiles (the most allowed) one each. Timed slower than hw 0 on every E4B shape tried (run EB:
    gate|up at one row 11.75 us, 13.69 on 8 hardware warps, 21.47 on 2; down 7.07, 9.08 on 16).
    regs: a cap on the registers per thread (ptxas' `.maxnreg`; 0: its own choice), so that more
    programs fit on a multiprocessor at once (65,536 registers each): ptxas hoists every weight load
    of a one-tile program ahead of its mmas whatever the depth, so gate|up's `2x4d5p9f` takes 210
    registers, 2 programs per multiprocessor, and its 640 programs run in ~2.4 waves; above the cap
    ptxas spills to local memory. Timed slower on every E4B shape, so the table sets none (run GR:
    gate|up at one row 11.72 us uncapped, 14.57 at 168, 23.31 at 128; `2x4d2p9` 15.90, 14.38 at 128).
    pairs (GeGLU only): the weight is in the paired layout (`pair_order`: a 16-row tile holds 8 outputs' gate
    and up rows), so a program of `tiles` tiles makes 8 x tiles outputs, any tiles count; without it a
    GeGLU program is a gate tile and its up tile (tiles 2).
    cuda (config text 'cudaWxS[cC][g]'): the launch is kernels/cuda_gemm.py's CUDA C++ kernel instead, `warps` warps a
    CTA (one 16-row tile each over the CTA's K slice), `depth` its ring stages (groups of words in flight a warp),
    `splits` the CTAs of a cluster that split K, `pairs` GeGLU on the paired layout (else a plain store); the other
    fields unused. Built with nvcc when FuseLayers settles the table (`settle_cuda_entries`, which puts the Triton
    entry of CUDA_FALLBACKS in its place where the device cannot run it), else on first use."""
    tiles: int = 1
    warps: int = 4
    depth: int = 64
    iters: int = 1
    splits: int = 1
    persist: int = 0
    fresh: bool = False
    hw: int = 0
    regs: int = 0
    pairs: bool = False
    cuda: bool = False

    @property
    def num_warps(self) -> int:
        return self.hw or self.warps

    @property
    def launch(self) -> dict:
        """The launch's compile options: warps, and the register cap where one is set."""
        return dict(num_warps=self.num_warps, **({"maxnreg": self.regs} if self.regs else {}))


# (N, K, rows > 1) -> the fastest config on the H200 for the E4B shapes where this kernel beats the one the
# engine launches otherwise (`bench_mma`, runs DB and DG, us: this / that; one row: the fused int4 GEMV without
# a prologue; 8 rows: the per-group tl.dot kernel). `mma_config` is None elsewhere. Down at one row without a K
# split (10.33 / 10.99) made the one-row step slower (run DC: 2.210 -> 2.321 ms); split over 5 programs per
# tile pair: 2.178 -> 2.121 ms in run DH, 2.173 -> 2.174 in run DL. The one-row GEMVs with a prologue
# (q|k|v, q, gate|up) run it after kernels/residual_norm.py (fused with it: 7.39, 5.55, 15.43 us): the step
# 2.177 -> 2.105 ms with the q|k|v entries, -> 2.030 with gate|up too (run DK; 2.032 in run DL). Run DO: the
# persistent kernel with fresh chains (persist=9: one tile per program at these shapes), the same config at 1
# and 8 rows where it is the faster or within 0.3 us: the step 2.036 -> 1.968 ms.
MMA_CONFIGS: dict[tuple[int, int, bool], MmaConfig] = {
    (2560, 2048, False): MmaConfig(2, 4, 5, persist=9, fresh=True),  # o: 3.56 (run DO)
    (2560, 4096, False): MmaConfig(2, 8),  # o full: 4.02 / 5.06
    (2560, 10240, False): MmaConfig(2, 8, 3, persist=1),  # down: 7.12 (run DO; K split 2x2s5: 8.39)
    (2560, 256, False): MmaConfig(1, 1),  # PLE projection: 1.16 / 1.34
    (3072, 2560, False): MmaConfig(2, 4, 5, persist=9, fresh=True),  # q|k|v 3.83, after the residual update + norm
    (6144, 2560, False): MmaConfig(2, 4, 5, persist=9, fresh=True),  # q|k|v full 4.08, after the residual update + norm
    (2048, 2560, False): MmaConfig(2, 4, 5, persist=9, fresh=True),  # q 3.52 (KV-shared layers), after the norm
    # q full (the 3 KV-shared full layers): the norm fold's consumer, 4.3 us on the step's critical path where
    # the fused int4 GEMV with its norm prologue took 8.1 (run GE: AR step 1.761 -> 1.750 ms with the fold)
    (4096, 2560, False): MmaConfig(2, 4, 5, persist=9, fresh=True),
    # gate|up + GeGLU, after residual + norm: 12.23; its two tiles in the paired layout (adjacent words): 11.51
    # against 11.82 for the gate / up tile pair (run IW), now CUDA_FALLBACKS' entry. The CUDA kernel
    # (kernels/cuda_gemm.py; that Triton entry where nvcc or sm_90 is missing), also as the norm fold's consumer:
    # 9.53 us against 12.91 for the Triton fold, the frontier AR step 1.705 -> 1.615 ms (run JX)
    (20480, 2560, False): MmaConfig(1, 5, 8, pairs=True, cuda=True),
    # W_plm (10752 x 2560, the embedding's PLE context projection, `_embed`): no entry. 1x4i2 took 6.19 us alone
    # against the int4 GEMV's 9.54, but in the step it waits on the embedding's kernels and held as much of the
    # critical path (run LF: 1.549 -> 1.552 ms)
    (3072, 2560, True): MmaConfig(2, 4, 5, persist=9, fresh=True),  # q|k|v: 4.09 (run DO)
    (6144, 2560, True): MmaConfig(2, 4, 5, persist=9, fresh=True),  # q|k|v full: 4.51
    (2048, 2560, True): MmaConfig(2, 4, 5, persist=9, fresh=True),  # q: 3.73
    (2560, 2048, True): MmaConfig(2, 4, 5, persist=9, fresh=True),  # o: 3.28
    (2560, 4096, True): MmaConfig(2, 8),  # o full: 4.42 / 6.87
    (2560, 256, True): MmaConfig(1, 1),  # PLE projection: 1.29 / 2.47
    (2560, 10240, True): MmaConfig(1, 1, splits=8),  # down: 7.56 / 11.03
    # gate|up (GeGLU): 12.43 (run IW); the CUDA kernel as at one row (the same sums at 1 and 8 rows): 9.70 against
    # 12.53 alone (run JR), the verify pass without fuse.batch_invariant not timed with it
    (20480, 2560, True): MmaConfig(1, 5, 8, pairs=True, cuda=True),
}


# (N, K) -> config that fuse.batch_invariant reads at every row count ahead of the one-row entry: the
# shapes the default path runs elsewhere (W_plm, the PLE context projection: cuBLAS / the int4 GEMV in the
# embedding; q of the KV-shared full layers: the fused int4 GEMV with its prologue) and down, whose one-row
# entry (persistent, 2 tiles x 8 warps) made the k=7 verify pass ~176 us slower under PDL than its 8-row
# split-K entry (run EH's profile: the GEMMs +173 us, the residual-norm kernels waiting on them +339 us)
INVARIANT_CONFIGS: dict[tuple[int, int], MmaConfig] = {
    (10752, 2560): MmaConfig(2, 4, 5, persist=9, fresh=True),
    (4096, 2560): MmaConfig(2, 4, 5, persist=9, fresh=True),
    (2560, 10240): MmaConfig(1, 1, splits=8),
    # gate|up on the CUDA kernel (kernels/cuda_gemm.py; the Triton entry where nvcc or sm_90 is missing): alone
    # 9.36 / 9.58 us at 1 / 8 rows against 11.58 / 12.44, the k=7 step 2.497 -> 2.352 ms (run JI); the one-row
    # entry is the same config since it takes the norm fold (run JX)
    (20480, 2560): MmaConfig(1, 5, 8, pairs=True, cuda=True),
}
SHIPPED_INVARIANT = dict(INVARIANT_CONFIGS)  # what set_table starts INVARIANT_CONFIGS from


_CONFIG_RE = r"(\d+)x(\d+)(?:d(\d+))?(?:i(\d+))?(?:s(\d+))?(?:p(\d+))?(f)?(?:n(\d+))?(?:r(\d+))?(g)?"
_CUDA_RE = r"cuda(\d+)x(\d+)(?:c(\d+))?(g)?"


def parse_config(text: str) -> MmaConfig:
    """'TxW[dD][iI][sS][pR][f][nH][rG][g]' (T tiles, W warps, D depth, I iters, S K splits, R persistent programs
    per multiprocessor, f fresh chains, H hardware warps, G registers per thread at most, g the paired GeGLU
    layout; e.g. '1x4s4', '2x4d2', '2x4d3p1f', '2x4d5p9fn8', '2x4d2p9r128', '1x4d5p9fg'), or 'cudaWxS[cC][g]' (the
    CUDA kernel: W warps a CTA, S ring stages, K over C CTAs of a cluster, g the paired GeGLU layout; e.g.
    'cuda5x8g', 'cuda5x10c8') -> MmaConfig."""
    import re

    c = re.fullmatch(_CUDA_RE, text.strip())
    if c:
        return MmaConfig(1, int(c.group(1)), int(c.group(2)), splits=int(c.group(3) or 1), pairs=c.group(4) == "g",
                         cuda=True)
    m = re.fullmatch(_CONFIG_RE, text.strip())
    if not m:
        raise ValueError(f"mma config {text!r}: TxW[dD][iI][sS][pR][f][nH][rG][g] or cudaWxS[cC][g], e.g. '1x4s4', "
                         "'2x4d2', '2x4d3p1', 'cuda5x8g' or 'cuda5x10c8'")
    t, w, d, i, sp, pr = (int(g) if g else None for g in m.groups()[:6])
    return MmaConfig(t, w, d or MmaConfig.depth, i or 1, sp or 1, pr or 0, m.group(7) == "f", int(m.group(8) or 0),
                     int(m.group(9) or 0), m.group(10) == "g")


def format_config(cfg: MmaConfig) -> str:
    """`parse_config`'s text for cfg (defaults left out): parse_config(format_config(c)) == c."""
    if cfg.cuda:
        return (f"cuda{cfg.warps}x{cfg.depth}" + (f"c{cfg.splits}" if cfg.splits != 1 else "")
                + ("g" if cfg.pairs else ""))
    return (f"{cfg.tiles}x{cfg.warps}" + (f"d{cfg.depth}" if cfg.depth != MmaConfig.depth else "")
            + (f"i{cfg.iters}" if cfg.iters != 1 else "") + (f"s{cfg.splits}" if cfg.splits != 1 else "")
            + (f"p{cfg.persist}" if cfg.persist else "") + ("f" if cfg.fresh else "")
            + (f"n{cfg.hw}" if cfg.hw else "") + (f"r{cfg.regs}" if cfg.regs else "") + ("g" if cfg.pairs else ""))


def set_table(table: dict[tuple, MmaConfig]) -> None:
    """Make `table` this process's tables (read when the fragment-order copies are made and when the steps are
    traced): its (N, K, rows > 1) entries all of MMA_CONFIGS, its (N, K) entries over the shipped INVARIANT_CONFIGS
    (the benchmarks' --mma-table)."""
    if table is not MMA_CONFIGS:
        MMA_CONFIGS.clear()
        MMA_CONFIGS.update({k: c for k, c in table.items() if len(k) == 3})
    INVARIANT_CONFIGS.clear()
    INVARIANT_CONFIGS.update({**SHIPPED_INVARIANT, **{k: c for k, c in table.items() if len(k) == 2}})


def parse_table(spec: str) -> dict[tuple, MmaConfig]:
    """A table written as entries CASE@ROWS=CONFIG joined by ',' (CASE a name of
    fused_w4a16.E4B_CASES, '_' for its spaces allowed, so a table passes through shell words; ROWS 1
    or more, or 'inv': INVARIANT_CONFIGS' entry, read at every row count under fuse.batch_invariant; CONFIG as
    `parse_config` reads it; e.g. 'down@1=1x4s4,o_full@8=2x4d8,down@inv=cuda5x10c8'), or 'none' (an empty table)
    -> {(N, K, rows > 1) or (N, K): config}, as `set_table` takes it. Clear errors for anything else."""
    import re

    from .fused_w4a16 import E4B_CASES

    table: dict[tuple, MmaConfig] = {}
    for item in [x.strip() for x in spec.split(",") if x.strip()]:
        if item == "none":
            continue
        m = re.fullmatch(r"(.+)@(\d+|inv)=(" + _CUDA_RE + "|" + _CONFIG_RE + ")", item)
        case = m and (m.group(1) if m.group(1) in E4B_CASES else m.group(1).replace("_", " "))  # W_plm, o_full
        if not m or case not in E4B_CASES or m.group(2) == "0":
            raise ValueError(f"mma table entry {item!r}: CASE@ROWS=TxW[dD][iI][sS][pR][f][nH][rG][g] (or "
                             f"cudaWxS[cC][g]; ROWS 1.. or 'inv') with CASE one of {sorted(E4B_CASES)}, e.g. "
                             "'down@1=1x4s4'")
        N, K, _ = E4B_CASES[case]
        table[(N, K) if m.group(2) == "inv" else (N, K, int(m.group(2)) > 1)] = parse_config(m.group(3))
    return table


def mma_config(N: int, K: int, M: int, epilogue: str = "none", invariant: bool = False) -> MmaConfig | None:
    """The table's config for M rows of x [M, K] @ W [N, K]^T, or None (this kernel is not the faster
    one there, M > MAX_ROWS, or a GeGLU launch without the gate / up tile pair or the paired layout). invariant
    (fuse.batch_invariant): the one-row entry (or INVARIANT_CONFIGS') at every M."""
    if not 1 <= M <= MAX_ROWS:
        cfg = None
    elif invariant:
        cfg = INVARIANT_CONFIGS.get((N, K)) or MMA_CONFIGS.get((N, K, False))
    else:
        cfg = MMA_CONFIGS.get((N, K, M > 1))
    if cfg is None or (cfg.pairs if epilogue != "geglu" else not (cfg.pairs or cfg.tiles == 2)):
        return None  # a GeGLU launch needs a gate / up tile pair or the paired layout, others not the latter
    return cfg


# (N, K) -> the Triton entry that takes a table's CUDA entry's place where the CUDA kernel cannot run (no nvcc, not
# sm_90), on the same words: gate|up's paired entry (run IW)
CUDA_FALLBACKS: dict[tuple[int, int], MmaConfig] = {
    (20480, 2560): MmaConfig(2, 4, 5, persist=9, fresh=True, pairs=True),
}


def settle_cuda_entries(device) -> list[str]:
    """At build time (FuseLayers): the table's CUDA entries built (nvcc in parallel), or, where `device` cannot run
    the CUDA kernel (kernels/cuda_gemm.device_problem), each become its shape's CUDA_FALLBACKS entry (or leaves the
    table where it has none: the launch the table does not cover), so the traced step reads a plain table. -> one
    line per entry replaced, saying why (empty: nothing replaced)."""
    entries = [(MMA_CONFIGS, k) for k, c in MMA_CONFIGS.items() if c.cuda]
    entries += [(INVARIANT_CONFIGS, k) for k, c in INVARIANT_CONFIGS.items() if c.cuda]
    if not entries:
        return []
    from .cuda_gemm import device_problem, prebuild, variants_of

    why = device_problem(torch.device(device))
    if why is None:  # built now, in parallel, rather than one by one as the step is traced
        failed = prebuild(variants_of((k[0], k[1], table[k]) for table, k in entries))
        if failed:
            raise RuntimeError("\n".join(failed.values()))
        return []
    lines = []
    for table, key in entries:
        fallback = CUDA_FALLBACKS.get(key[:2])
        if fallback is None:
            del table[key]
        else:
            table[key] = fallback
        rows = "" if table is INVARIANT_CONFIGS else (" (rows > 1)" if key[2] else " (1 row)")
        instead = format_config(fallback) if fallback else "no table entry"
        lines.append(f"{key[0]} x {key[1]}{rows}: {instead} instead ({why})")
    return lines


def table_pairs(N: int, K: int) -> bool:
    """Whether the table's entries for W [N, K] (MMA_CONFIGS at either row count, INVARIANT_CONFIGS) take
    the paired GeGLU layout; one copy of the words serves them all, so they must agree."""
    cfgs = [c for c in (MMA_CONFIGS.get((N, K, False)), MMA_CONFIGS.get((N, K, True)), INVARIANT_CONFIGS.get((N, K)))
            if c is not None]
    if len({c.pairs for c in cfgs}) > 1:
        raise ValueError(f"the tensor-core kernel's table mixes the paired GeGLU layout with the natural one for "
                         f"{N} x {K}: {', '.join(format_config(c) for c in cfgs)}")
    return bool(cfgs) and cfgs[0].pairs


def default_mma_config(N: int, K: int, group_size: int, epilogue: str = "none") -> MmaConfig:
    """At most 2,560 k per warp (40 words per lane in flight), at least 4 warps where K allows."""
    tiles = 2 if epilogue == "geglu" else 1
    warps = 1
    while warps < 8 and (K // warps > 1280 or warps < 4) and K % (2 * warps * group_size) == 0:
        warps *= 2
    return MmaConfig(tiles, warps)


def config_problem(cfg: MmaConfig, N: int, K: int, G: int, epilogue: str) -> str | None:
    """Why `mma_w4a16` cannot launch cfg for W [N, K] in groups of G with `epilogue`, or None."""
    if cfg.cuda:
        from .cuda_gemm import shape_problem

        return shape_problem(N, K, G, cfg.warps, cfg.depth, cfg.splits, cfg.pairs, epilogue)
    if cfg.persist < 0 or (cfg.persist and (cfg.iters > 1 or cfg.splits > 1)):
        return f"persist must be >= 0, and > 0 only with iters 1 and splits 1, got {cfg}"
    if cfg.fresh and not cfg.persist:
        return f"fresh runs in the persistent kernel only (persist > 0), got {cfg}"
    if cfg.depth < 1:
        return f"depth must be >= 1, got {cfg}"
    if cfg.hw < 0 or (cfg.hw and (cfg.warps * cfg.tiles) % cfg.hw):
        return f"hw (hardware warps) must divide warps x tiles = {cfg.warps * cfg.tiles}, got {cfg}"
    if cfg.regs and not 24 <= cfg.regs <= 255:
        return f"regs (registers per thread at most) must be 0 or 24..255, got {cfg}"
    if cfg.splits < 1 or (cfg.splits > 1 and cfg.iters > 1):
        return f"splits must be >= 1, and > 1 only with iters 1, got {cfg}"
    if K % (cfg.warps * cfg.splits * G):
        splits = f" x {cfg.splits} splits" if cfg.splits > 1 else ""
        return f"K={K} does not split into {cfg.warps} warps{splits} of whole groups of {G}"
    if cfg.pairs and epilogue != "geglu":
        return f"pairs (the paired GeGLU layout) goes with the geglu epilogue, got {epilogue!r}"
    if epilogue == "geglu" and not cfg.pairs and (cfg.tiles != 2 or (N // 2) % 16):
        return f"geglu needs tiles=2 and N/2 a multiple of 16 (or pairs), got {cfg}, N={N}"
    if (epilogue != "geglu" or cfg.pairs) and (N // 16) % cfg.tiles:
        return f"{N // 16} row tiles do not split into programs of {cfg.tiles}"
    if cfg.iters < 1 or (cfg.iters > 1 and cfg.depth < K // cfg.warps // G):
        return (f"iters must be >= 1, and > 1 only with every group in flight (depth >= {K // cfg.warps // G}), "
                f"got {cfg}")
    return None
