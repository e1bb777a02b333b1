"""W4A16 GEMM on the tensor cores in CUDA C++ (kernels/cuda/w4_gemm.cu) on mma_w4a16's int4 words: the launch
behind `MmaConfig.cuda` (config text 'cudaWxS[cC][g]': W warps a CTA, one 16-row tile each; S ring stages of a
group each; K split over C CTAs of a thread-block cluster; g: gate|up + GeGLU on the paired layout, else a plain
store on the natural one).

The Triton kernel holds a program's words in registers and sums them after they land, ~2.4 waves of load
then multiply; here each warp streams its tile through a cp.async ring in shared memory, so the arithmetic
of one group runs while the next ones are in flight (sweeps/probes, runs JC-JH: 9.1-9.4 us against 11.6-12.5
alone at 1 and 8 rows, E4B's gate|up). Where K is long and N short (down: 160 tiles over K 10,240) the C CTAs
of a cluster take a K slice each and add their partial sums through distributed shared memory, in rank order.

The library is built on first use with nvcc (the CUDA toolkit; sm_90a) into a cache directory
($FASTGEMMA_CUDA_CACHE, default ~/.cache/fastgemma/cuda), one per (warps, stages, K slice, cluster, epilogue),
and called through ctypes on the current stream, so CUDA graph capture records it. Numerics: the twin's
(mma_w4a16_ref) within bf16; not bit-equal to the Triton kernel (sums of x in another order), and a row's result
does not depend on the rows beside it (fuse.batch_invariant holds with the same config at every row count)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cuda") / "w4_gemm.cu"
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a CTA may take on sm_90
GROUP = 128


def nvcc() -> str | None:
    """nvcc from $CUDA_HOME (or $CUDA_PATH), else the PATH; None when there is none."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


MAX_CLUSTER = 8  # CTAs a cluster may hold without the non-portable opt-in
TRIGGER_ENV = "FASTGEMMA_W4_TRIGGER"
AFTER_LOOP = 9999  # a trigger point past every K slice's groups: after the main loop


def parse_trigger(text: str) -> tuple[int, int] | None:
    """'ONE,ROWS' -> TRIGGER: the groups (128 k each) of its K slice a warp of the plain kernel sums before its CTA
    lets the next kernel launch under it (PDL), at one row and at several; 0 at its start, AFTER_LOOP (or any count
    past the slice's groups) after its main loop. '' -> None: the kernel's own points."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{TRIGGER_ENV} takes 'ONE,ROWS', the groups a warp sums before the dependents may launch at "
                         f"one row and at several (0: at the start; {AFTER_LOOP}: after the main loop), got {text!r}")
    return int(parts[0]), int(parts[1])


# when the plain kernel lets its dependents launch; None: the kernel's own points, at several rows at its start (the
# verify pass: down's programs load their words under this kernel's stream; 12 or 16 groups of 20 in: k=7 verify
# 1.909 -> 1.958 / 1.974 ms, run NF), at one row once a warp has asked for its last group (KS / 128 - S: 12 of
# gate|up's 20; the batch-invariant step 1.908 -> 1.892 ms, run NG; at its start 0.10 ms slower, run LU: down's 1,280
# programs crowd it). $FASTGEMMA_W4_TRIGGER ('ONE,ROWS') builds others into a process's libraries (their names carry
# it), for an A/B
TRIGGER = parse_trigger(os.environ.get(TRIGGER_ENV, ""))
EPILOGUES = {"none": 0, "geglu": 1}


def smem_bytes(warps: int, stages: int, KS: int) -> int:
    """The kernel's dynamic shared memory (w4_gemm_smem): the warps' rings, 8 rows of x's K slice, its sums."""
    return warps * stages * 2 * 32 * 16 + warps * stages * 32 * 8 + 8 * (KS // 2 + 4) * 4 + (KS // GROUP) * 8 * 4


def shape_problem(N: int, K: int, group_size: int, warps: int, stages: int, splits: int, pairs: bool,
                  epilogue: str) -> str | None:
    """Why the CUDA kernel cannot take W [N, K] in groups of group_size with `warps` x `stages`, K over `splits`
    CTAs, `epilogue` on the (paired if `pairs`) layout, or None."""
    if epilogue not in EPILOGUES:
        return f"the CUDA kernel's epilogues are {sorted(EPILOGUES)}, got {epilogue!r}"
    if pairs != (epilogue == "geglu"):
        return ("the CUDA kernel's GeGLU reads the paired layout and its plain store the natural one (config "
                f"'cudaWxS[cC]g' for gate|up, 'cudaWxS[cC]' otherwise), got {'paired' if pairs else 'natural'} "
                f"words with {epilogue!r}")
    if group_size != GROUP:
        return f"the CUDA kernel takes groups of {GROUP}, got {group_size}"
    if warps < 1 or stages < 1:
        return f"the CUDA kernel needs warps and stages >= 1, got {warps} x {stages}"
    if not 1 <= splits <= MAX_CLUSTER:
        return f"the CUDA kernel splits K over 1..{MAX_CLUSTER} CTAs of a cluster, got {splits}"
    if N % 16 or K % (GROUP * splits):
        return (f"the CUDA kernel needs N % 16 == 0 and K in {splits} slices of whole groups of {GROUP}, got N={N}, "
                f"K={K}")
    KS = K // splits
    if smem_bytes(warps, stages, KS) > SMEM_LIMIT:
        return (f"the CUDA kernel's {warps} x {stages} ring and x's K slice take {smem_bytes(warps, stages, KS)} bytes "
                f"of shared memory, over the {SMEM_LIMIT} a CTA may have: fewer warps, stages, or more splits")
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("FASTGEMMA_CUDA_CACHE") or Path.home() / ".cache" / "fastgemma" / "cuda")


