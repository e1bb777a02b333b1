"""The decode attention's launch plan (kernels/decode_attention.py): the split kernel's tiles for each
mode and layer kind, when a split loads its first K / V block before the PDL wait (`early_block`), the
split count, and the text forms of `fuse.attn_tiles` ('KIND:NxWsS[pP][eE]') with their checks."""
from __future__ import annotations

import functools

import torch
import triton

from .gemv import sm_count

_MAX_SPLITS = 64


def _tiles(D: int, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). D=512 takes BLOCK_N=32 so K+V bf16 tiles stay 64 KiB per
    stage like D=256 at 64. Compiled for sm_90: BLOCK_M*D <= 8192 at 4 warps uses <= 220 regs,
    76-100 KiB shared, no spills; larger tiles (verify rows x D=512) spill at 4 warps, so 8
    (BLOCK_M=64, D=512: 244 regs, 192 KiB shared)."""
    block_n = 64 if D <= 256 else 32
    num_warps = 4 if block_m * triton.next_power_of_2(D) <= 8192 else 8
    return block_n, num_warps, 2


# bytes a thread may hold of a split's first K / V block, loaded before the PDL wait (`early_block`)
EARLY_BYTES = 128


def early_block(qkv: int, block_m: int, block_n: int, block_d: int, itemsize: int, num_warps: int,
                per_position: bool = False) -> bool:
    """Whether a split kernel launch loads its first K / V block into registers before the PDL wait: the q/k/v
    modes (q is made after the wait, so the block's loads leave the path after it) at one row (a 16-row tile,
    not the per-position tiles) and a head dim of at most 256, where the block takes at most EARLY_BYTES a
    thread: E4B's sliding layers at one row (32 keys x 256 at 8 warps; sm_90a: 254-255 registers, no spills).
    The rest take it into L2: held in registers it spilled 1.3-3 KB a thread in the full layers' tiles (head
    dim 512), 336 bytes in a sliding store layer's 8-row tile and 8 in the batch-invariant verify pass's
    per-position tiles of a KV-shared sliding layer (229 registers without it; not timed on the GPU), where
    the L2 prefetch spills 0-208."""
    return (qkv > 0 and block_m <= 16 and block_d <= 256 and not per_position
            and 2 * block_n * block_d * itemsize <= EARLY_BYTES * num_warps * 32)


# a cache of at most this many slots (static: the CUDA graph's) counts as short for `_qkv_tiles`
SHORT_CACHE = 2048


def _qkv_tiles(D: int, block_m: int = 16, S: int | None = None, store: bool = True) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the q/k/v mode, whose q is made in registers. One row of a
    full layer (D=512, block_m 16) takes 32 keys at 4 warps: it spills (sm_90a: 88 / 208 bytes on a
    store / query-only layer) yet beat 16 keys at 8 warps on the H200 at every context of a store layer
    and from 4k tokens of a query-only one (alone, runs FA / FC, us; store: 12.6 vs 14.0 at 300, 12.8
    vs 16.2 at 4k, 50.5 vs 83.5 at 32k; query-only: 12.4 vs 15.4 at 4k, 50.7 vs 79.9 at 32k, at most
    0.7 us slower below). The bf16 decode step at 32k: 3.963 -> 3.658 ms (run FB). A store layer's
    one row over a short cache (S <= SHORT_CACHE slots) takes 16 warps instead (128 registers, no
    spills): alone 10.4-10.7 against 12.8-13.5 us at S 1,088 (runs FC, FI), slower from ~4k tokens of
    context (14.5 vs 12.9 at 4k, run FC); the int4 step at S 528-1,072, window 188, one process:
    1.893 -> 1.869 ms (run FF), 1.897 -> 1.874 (run FG, the order reversed). Otherwise half `_tiles`'
    key block and 8 warps: compiled for sm_90a, 1 and 8 rows, D=256 and 512, store and query-only
    layers, no spills (`_tiles`' 64 / 32 keys at 4 warps spilled 1,308 / 2,292 bytes at one row with
    the own rows in the same program)."""
    if D > 256 and block_m <= 16:
        return (32, 16, 2) if store and S is not None and S <= SHORT_CACHE else (32, 4, 2)
    return (32 if D <= 256 else 16), 8, 2


