"""Probe: chains of dependent phases inside one thread-block cluster (sweeps/probes/cluster_phases.cu) on the H200:
the cost of a phase when its boundary is a cluster barrier, with and without a phase's weights to stream, per
cluster size and phase shape. Each figure is the slope between chains of N1 and N2 phases (us a phase); each
chain's last vector is checked against the torch twin first (a short chain: tanh keeps it bounded, the sums'
order differs). The PDL launch figures to set beside it are bench.floor's (docs/results.md, runs GV-GZ, HU-HW:
1.1-1.4 us a phase for the boundary with 16-132 programs, 2.4-2.9 us at 2.2 MB).

    python sweeps/probes/cluster_phases.py [--clusters 8,16] [--shapes 256:0,256,256/1024,256/4096,256/2560]
                                           [--phases 128,256]

Run KA's answer (docs/results.md): no. The boundary costs 1.06-1.21 us, what a PDL launch costs, and 16 CTAs stream
at most ~0.27 TB/s (a 2.1 MB phase 7.66 us against 2.4-2.9 for a launch over the whole GPU).

A shape 'A/B/..' cycles the phases' dims (256/4096: 256 -> 4096 -> 256 -> ..., 2 MB a phase); 'D:0' is the boundary
alone at dim D (no weights, no arithmetic). GPU only; builds with torch.utils.cpp_extension (nvcc, sm_90a).
"""
import argparse
import hashlib
import os
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

THREADS = 512
LAUNCH = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

template <bool WORK>
static void launch(const torch::Tensor& x, const torch::Tensor& wptr, const torch::Tensor& dims, torch::Tensor& out,
                   int64_t n, int64_t C, int64_t wmax, int64_t vmax, int64_t smax) {
  auto kernel = cluster_chain<512, WORK>;
  const int smem = (int)(wmax * 16 + (vmax + 2 * smax) * 4);
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess,
              "shared memory ", smem);
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)C);
  cfg.blockDim = dim3(512);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeClusterDimension;
  a[0].val.clusterDim.x = (unsigned)C;
  a[0].val.clusterDim.y = 1;
  a[0].val.clusterDim.z = 1;
  cfg.attrs = a;
  cfg.numAttrs = 1;
  cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, (const float*)x.data_ptr(), (const u64*)wptr.data_ptr(),
                                     (const int*)dims.data_ptr(), (float*)out.data_ptr(), (int)n, (int)wmax,
                                     (int)vmax, (int)smax);
  TORCH_CHECK(e == cudaSuccess, "launch failed: ", cudaGetErrorString(e));
}

