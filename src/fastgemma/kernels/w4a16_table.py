"""The W4A16 kernels' tiles (kernels/w4a16.py): the config of one launch, the table of the E4B shapes
on the H200 (`CONFIGS`, by row bucket), the fallback for other shapes and `resolve_config`, which fits
a config to its shape; `candidates`, what the benchmark (kernels/w4a16_bench.py) sweeps."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import triton

MAX_DECODE_M = 16
_SMS = 132  # H200; the default heuristic's target for program counts


@dataclass(frozen=True)
class W4A16Config:
    """Tile sizes of one launch. block_m == 1 -> `_gemv_kernel` (grid over rows of x);
    block_m >= 16 -> `_mma_kernel`. block_k is a power-of-two multiple of the group size."""
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    block_m: int = 1
    factored: bool = True  # GEMV only: scale / zero once per group (False: per weight, the baseline)
    words: bool = False  # GEMV only, factored: the int32 word loop (False: the byte loop)
    per_group: bool = False  # tl.dot only: `_group_mma_kernel` (block_k = the group size)
    dequant: bool = False  # prompt chunks: W dequantized to x's dtype in one launch (block_n rows x
    #                        block_k columns per program), then cuBLAS (F.linear); scratch N x K


def _gemv(bn, bk, split=1, warps=None, stages=3, words=False):
    # default warps: one 16-byte weight vector per thread and iteration
    warps = warps or max(1, min(8, bn * bk // 2 // 16 // 32))
    return W4A16Config(bn, bk, split, warps, stages, 1, words=words)


def _mma(bn, bk, split=1, warps=4, stages=3, bm=16):
    return W4A16Config(bn, bk, split, warps, stages, bm)


def _grp(bn, split=1, warps=4, stages=3, bm=16):
    return W4A16Config(bn, 128, split, warps, stages, bm, per_group=True)


def _deq(bn, bk):
    return W4A16Config(bn, bk, 1, 4, 1, 64, dequant=True)


# (m_bucket, N, K) -> config; m_bucket = 1 (GEMV), 16 (M <= 16), 64 (prompt chunks); chunks of
# DEQUANT_MIN_M (256) rows or more look up (256, N, K) first (table_config).
# M = 1: the GEMV is bound by its per-weight instructions (~8 per weight in the byte loop's sm_90a
# code), not by its tiling. The word loop (~3.6 at 16-32 rows per program) wins where N is large
# (gate|up 19.58 -> 12.55 us, W_plm 12.44 -> 9.62); below ~10k rows its larger tiles leave too few
# programs and the byte loop's small tiles stay ahead. The per-group tl.dot kernel loses at one row.
# M = 8: the first tl.dot kernel (MMA_M16) dequantized a [BLOCK_N, BLOCK_K] tile and reshaped it, so
# Triton moved the bf16 weights through shared memory into the mma layout; the per-group kernel
# converts the code bytes instead and is 1.1-1.8x faster, below cuBLAS reading bf16 on gate|up and
# down. `bench_shapes(sweep=True)` prints lines to paste here.
CONFIGS: dict[tuple[int, int, int], W4A16Config] = {
    # M = 1: bench_shapes(sweep=True) on the H200 (2026-11-30, graph-timed, weights out of L2), us,
    # factored kernel (scale / zero once per group); cuBLAS bf16 on the same shape after the slash.
    # Byte loop rows: this config / the word loop on its tiles (run P), else an earlier run.
    (1, 2048, 2560): _gemv(4, 512, 1, 2),     # q (KV-shared layers): 5.42 / 6.78 / 6.73
    (1, 4096, 2560): _gemv(4, 512, 1, 2),     # q (full, head_dim 512): 6.40 / 8.07 / 8.01
    (1, 512, 2560): _gemv(4, 512, 1, 2),      # k / v (sliding): 4.68 / 6.36
    (1, 1024, 2560): _gemv(4, 512, 1, 2),     # k / v (full): 4.93 / 15.22
    (1, 3072, 2560): _gemv(4, 512, 1, 2),     # q|k|v merged (sliding): 5.93 / 7.29 / 7.24
    (1, 6144, 2560): _gemv(4, 512, 1, 2),     # q|k|v merged (full): 7.93 / 10.14 / 11.45
    (1, 2560, 2048): _gemv(4, 1024, 1, 4),    # o (sliding): 4.26 / 4.74 / 6.22
    (1, 2560, 4096): _gemv(4, 1024, 1, 4),    # o (full): 6.08 / 7.76 / 10.59
    (1, 10240, 2560): _gemv(4, 512, 1, 2),    # gate / up: 12.02 / 15.27
    (1, 2560, 10240): _gemv(4, 1024, 1, 4),   # down: 11.87 / 16.46 / 18.15
    (1, 256, 2560): _gemv(4, 512, 1, 4),      # PLE gate (skipped by default): 4.17 / 6.31
    (1, 2560, 256): _gemv(4, 256, 1, 2),      # PLE projection: 2.10 / 2.36 / 3.22
    # word loop (run P): this config / the byte loop on the old table's tiles / cuBLAS bf16
    (1, 20480, 2560): _gemv(16, 512, 1, 2, words=True),  # gate|up merged: 12.55 / 19.58 / 28.21
    (1, 10752, 2560): _gemv(16, 512, 1, 2, words=True),  # W_plm: 9.62 / 12.44 / 15.40
    # the int4 head (lm_head=int4), run V: 106.98 us (3.3 TB/s) / the byte loop at 16 x 512, 8 warps 218.99
    (1, 262144, 2560): _gemv(32, 512, 1, 2, words=True),
    # the pruned head's 12,288 rows in int4 (lm_head.dtype=int4): not timed; W_plm's tiles, the nearest shape
    # timed (10,752 rows: the word loop 9.62 us against the byte loop's 12.44, run P)
    (1, 12288, 2560): _gemv(16, 512, 1, 2, words=True),
    # M = 2..16 (the verify pass): the per-group kernel on packed scale / zero words (`pack_scale_zero`,
    # streamed ahead with the codes). bench_shapes(ms=(8,), sweep=True, per_group_only=True, packed=True)
    # on the H200 (2026-11-30, graph-timed, weights out of L2), us at M = 8: this config (run BD, which
    # added 32 rows per warp: 64 x 2 warps) / run BA's best on 16 rows per warp / the previous entry
    # (PER_GROUP_SEPARATE) on separate scales / zeros (run BA) / cuBLAS bf16 (run BD)
    (16, 2048, 2560): _grp(32, 4, 2),       # q (KV-shared layers): 5.45 / 5.46 / 6.84 / 6.75
    (16, 4096, 2560): _grp(64, 4, 2),       # q (full): 6.23 / 6.38 / 7.93 / 7.91
    (16, 3072, 2560): _grp(64, 5, 2),       # q|k|v: 5.70 / 5.99 / 7.06 / 7.17
    (16, 6144, 2560): _grp(64, 5, 2),       # q|k|v (full): 7.10 / 7.42 / 8.82 / 10.38
    (16, 2560, 2048): _grp(64, 8, 2),       # o: 5.35 / 5.38 / 6.83 / 6.18
    (16, 2560, 4096): _grp(64, 8, 2),       # o (full): 6.80 / 7.34 / 7.85 / 9.43
    # gate|up runs with the GeGLU epilogue (block_n = rows of each half), run BD, us: 32/4/2 15.46,
    # 32/2/2 15.82 (run BA: 15.80; separate scales / zeros 18.56), 64/4/2 17.15, 16/2/1 17.21, 32/1/2
    # 18.62, 64/2/2 18.61; plain (no epilogue) 64/2/2 15.09, 32/2/2 17.51; cuBLAS bf16 28.64
    (16, 20480, 2560): _grp(32, 4, 2),      # gate|up
    (16, 2560, 10240): _grp(64, 8, 2),      # down: 11.06 / 12.74 / 13.80 / 18.31
    (16, 2560, 256): _grp(16, 1, 1),        # PLE projection: 2.74 / 2.72 / 3.46 / 3.18
    (16, 10752, 2560): _grp(64, 4, 2),      # W_plm: 9.49 / 10.83 / 13.14 / 15.52
    (16, 262144, 2560): _mma(64, 128),      # head: 254.32 with this tl.dot config; per-group untimed
    # M > 16 (prompt chunks): the per-group kernel on large tiles. bench_shapes(ms=(256,), sweep=True,
    # graph=False) on the H200 (2026-11-30, eager launches, weights out of L2), us at M = 256: this
    # config / the first tl.dot kernel's default (_mma(64, 256, 1, 4, 3, 64)) / cuBLAS bf16
    (64, 3072, 2560): _grp(64, 1, 4, 3, 64),     # q|k|v: 35.07 / 35.44 / 14.11
    (64, 6144, 2560): _grp(64, 1, 4, 3, 64),     # q|k|v (full): 39.01 / 65.98 / 19.50
    (64, 2560, 2048): _grp(64, 1, 4, 3, 64),     # o: 25.38 / 30.59 / 11.02
    (64, 2560, 4096): _grp(64, 1, 4, 3, 128),    # o (full): 49.25 / 101.17 / 16.38
    (64, 20480, 2560): _grp(64, 1, 4, 3, 128),   # gate|up: 103.90 / 161.30 / 46.50
    (64, 2560, 10240): _grp(64, 1, 4, 3, 64),    # down: 101.10 / 125.31 / 33.66
    (64, 2560, 256): _grp(64, 1, 4, 3, 64),      # PLE projection: 7.14 / 9.25 / 6.59
    (64, 10752, 2560): _grp(128, 1, 8, 3, 256),  # W_plm: 62.02 / 97.41 / 28.54
    # M >= 256: W dequantized once per call, then cuBLAS, where it wins. bench_shapes(ms=(256,),
    # sweep=True, graph=False) on the H200 (run AF, eager launches, weights out of L2), us at M = 256:
    # this config / the per-group kernel's best tiles / cuBLAS bf16. Smaller shapes keep the M > 16
    # entries above (eager timings below ~50 us were launch-bound in that run)
    (256, 20480, 2560): _deq(16, 512),     # gate|up: 86.06 / 99.46 / 46.40
    (256, 2560, 10240): _deq(16, 1024),    # down: 52.83 / 92.90 / 33.73
    (256, 10752, 2560): _deq(16, 512),     # W_plm: 49.86 / 64.35 / 28.02
}

# M = 2..16, the per-group kernel on separate scales / zeros (PACKED_SZ = False): the table before
# the packed words, kept as the baseline of `bench.spec --verify-tiles separate`. Run AF (2026-11-30),
# us at M = 8; PLE projection and W_plm re-swept then
PER_GROUP_SEPARATE: dict[tuple[int, int, int], W4A16Config] = {
    (16, 2048, 2560): _grp(64, 5, 4),       # q (KV-shared layers): 6.82
    (16, 4096, 2560): _grp(64, 5, 4),       # q (full): 7.76
    (16, 3072, 2560): _grp(64, 5, 4),       # q|k|v: 7.02
    (16, 6144, 2560): _grp(32, 4, 2),       # q|k|v (full): 8.80
    (16, 2560, 2048): _grp(32, 4, 2),       # o: 6.80
    (16, 2560, 4096): _grp(64, 8, 4),       # o (full): 7.77
    (16, 20480, 2560): _grp(32, 2, 2),      # gate|up: 17.00 (GeGLU epilogue: 18.50, run AL)
    (16, 2560, 10240): _grp(64, 8, 4),      # down: 13.81
    (16, 2560, 256): _grp(32, 1, 2),        # PLE projection: 2.68
    (16, 10752, 2560): _grp(64, 4, 4),      # W_plm: 13.14
}

# M = 2..16 through the first tl.dot kernel (`_mma_kernel`): the table before the per-group
# kernel, kept as the baseline of `bench.spec --verify-tiles mma`. bench_shapes(ms=(8,), sweep=True)
# on the H200 (2026-11-30), us at M = 8: this config / the first untimed guess / cuBLAS bf16
MMA_M16: dict[tuple[int, int, int], W4A16Config] = {
    (16, 2048, 2560): _mma(32, 256, 5),     # q: 10.31 / 17.66 / 6.74
    (16, 4096, 2560): _mma(64, 128, 2),     # q (full): 13.42 / 23.61 / 7.97
    (16, 3072, 2560): _mma(32, 256, 5),     # q|k|v: 12.56 / 23.64 / 7.24
    (16, 6144, 2560): _mma(64, 128, 2),     # q|k|v (full): 15.37 / 23.20 / 10.61
    (16, 2560, 2048): _mma(32, 256, 4),     # o: 10.26 / 19.38 / 6.22
    (16, 2560, 4096): _mma(32, 256, 8),     # o (full): 15.80 / 27.54 / 10.45
    (16, 20480, 2560): _mma(64, 128, 2),    # gate|up: 27.37 / 33.96 / 29.50
    (16, 2560, 10240): _mma(32, 256, 8),    # down: 29.82 / 63.58 / 18.39
    (16, 2560, 256): _mma(64, 256),         # PLE projection: 2.85 / 4.33 / 3.19
    (16, 10752, 2560): _mma(64, 128, 2),    # W_plm: 18.93 / 31.59 / 15.78
}


DEQUANT_MIN_M = 256  # prompt chunks of this many rows look up the (256, N, K) entries first


def m_bucket(M: int) -> int:
    return 1 if M == 1 else (MAX_DECODE_M if M <= MAX_DECODE_M else 64)


def table_config(M: int, N: int, K: int) -> W4A16Config | None:
    """CONFIGS' entry for this launch: (m_bucket, N, K); chunks of DEQUANT_MIN_M rows or more try
    (DEQUANT_MIN_M, N, K) first (dequantizing W once costs the same for any M: worth it on long
    chunks, not on short ones)."""
    if M >= DEQUANT_MIN_M and (DEQUANT_MIN_M, N, K) in CONFIGS:
        return CONFIGS[(DEQUANT_MIN_M, N, K)]
    return CONFIGS.get((m_bucket(M), N, K))


def default_config(M: int, N: int, K: int) -> W4A16Config:
    """Shapes missing from CONFIGS: halve BLOCK_N until there are ~2 waves of programs."""
    bucket = m_bucket(M)
    if bucket == 1:
        bn = 8
        while bn > 2 and triton.cdiv(N, bn) < 2 * _SMS:
            bn //= 2
        return _gemv(bn, 512)
    if bucket == MAX_DECODE_M:
        bn = 32 if N >= 8192 else 16
        split = max(1, min(8, (2 * _SMS) // triton.cdiv(N, bn)))
        return _grp(bn, split, bn // 16)
    return _mma(64, 256, 1, 4, 3, 64)


def resolve_config(M: int, N: int, K: int, group_size: int, config: W4A16Config | None = None) -> W4A16Config:
    """The config a launch uses: `config`, else CONFIGS[(m_bucket, N, K)], else default_config,
    fitted to the shape: block_k -> the largest G * 2^j <= block_k dividing K; split_k -> the
    largest divisor of K / block_k <= split_k (so no K masks are needed). K / split_k is a
    constexpr of the kernels: one compile per (K, split, tiles), so warm up before graph capture."""
    cfg = config or table_config(M, N, K) or default_config(M, N, K)
    for name in ("block_n", "block_m"):
        v = getattr(cfg, name)
        if v < 1 or v & (v - 1):
            raise ValueError(f"W4A16Config.{name} must be a power of two, got {v}")
    if cfg.block_m != 1 and cfg.block_m < 16:
        raise ValueError(f"W4A16Config.block_m must be 1 (GEMV) or >= 16 (tl.dot), got {cfg.block_m}")
    if cfg.block_m >= 16 and cfg.block_n < 16:
        raise ValueError(f"tl.dot needs block_n >= 16, got {cfg.block_n}")
    if cfg.per_group and cfg.block_m == 1:
        raise ValueError("W4A16Config.per_group needs block_m >= 16 (it is a tl.dot kernel)")
    if cfg.dequant and (cfg.per_group or cfg.block_m == 1 or cfg.split_k != 1):
        raise ValueError("W4A16Config.dequant is a prompt-chunk path: block_m >= 16, no split_k, not per_group")
    bk = group_size
    while bk * 2 <= cfg.block_k and K % (bk * 2) == 0 and not cfg.per_group:
        bk *= 2
    blocks = K // bk
    split = max(d for d in range(1, min(cfg.split_k, blocks) + 1) if blocks % d == 0)
    if (bk, split) == (cfg.block_k, cfg.split_k):
        return cfg
    return dataclasses.replace(cfg, block_k=bk, split_k=split)


E4B_SHAPES: dict[str, tuple[int, int]] = {  # name: (N, K)
    "q": (2048, 2560), "k/v": (512, 2560), "o": (2560, 2048),
    "q_full": (4096, 2560), "k/v_full": (1024, 2560), "o_full": (2560, 4096),
    "qkv": (3072, 2560), "qkv_full": (6144, 2560),
    "gate/up": (10240, 2560), "gate|up": (20480, 2560), "down": (2560, 10240),
    "ple_gate": (256, 2560), "ple_proj": (2560, 256), "w_plm": (10752, 2560),
    "head_12k": (12288, 2560),  # the pruned head's rows in int4 (lm_head=pruned lm_head.dtype=int4)
}


def candidates(M: int, N: int, K: int, per_group_only: bool = False) -> list[W4A16Config]:
    """The grid `bench_shapes(sweep=True)` tries (before resolve_config fits it to the shape).
    Kept to ~16 per kernel: each distinct (K / split_k, tiles) is one compile."""
    if per_group_only:
        return per_group_candidates(M) if M <= MAX_DECODE_M else prefill_candidates()
    if M == 1:  # byte loop: small tiles; word loop: several rows per thread (they share x's loads)
        out = [_gemv(bn, bk, sk) for bn in (2, 4, 8) for bk in (512, 1024) for sk in (1, 2)]
        out += [_gemv(bn, bk, sk, w, words=True) for bn, bk, sk, w in (
            (8, 512, 1, 2), (16, 512, 1, 2), (16, 512, 2, 2), (32, 512, 1, 2), (32, 512, 2, 2), (32, 512, 4, 2),
            (16, 1024, 1, 4), (32, 1024, 1, 4), (32, 1024, 2, 4))]
        # one group an iteration (block_k = 128): no reshape into groups, so on sm_90a the word loop has no
        # barrier and no shared memory (22-24 barriers an iteration at block_k 512); not timed yet
        out += [_gemv(bn, 128, sk, w, words=True) for bn, sk, w in ((16, 1, 1), (32, 1, 2), (64, 1, 4), (32, 2, 2))]
        return out + per_group_candidates(M)
    if M > MAX_DECODE_M:  # prefill: large tiles, no splits; the first tl.dot kernel's default as the baseline
        return [default_config(M, N, K), _mma(128, 128, 1, 8, 3, 128)] + prefill_candidates() + [
            _deq(bn, bk) for bn, bk in ((32, 512), (64, 512), (16, 1024))]
    bm = MAX_DECODE_M
    out = [_mma(bn, bk, sk, 4, 3, bm) for bn in (16, 32, 64) for bk in (128, 256) for sk in (1, 2)]
    out += [_mma(bn, 256, sk, 4, 3, bm) for bn in (16, 32) for sk in (4, 8)] + [_mma(64, 256, 1, 8, 3, bm)]
    return out + per_group_candidates(M)


def prefill_candidates() -> list[W4A16Config]:
    """`_group_mma_kernel` tiles (block_n, block_m, warps, stages) for prompt chunks (M > 16)."""
    return [_grp(bn, 1, w, st, bm) for bn, bm, w, st in (
        (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3),
        (64, 256, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4))]


def per_group_candidates(M: int) -> list[W4A16Config]:
    """`_group_mma_kernel` tiles (block_n, split_k, warps), 16-row dot tiles, for M <= 16."""
    # 32 rows per warp (64 / 2 warps) share each group's x fragments over two row tiles: ~20% fewer
    # loop instructions per row than 16 rows per warp, at ~146 registers. The last five: the cp.async
    # pipeline's depth (2 or 4 stages instead of 3) on the tiles runs BA / BD chose most
    out = [_grp(bn, sk, w) for bn, sk, w in ((16, 1, 1), (16, 4, 1), (32, 1, 2), (32, 2, 2), (32, 4, 2), (64, 1, 4),
                                             (64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 1, 4), (128, 2, 8), (128, 4, 8),
                                             (64, 1, 2), (64, 2, 2), (64, 4, 2), (64, 8, 2), (128, 2, 4), (128, 4, 4))]
    return out + [_grp(bn, sk, w, st) for bn, sk, w, st in ((32, 4, 2, 2), (32, 4, 2, 4), (64, 4, 2, 4), (64, 8, 2, 2),
                                                            (64, 8, 2, 4))]