def pick_num_splits(B: int, Hkv: int, row_tiles: int, S: int, block_n: int, num_sms: int) -> int:
    """Enough splits for about one wave of programs (B*Hkv*row_tiles*splits ~ num_sms), never more
    than the BLOCK_N blocks in S, at most 64. Splits past the live range exit at once, so a large S
    with a short context costs only empty programs. E4B decode B=1 on 132 SMs: full layer (S=32k)
    64 splits, sliding ring (S=528) 9 splits."""
    want = triton.cdiv(num_sms, B * Hkv * row_tiles)
    return max(1, min(want, triton.cdiv(S, block_n), _MAX_SPLITS))


def check_tiles(tiles) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) as the split kernel takes them: BLOCK_N a power of two >= 16
    (tl.dot), warps a power of two 1..16, stages >= 1; else a ValueError naming the bad value."""
    try:
        bn, w, st = (int(t) for t in tiles)
    except (TypeError, ValueError):
        raise ValueError(f"attention tiles must be (BLOCK_N, num_warps, num_stages), got {tiles!r}") from None
    if bn < 16 or bn & (bn - 1) or w not in (1, 2, 4, 8, 16) or st < 1:
        raise ValueError(f"attention tiles (BLOCK_N, num_warps, num_stages) = {(bn, w, st)}: BLOCK_N a power of "
                         "two >= 16, num_warps a power of two up to 16, num_stages >= 1")
    return bn, w, st


def parse_tiles(text: str) -> tuple[int, int, int]:
    """'NxWsS' (e.g. '32x8s2': 32 keys per block, 8 warps, 2 stages) -> checked tiles."""
    import re

    m = re.fullmatch(r"(\d+)x(\d+)s(\d+)", text.strip())
    if not m:
        raise ValueError(f"attention tiles {text!r}: BLOCKNxWARPSsSTAGES, e.g. '32x8s2'")
    return check_tiles(tuple(int(g) for g in m.groups()))


def tiles_text(tiles) -> str:
    """(BLOCK_N, num_warps, num_stages) -> 'NxWsS', the form `parse_tiles` reads."""
    return "{}x{}s{}".format(*tiles)


def qkv_tiles_text(tiles: dict[str, str]) -> str:
    """`parse_qkv_tiles`' {kind: 'NxWsS'} -> 'KIND:NxWsS,...' ('' for none), the form it reads."""
    return ",".join(f"{k}:{v}" for k, v in tiles.items())


QKV_TILE_KINDS = ("full_store", "full_query", "sliding_store", "sliding_query")  # the q/k/v mode's layer kinds


def parse_qkv_tile(text: str) -> tuple[tuple[int, int, int], int | None, int | None]:
    """One kind's entry of `fuse.attn_tiles`, 'NxWsS[pP][eE]' -> (checked tiles, P: the cache's split count,
    the store layers' own-rows split added to it; None: the kernel's pick, E: 1, each split's first K / V
    block into registers before the PDL wait, 2: the q rows' cos / sin too, 0: the block into L2; None:
    `early_block`'s pick)."""
    import re

    m = re.fullmatch(r"\s*(\d+x\d+s\d+)(?:p(\d+))?(?:e([012]))?\s*", text)
    if not m:
        raise ValueError(f"attention tiles {text!r}: BLOCKNxWARPSsSTAGES[pSPLITS][eEARLY], e.g. '32x8s2', "
                         "'32x8s2p3' or '32x8s2e0' (EARLY 1: the first K / V block into registers before the PDL "
                         "wait, 2: the q rows' cos / sin too, 0: the block into L2)")
    splits = int(m.group(2)) if m.group(2) else None
    if splits is not None and not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"attention tiles {text!r}: the split count must lie in 1..{_MAX_SPLITS}")
    return parse_tiles(m.group(1)), splits, None if m.group(3) is None else int(m.group(3))


def qkv_tile_text(tiles, splits: int | None = None, early: int | None = None) -> str:
    """`parse_qkv_tile`'s inverse: 'NxWsS', with 'pP' when splits are given and 'eE' when early is."""
    return tiles_text(tiles) + (f"p{splits}" if splits else "") + ("" if early is None else f"e{int(early)}")


