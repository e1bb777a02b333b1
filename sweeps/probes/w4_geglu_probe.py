"""Probe: gate|up (E4B, int4 g128, paired GeGLU layout) in CUDA C++ against the shipped Triton entry, alone,
weights rotated out of L2, PDL launches in CUDA graphs (kernels/bench_util's timer), every output checked
against the twin (the timing-only modes excepted). The kernels: the engine's (src/fastgemma/kernels/cuda/
w4_gemm.cu, mode 'unrolled') and the diagnostic variants of sweeps/probes/w4_geglu.cu. GPU only: builds the
requested variants with torch.utils.cpp_extension (nvcc, sm_90a; ~50 s).

    python sweeps/probes/w4_geglu_probe.py [--variants 5x8:unrolled,5x8:ring,5x8:dry] [--ms 1,8]
"""
import argparse
import hashlib
import os
import re
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from fastgemma.kernels.bench_util import copies_past_l2, max_rel_err, rotating, timer_or_graphs
from fastgemma.kernels.int4_pack import pack_int4, quantize_int4
from fastgemma.kernels.mma_table import parse_config
from fastgemma.kernels.mma_w4a16 import MmaWeight, mma_w4a16, mma_w4a16_ref
from fastgemma.kernels.read_floor import read_floor

# (warps a CTA, ring stages a warp, mode): smem (x and its sums staged in shared memory), xg (x from global
# a group ahead, sums by a ones-mma), dry (the ring alone: words streamed, no mma)
# ks1 / ks2: w4_geglu_ks_kernel (the group loop unrolled; ks2: two warps a tile, each half of K)
# WxS:MODE: W warps a CTA (one tile each), S ring stages a warp. unrolled: the package's kernel
# (kernels/cuda/w4_gemm.cu, as the engine launches it); the rest the rolled diagnostic kernel's modes
# (sweeps/probes/w4_geglu.cu: ring, xg, dry, nofill, nomem, split)
DEFAULT = "5x8:unrolled,5x8:ring,5x8:dry"
DIAG = {"ring": (0, 0, 0), "xg": (1, 0, 0), "dry": (0, 1, 0), "nofill": (0, 0, 1), "nomem": (0, 0, 2), "split": (0, 0, 3)}

LAUNCH = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