void chain(torch::Tensor x, torch::Tensor wptr, torch::Tensor dims, torch::Tensor out, int64_t n, int64_t C,
           int64_t wmax, int64_t vmax, int64_t smax, bool work) {
  if (work) launch<true>(x, wptr, dims, out, n, C, wmax, vmax, smax);
  else launch<false>(x, wptr, dims, out, n, C, wmax, vmax, smax);
}
"""


def build():
    src = Path(__file__).with_name("cluster_phases.cu").read_text() + LAUNCH
    name = "cluster_phases_" + hashlib.sha1(src.encode()).hexdigest()[:12]
    t0 = time.time()
    mod = load_inline(name, cpp_sources="void chain(torch::Tensor x, torch::Tensor wptr, torch::Tensor dims, "
                      "torch::Tensor out, int64_t n, int64_t C, int64_t wmax, int64_t vmax, int64_t smax, bool work);",
                      cuda_sources=src, functions=["chain"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"],
                      build_directory=os.environ.get("PROBE_BUILD") or None)
    print(f"built in {time.time() - t0:.1f} s", flush=True)
    return mod


def parse_shape(text: str) -> tuple[list[int], bool]:
    """'A/B/..' (the dims a chain cycles, with weights) or 'D:0' (the boundary alone at dim D)."""
    if text.endswith(":0"):
        return [int(text[:-2])], False
    return [int(d) for d in text.split("/")], True


def chain_dims(cycle: list[int], n: int) -> list[int]:
    return [cycle[i % len(cycle)] for i in range(n + 1)]


def problem(cycle: list[int], C: int, work: bool = True) -> str | None:
    """Why a cycle of dims cannot run on a cluster of C CTAs, or None (work False: no weights to hold)."""
    if any(d % C or d % 8 for d in cycle):
        return f"every dim must split into {C} whole shares and rows of whole 16-byte words"
    wmax = max(cycle[i] * cycle[(i + 1) % len(cycle)] for i in range(len(cycle))) // C * 2 if work else 16
    if wmax + max(cycle) * 4 + 2 * max(cycle) // C * 4 > 227 * 1024:
        return f"a CTA's weight slice ({wmax} bytes) and vectors exceed 227 KB of shared memory: a larger cluster"
    return None


def twin(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    v = x.double()
    for w in weights:
        v = torch.tanh(w.double() @ v / w.shape[1] ** 0.5)
    return v.float()


def prepare(x, weights, dims, C, work):
    """The chain's launch arguments (device tensors made here, outside any graph capture)."""
    n = len(dims) - 1
    wptr = torch.tensor([w.data_ptr() for w in weights] or [0], dtype=torch.int64, device=x.device)
    dt = torch.tensor(dims, dtype=torch.int32, device=x.device)
    out = torch.empty(dims[-1], device=x.device, dtype=torch.float32)
    wmax = max((dims[i] * dims[i + 1] // C // 8 for i in range(n)), default=1) if work else 1
    return (x, wptr, dt, out, n, C, wmax, max(dims), max(dims) // C, work)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clusters", default="8,16")
    ap.add_argument("--shapes", default="256:0,256,256/1024,256/4096,2560/256")
    ap.add_argument("--phases", default="128,256", help="N1,N2: the slope's two chain lengths")
    ap.add_argument("--check", type=int, default=6, help="phases of the checked chain")
    a = ap.parse_args()
    n1, n2 = (int(v) for v in a.phases.split(","))
    mod = build()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(dev)}: one cluster, {THREADS} threads a CTA; us a phase (slope {n1} -> {n2})")
    for C in [int(c) for c in a.clusters.split(",")]:
        for shape in a.shapes.split(","):
            cycle, work = parse_shape(shape)
            why = problem(cycle, C, work)
            if why:
                print(f"C={C:>2} | {shape:<12} | skipped: {why}")
                continue
            dims = chain_dims(cycle, n2)
            weights = [torch.randn(dims[i + 1], dims[i], device=dev, generator=gen).to(torch.bfloat16)
                       for i in range(n2)] if work else []
            x = torch.randn(dims[0], device=dev, generator=gen)
            k = min(a.check, n2)
            args = prepare(x, weights[:k], dims[:k + 1], C, work)
            mod.chain(*args)
            got = args[3]
            want = twin(x, weights[:k]) if work else x.repeat(dims[k] // dims[0] + 1)[:dims[k]]
            err = (got - want).abs().max().item()
            ok = err < 1e-3
            times = {}
            for n in (n1, n2):
                args = prepare(x, weights[:n], dims[:n + 1], C, work)
                g = torch.cuda.CUDAGraph()
                mod.chain(*args)
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    for _ in range(10):
                        mod.chain(*args)
                g.replay()
                torch.cuda.synchronize()
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(5):
                    g.replay()
                t1.record()
                torch.cuda.synchronize()
                times[n] = t0.elapsed_time(t1) * 1e3 / 50  # us a chain
            us = (times[n2] - times[n1]) / (n2 - n1)
            mb = sum(dims[i] * dims[i + 1] * 2 for i in range(len(cycle))) / len(cycle) / 1e6 if work else 0.0
            rows.append((C, shape, mb, us, err, ok))
            print(f"C={C:>2} | {shape:<12} | {mb:5.2f} MB a phase | {us:6.2f} us a phase | "
                  f"{mb * 1e3 / us if us > 0 and mb else 0:6.0f} GB/s | check {'ok' if ok else 'WRONG'} {err:.1e}",
                  flush=True)
    print("\n| cluster | dims | MB a phase | us a phase | GB/s | twin |\n|---|---|---|---|---|---|")
    for C, shape, mb, us, err, ok in rows:
        print(f"| {C} | {shape} | {mb:.2f} | {us:.2f} | {mb * 1e3 / us if us > 0 and mb else 0:.0f} | "
              f"{'ok' if ok else 'WRONG'} {err:.1e} |")


if __name__ == "__main__":
    main()