def parse_qkv_tiles(text) -> dict[str, str]:
    """`fuse.attn_tiles`: 'KIND:NxWsS[pP][eE]' entries joined by ',' or as a list (KIND: full / sliding layer,
    store / query-only: QKV_TILE_KINDS; P: the cache's split count, else the kernel's pick; E: 1 / 0, the
    first K / V block before the PDL wait into registers / L2, 2: with the q rows' cos / sin, else
    `early_block`'s pick), '' / [] for
    none -> {kind: 'NxWsS[pP][eE]'}, each checked; the kinds not named keep `_qkv_tiles`' choice. A
    ValueError names a bad entry."""
    items = text.split(",") if isinstance(text, str) else [str(t) for t in (text or ())]
    out = {}
    for item in items:
        if not item.strip():
            continue
        kind, eq, tiles = item.partition(":")
        kind = kind.strip()
        if not eq or kind not in QKV_TILE_KINDS:
            raise ValueError(f"attention tiles entry {item.strip()!r}: KIND:BLOCKNxWARPSsSTAGES[pSPLITS][eEARLY] with "
                             f"KIND one of {', '.join(QKV_TILE_KINDS)}, e.g. 'full_store:32x16s2'")
        if kind in out:
            raise ValueError(f"attention tiles: {kind} given twice in {text!r}")
        out[kind] = qkv_tile_text(*parse_qkv_tile(tiles))
    return out


@functools.lru_cache(maxsize=None)
def _tiles_arg(text: str) -> dict:
    """An op's `tiles` string ('': the kernel's own) -> decode_attention_qkv's tiles, num_splits and early,
    parsed once per string."""
    tiles, splits, early = parse_qkv_tile(text) if text else (None, None, None)
    return dict(tiles=tiles, num_splits=splits, early=early)


def _plan(shape, S: int, Hkv: int, qkv: int, num_splits, per_position: bool, tiles, device,
          moving_lo: bool = False):
    """(block_m, row_tiles, (BLOCK_N, num_warps, num_stages), num_splits, pos_q) of a launch: the split
    kernel's tile, its split count (QKV 2: with the own rows' split) and the positions a group tile
    holds (the split kernel's POS_Q; moving_lo, a window over a linear cache, whose first key moves
    with each position: 1)."""
    B, T, H, D = shape
    G = H // Hkv
    # per_position: the tile of a one-row launch (tl.dot needs M >= 16), its rows of pos_q positions
    # (E4B: 4 query heads, 4 positions) a tile; T consecutive positions lie in up to
    # cdiv(T - 1, pos_q) + 1 aligned groups
    block_m = min(64, max(16, triton.next_power_of_2(G if per_position else G * T)))
    pos_q = 1 if moving_lo else max(1, block_m // G)
    row_tiles = triton.cdiv(T - 1, pos_q) + 1 if per_position else triton.cdiv(G * T, block_m)
    # per_position with q as given (the batch-invariant store layers) takes the q/k/v mode's tiles too: the
    # sliding layers' 32 keys at 8 warps, so as many splits as their KV-shared layers (not `_tiles`' 64 keys in 4
    # splits: the invariant AR step -26 to -28 us, the k=7 step -14 to -21 us on an H100, runs MS, MT)
    tiles = tiles or (_qkv_tiles(D, block_m, S, qkv == 2) if qkv or per_position else _tiles(D, block_m))
    if num_splits is None:
        num_splits = pick_num_splits(B, Hkv, 1 if per_position else row_tiles, S, tiles[0], sm_count(device))
    # QKV 2: one split more, for the step's own rows
    return block_m, row_tiles, tiles, max(1, int(num_splits)) + (qkv == 2), pos_q


def qkv_splits(k_cache: torch.Tensor, heads: int, head_dim: int, store: bool, tiles: str = "") -> int:
    """The split count of a one-row `decode_attention_qkv` launch over k_cache (its own rows' split
    included for a store layer); tiles as the ops take them. A constant of the shapes: torch.compile
    takes its value instead of tracing it."""
    return _qkv_splits(k_cache.shape[1], k_cache.shape[2], heads, head_dim, store, tiles, str(k_cache.device))


@torch.compiler.assume_constant_result
def _qkv_splits(S: int, Hkv: int, heads: int, head_dim: int, store: bool, tiles: str, device: str) -> int:
    arg = _tiles_arg(tiles)
    return _plan((1, 1, heads, head_dim), S, Hkv, 2 if store else 1, arg["num_splits"], False, arg["tiles"],
                 torch.device(device))[3]