def variant(warps: int, stages: int, KS: int, splits: int, epi: int) -> str:
    """One library's macros, as its name says them."""
    return f"{warps}x{stages}_ks{KS}_c{splits}_e{epi}"


def build_command(compiler: str, warps: int, stages: int, KS: int, splits: int, epi: int, src: Path,
                  out: Path, trigger: tuple[int, int] | None = None) -> list[str]:
    """nvcc's command line for one (warps, stages, K slice, cluster, epilogue) library; `trigger` (one row, several:
    TRIGGER): the groups the plain kernel sums before its dependents may launch (None: the kernel's own points)."""
    trig = [] if trigger is None else [f"-DFG_TRIG1={trigger[0]}", f"-DFG_TRIGN={trigger[1]}"]
    return [compiler, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
            f"-DFG_NW={warps}", f"-DFG_S={stages}", f"-DFG_KS={KS}", f"-DFG_C={splits}", f"-DFG_EPI={epi}", *trig,
            str(src), "-o", str(out)]


@functools.lru_cache(maxsize=None)
def library(warps: int, stages: int, KS: int, splits: int, epi: int) -> ctypes.CDLL:
    """The built library for one variant: from the cache, else built once with nvcc (a few seconds)."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("the CUDA kernel (a 'cudaWxS[cC][g]' entry of the tensor-core kernel's table) is built with "
                           "nvcc, which is not on this machine (set CUDA_HOME, or use the Triton entry: the table's "
                           "default)")
    text = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    name = variant(warps, stages, KS, splits, epi)
    if TRIGGER is not None:
        name += f"_t{TRIGGER[0]}_{TRIGGER[1]}"
    key = hashlib.sha1(text + version.encode() + name.encode()).hexdigest()[:16]
    path = cache_dir() / f"w4_gemm_{name}_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        print(f"fastgemma: building the CUDA W4A16 kernel ({warps} warps x {stages} stages, K slice {KS} x {splits}, "
              f"epilogue {epi}) into {path}", file=sys.stderr, flush=True)
        r = subprocess.run(build_command(compiler, warps, stages, KS, splits, epi, SOURCE, tmp, TRIGGER),
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed to build the CUDA W4A16 kernel:\n{r.stderr[-3000:]}")
        os.replace(tmp, path)  # atomic: a concurrent process sees the whole library or none
    lib = ctypes.CDLL(str(path))
    lib.fg_w4_gemm.restype = ctypes.c_int
    lib.fg_w4_gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int]
    if splits == 1:  # the norm fold's consumer (w4_fold_kernel)
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.fg_w4_fold.restype = i
        lib.fg_w4_fold.argtypes = [p, p, p, p, p, i, p, p, p, p, i, p, f, f, i, p, i]
    lib.fg_error_string.restype = ctypes.c_char_p
    return lib


def variants_of(entries) -> set[tuple[int, int, int, int, int]]:
    """The libraries that CUDA configs need: entries ((N, K, config) each, configs with `cuda` set) -> {(warps,
    stages, K slice, splits, epilogue)}; the epilogue is GeGLU where the config reads the paired layout."""
    return {(c.warps, c.depth, K // c.splits, c.splits, int(c.pairs)) for _, K, c in entries}


def prebuild(variants) -> dict[tuple, str]:
    """Build (or find in the cache) every library of `variants` at once, nvcc in parallel (one thread a build).
    -> {variant: error} for the builds that failed (empty: all built)."""
    from concurrent.futures import ThreadPoolExecutor

    variants = sorted(set(variants))
    if not variants:
        return {}

    def one(v):
        try:
            library(*v)
            return None
        except RuntimeError as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=min(len(variants), os.cpu_count() or 1)) as pool:
        errors = list(pool.map(one, variants))
    return {v: e for v, e in zip(variants, errors) if e}


def device_problem(device: torch.device) -> str | None:
    """Why this device cannot run the CUDA kernel, or None (a CUDA device's answer found once a process)."""
    if device.type != "cuda":
        return f"the CUDA W4A16 kernel runs on a CUDA device, got {device}"
    return _cuda_device_problem(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_device_problem(index: int) -> str | None:
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"the CUDA W4A16 kernel is built for sm_90a (Hopper), got sm_{cap[0]}{cap[1]}"
    if nvcc() is None:
        return "the CUDA W4A16 kernel is built with nvcc, which is not on this machine (set CUDA_HOME)"
    return None


def cuda_gemm(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, warps: int, stages: int, splits: int,
              epilogue: str, pdl: bool) -> torch.Tensor:
    """x [M, K] bf16 (M <= 8, rows 16-byte aligned) through the int4 words -> [M, N] (geglu: [M, N/2]) bf16. The
    launch behind mma_w4a16 for a `cuda` config, which has checked the config against the shape (`shape_problem`)."""
    M, K = x.shape
    problem = device_problem(x.device)
    if problem:
        raise RuntimeError(problem)
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("the CUDA W4A16 kernel loads x in 16-byte pieces: rows contiguous, 16-byte aligned")
    epi = EPILOGUES[epilogue]
    out = torch.empty(M, N // 2 if epi else N, device=x.device, dtype=x.dtype)
    lib = library(warps, stages, K // splits, splits, epi)
    err = lib.fg_w4_gemm(x.data_ptr(), words.data_ptr(), sz.data_ptr(), out.data_ptr(), M, x.stride(0),
                         out.stride(0), N // 16, torch.cuda.current_stream(x.device).cuda_stream, int(pdl))
    if err:
        raise RuntimeError(f"the CUDA W4A16 kernel failed to launch: {lib.fg_error_string(err).decode()}")
    return out


SCALE_KINDS = {None: 0, torch.bfloat16: 1, torch.float32: 2}  # w4_fold_kernel's scale_kind


def fold_problem(N: int, K: int, warps: int, splits: int) -> str | None:
    """Why the CUDA kernel cannot be the norm fold's consumer for W [N, K] on `warps` warps and `splits` CTAs a tile
    (beyond `shape_problem`), or None: it takes all of K in a CTA, and its CTAs write h one thread an entry."""
    if splits > 1:
        return f"the CUDA kernel's fold takes all of K in a CTA; the config splits it over {splits} CTAs"
    ctas = -(-(N // 16) // warps)
    if ctas * warps * 32 < K:
        return (f"the CUDA fold writes h with one thread an entry: {ctas} CTAs of {warps} warps for {K} entries are "
                "too few")
    return None


def cuda_fold(rows: torch.Tensor, parts: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, warps: int,
              stages: int, epilogue: str, res: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
              scale: torch.Tensor | None, eps: float, offset: float, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm fold's consumer (kernels/norm_fold.py) on the CUDA kernel: from the producer's rows [2, K] and parts
    [P, 4], one row of epilogue(rmsnorm(h) (pre + off) W^T) and h [1, K]. The launch behind mma_fold for a `cuda`
    config, which has checked its inputs and the config against the shape (`consumer_problem`); what a direct call
    could still get wrong (the device, h's coverage, the partial rows a thread, the scalar's dtype) is refused here."""
    K = rows.shape[1]
    problem = device_problem(rows.device)
    if problem:
        raise RuntimeError(problem)
    kind = SCALE_KINDS.get(None if scale is None else scale.dtype)
    if kind is None:
        raise ValueError(f"the CUDA fold takes a bf16 or fp32 layer scalar, got {scale.dtype}")
    problem = fold_problem(N, K, warps, 1)
    if problem:
        raise ValueError(problem)
    if parts.shape[0] > 2 * warps * 32:
        raise ValueError(f"the CUDA fold reads at most two partial rows a thread: {parts.shape[0]} rows for "
                         f"{warps * 32} threads")
    epi = EPILOGUES[epilogue]
    out = torch.empty(1, N // 2 if epi else N, device=rows.device, dtype=rows.dtype)
    h = torch.empty(1, K, device=rows.device, dtype=rows.dtype)
    lib = library(warps, stages, K, 1, epi)
    err = lib.fg_w4_fold(rows.data_ptr(), words.data_ptr(), sz.data_ptr(), out.data_ptr(), parts.data_ptr(),
                         parts.shape[0], res.data_ptr(), y.data_ptr(), post.data_ptr(),
                         scale.data_ptr() if scale is not None else None, kind, h.data_ptr(), float(eps), float(offset),
                         N // 16, torch.cuda.current_stream(rows.device).cuda_stream, int(pdl))
    if err:
        raise RuntimeError(f"the CUDA fold failed to launch: {lib.fg_error_string(err).decode()}")
    return out, h
