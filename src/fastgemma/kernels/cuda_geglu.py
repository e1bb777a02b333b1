"""gate|up + GeGLU in CUDA C++ (kernels/cuda/w4_geglu.cu) on mma_w4a16's paired int4 words: the launch
behind `MmaConfig.cuda` (config text 'cudaWxS': W warps a CTA, one 16-row tile each over all of K, S ring
stages of a group each).

The Triton kernel holds a program's words in registers and sums them after they land, ~2.4 waves of load
then multiply; here each warp streams its tile through a cp.async ring in shared memory, so the arithmetic
of one group runs while the next ones are in flight (sweeps/probes, runs JC-JH: 9.1-9.4 us against 11.6-12.5
alone at 1 and 8 rows, E4B's gate|up).

The library is built on first use with nvcc (the CUDA toolkit; sm_90a) into a cache directory
($FASTGEMMA_CUDA_CACHE, default ~/.cache/fastgemma/cuda), one per (warps, stages, K), and called through
ctypes on the current stream, so CUDA graph capture records it. Numerics: the twin's (mma_w4a16_ref) within
bf16; not bit-equal to the Triton kernel (sums of x in another order), and a row's result does not depend on
the rows beside it (fuse.batch_invariant holds with the same config at every row count)."""
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

SOURCE = Path(__file__).with_name("cuda") / "w4_geglu.cu"
SMEM_LIMIT = 227 * 1024  # dynamic shared memory a CTA may take on sm_90
GROUP = 128


def nvcc() -> str | None:
    """nvcc from $CUDA_HOME (or $CUDA_PATH), else the PATH; None when there is none."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def smem_bytes(warps: int, stages: int, K: int) -> int:
    """The kernel's dynamic shared memory (w4_geglu_smem): the warps' rings, 8 rows of x, its sums."""
    return warps * stages * 2 * 32 * 16 + warps * stages * 32 * 8 + 8 * (K // 2 + 4) * 4 + (K // GROUP) * 8 * 4


def shape_problem(N: int, K: int, group_size: int, warps: int, stages: int, pairs: bool) -> str | None:
    """Why the CUDA gate|up cannot take W [N, K] in groups of group_size with `warps` x `stages`, or None."""
    if not pairs:
        return "the CUDA gate|up reads the paired GeGLU layout (config 'cudaWxS' sets it)"
    if group_size != GROUP:
        return f"the CUDA gate|up takes groups of {GROUP}, got {group_size}"
    if warps < 1 or stages < 1:
        return f"the CUDA gate|up needs warps and stages >= 1, got {warps} x {stages}"
    if N % 16 or K % GROUP or (K // 8) % (warps * 32) or (warps * 32) % 16:
        return (f"the CUDA gate|up needs N % 16 == 0, K % {GROUP} == 0 and K / 8 a multiple of 32 x warps "
                f"(x staged in whole columns a thread), got N={N}, K={K}, {warps} warps")
    if smem_bytes(warps, stages, K) > SMEM_LIMIT:
        return (f"the CUDA gate|up's {warps} x {stages} ring and x take {smem_bytes(warps, stages, K)} bytes of shared "
                f"memory, over the {SMEM_LIMIT} a CTA may have: fewer warps or stages")
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("FASTGEMMA_CUDA_CACHE") or Path.home() / ".cache" / "fastgemma" / "cuda")


def build_command(compiler: str, warps: int, stages: int, K: int, src: Path, out: Path) -> list[str]:
    """nvcc's command line for one (warps, stages, K) library."""
    return [compiler, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
            f"-DFG_NW={warps}", f"-DFG_S={stages}", f"-DFG_K={K}", str(src), "-o", str(out)]


@functools.lru_cache(maxsize=None)
def library(warps: int, stages: int, K: int) -> ctypes.CDLL:
    """The built library for (warps, stages, K): from the cache, else built once with nvcc (a few seconds)."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("the CUDA gate|up (an 'cudaWxS' entry of the tensor-core kernel's table) is built with "
                           "nvcc, which is not on this machine (set CUDA_HOME, or use the Triton entry: the table's "
                           "default)")
    text = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha1(text + version.encode() + f"{warps},{stages},{K}".encode()).hexdigest()[:16]
    path = cache_dir() / f"w4_geglu_{warps}x{stages}_k{K}_{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        print(f"fastgemma: building the CUDA gate|up ({warps} warps x {stages} stages, K {K}) into {path}",
              file=sys.stderr, flush=True)
        r = subprocess.run(build_command(compiler, warps, stages, K, SOURCE, tmp), capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"nvcc failed to build the CUDA gate|up:\n{r.stderr[-3000:]}")
        os.replace(tmp, path)  # atomic: a concurrent process sees the whole library or none
    lib = ctypes.CDLL(str(path))
    lib.fg_w4_geglu.restype = ctypes.c_int
    lib.fg_w4_geglu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int]
    lib.fg_error_string.restype = ctypes.c_char_p
    return lib


def device_problem(device: torch.device) -> str | None:
    """Why this device cannot run the CUDA gate|up, or None (a CUDA device's answer found once a process)."""
    if device.type != "cuda":
        return f"the CUDA gate|up runs on a CUDA device, got {device}"
    return _cuda_device_problem(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_device_problem(index: int) -> str | None:
    cap = torch.cuda.get_device_capability(index)
    if cap != (9, 0):
        return f"the CUDA gate|up is built for sm_90a (Hopper), got sm_{cap[0]}{cap[1]}"
    if nvcc() is None:
        return "the CUDA gate|up is built with nvcc, which is not on this machine (set CUDA_HOME)"
    return None


def cuda_geglu(x: torch.Tensor, words: torch.Tensor, sz: torch.Tensor, N: int, warps: int, stages: int,
               pdl: bool) -> torch.Tensor:
    """x [M, K] bf16 (M <= 8, rows 16-byte aligned) through the paired gate|up words -> [M, N/2] bf16. The launch
    behind mma_w4a16 for a `cuda` config, which has checked the config against the shape (`shape_problem`)."""
    M, K = x.shape
    problem = device_problem(x.device)
    if problem:
        raise RuntimeError(problem)
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        raise ValueError("the CUDA gate|up loads x in 16-byte pieces: rows contiguous, 16-byte aligned")
    out = torch.empty(M, N // 2, device=x.device, dtype=x.dtype)
    lib = library(warps, stages, K)
    err = lib.fg_w4_geglu(x.data_ptr(), words.data_ptr(), sz.data_ptr(), out.data_ptr(), M, x.stride(0),
                          out.stride(0), N // 16, torch.cuda.current_stream(x.device).cuda_stream, int(pdl))
    if err:
        raise RuntimeError(f"the CUDA gate|up failed to launch: {lib.fg_error_string(err).decode()}")
    return out
