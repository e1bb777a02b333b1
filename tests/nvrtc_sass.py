"""CUDA C++ -> sm_90a SASS on a machine without a GPU or nvcc: NVRTC (the nvidia-cuda-nvrtc-cu12 wheel) compiles
a kernel template's instance straight to a cubin, and the cuobjdump that ships in Triton's wheel prints its SASS
(tests/sm90_compile.py does the same for the Triton kernels)."""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import subprocess
import tempfile

import triton

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    dist = importlib.metadata.distribution("nvidia-cuda-nvrtc-cu12")
    lib = ctypes.CDLL(str(dist.locate_file("nvidia/cuda_nvrtc/lib/libnvrtc.so.12")))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(lib, rc: int, what: str, log: str = "") -> None:
    if rc:
        raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(rc).decode()}\n{log[-4000:]}")


def sass(source: str, name: str, options: tuple[str, ...] = ()) -> str:
    """The sm_90a SASS of `name` (a kernel, e.g. 'w4_gemm_kernel<5, 8, 2560, 1, 1>', instantiated from `source`)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), "name expression")
        opts = [b"--gpu-architecture=sm_90a", b"-std=c++17", *(o.encode() for o in options)]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        _check(lib, rc, f"compile of {name}", log.value.decode(errors="replace"))
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin.raw)
        r = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True, check=True)
    return r.stdout


def instructions(text: str) -> list[str]:
    """SASS text -> its instructions in order, predicates kept, addresses and encodings dropped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("/*") and "*/" in line and line.endswith("*/") and ";" in line:
            out.append(line.split("*/", 1)[1].split(";", 1)[0].strip())
    return out