template <typename F>
static void launch(F kernel, int smem, int nw, const torch::Tensor& x, const torch::Tensor& words,
                   const torch::Tensor& sz, torch::Tensor& out, bool pdl) {
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess);
  int n_tiles = words.size(0);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((n_tiles + nw - 1) / nw);
  cfg.blockDim = dim3(nw * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  cfg.attrs = a;
  cfg.numAttrs = 1;
  int M = x.size(0), sxm = x.stride(0), som = out.stride(0);
  TORCH_CHECK(cudaLaunchKernelEx(&cfg, kernel, (const u32*)x.data_ptr(), (const uint4*)words.data_ptr(),
                                 (const uint2*)sz.data_ptr(), (u16*)out.data_ptr(), M, sxm, som, n_tiles)
              == cudaSuccess, "launch failed");
}
"""


def dispatch(variants: list[tuple[int, int, str]], K: int) -> str:
    """The launcher: variant i of `variants` as case i."""
    lines = ["void w4_geglu(torch::Tensor x, torch::Tensor words, torch::Tensor sz, torch::Tensor out, int64_t i, "
             "bool pdl) {", "  switch (i) {"]
    for i, (nw, s, mode) in enumerate(variants):
        if mode == "unrolled":
            k, smem = f"w4_gemm_kernel<{nw}, {s}, {K}, 1, 1>", f"w4_gemm_smem<{nw}, {s}, {K}>()"
        else:
            xg, dry, diag = DIAG[mode]
            b = lambda v: "true" if v else "false"  # noqa: E731
            k = f"w4_geglu_diag_kernel<{nw}, {s}, {K}, {b(xg)}, {b(dry)}, {diag}>"
            smem = f"w4_geglu_diag_smem<{nw}, {s}, {K}, {b(xg or dry)}>()"
        lines.append(f"    case {i}: launch({k}, {smem}, {nw}, x, words, sz, out, pdl); break;")
    lines += ['    default: TORCH_CHECK(false, "no such variant");', "  }", "}"]
    return "\n".join(lines)


def build(variants: list[tuple[int, int, str]], K: int):
    root = Path(__file__).resolve().parents[2]
    src = "".join([(root / "src/fastgemma/kernels/cuda/w4_gemm.cu").read_text(),
                   Path(__file__).with_name("w4_geglu.cu").read_text(), LAUNCH, dispatch(variants, K)])
    name = "w4_geglu_probe_" + hashlib.sha1(src.encode()).hexdigest()[:12]
    t0 = time.time()
    mod = load_inline(name, cpp_sources="void w4_geglu(torch::Tensor x, torch::Tensor words, torch::Tensor sz, "
                      "torch::Tensor out, int64_t i, bool pdl);", cuda_sources=src, functions=["w4_geglu"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"],
                      build_directory=os.environ.get("PROBE_BUILD") or None)
    print(f"built in {time.time() - t0:.1f} s")
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=DEFAULT, help="WxS:MODE joined by ',' (module docstring)")
    ap.add_argument("--ms", default="1,8")
    a = ap.parse_args()
    variants = []
    for v in a.variants.split(","):
        m = re.fullmatch(r"(\d+)x(\d+):(\w+)", v.strip())
        if not m or (m[3] != "unrolled" and m[3] not in DIAG):
            raise SystemExit(f"--variants {v!r}: WxS:MODE, MODE one of unrolled, {', '.join(DIAG)}")
        variants.append((int(m[1]), int(m[2]), m[3]))
    mod = build(variants, 2560)
    dev = torch.device("cuda")
    timer = timer_or_graphs(None, "w4_geglu_probe")
    gen = torch.Generator(device=dev).manual_seed(0)
    N, K, G = 20480, 2560, 128
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    q, sc, zr = quantize_int4(w, G)
    qw = pack_int4(q)
    mw = MmaWeight.from_codes(q, sc, zr, G, pairs=True)
    nbytes = mw.words.numel() * 4 + mw.sz.numel() * 4
    copies = [MmaWeight(mw.words.clone(), mw.sz.clone(), N, K, G, True) for _ in range(copies_past_l2(nbytes, dev))]
    cfg = parse_config("2x4d5p9fg")
    print(f"{torch.cuda.get_device_name(dev)}: gate|up {N}x{K} int4 g{G} paired, {nbytes / 1e6:.1f} MB, "
          f"{len(copies)} copies; us alone, PDL")
    rows = []
    for M in [int(m) for m in a.ms.split(",")]:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=gen)
        ref = mma_w4a16_ref(x, qw, sc, zr, G, "geglu")
        tri = mma_w4a16(x, mw, "geglu", cfg, True)
        runs = [("triton 2x4d5p9fg (shipped)", lambda m_: mma_w4a16(x, m_, "geglu", cfg, True))]
        for i, (nw, s, mode) in enumerate(variants):
            def cu(m_, i=i):
                out = torch.empty(M, N // 2, device=dev, dtype=torch.bfloat16)
                mod.w4_geglu(x, m_.words, m_.sz, out, i, True)
                return out
            runs.append((f"cuda {nw} warps, ring {s} groups, {mode}", cu))
        runs.append(("read floor (words, 8 KB a program)", lambda m_: read_floor(m_.words, 8192, 8, True)))
        for label, call in runs:
            got = call(copies[0])
            torch.cuda.synchronize()
            us = timer(rotating([(c,) for c in copies], call))
            checked = not any(w in label for w in ("floor", "dry", "nofill", "nomem"))
            err = max_rel_err(got, ref) if checked else float("nan")
            same = bool(torch.equal(got, tri)) if checked else None
            rows.append((M, label, us, err, same))
            print(f"M={M} | {label:<36} | {us:7.2f} us | {nbytes / us / 1e3:6.0f} GB/s | err {err:.1e} | "
                  f"equal to triton: {same}", flush=True)
    print("\n| rows | kernel | us | GB/s | max rel err vs twin | bit-equal to the Triton entry |\n|---|---|---|---|---|---|")
    for M, label, us, err, same in rows:
        print(f"| {M} | {label} | {us:.2f} | {nbytes / us / 1e3:.0f} | {err:.1e} | {same} |")


if __name__ == "__main__":
    main()
