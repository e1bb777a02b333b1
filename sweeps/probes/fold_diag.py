"""Diagnostic: the CUDA fold consumer with pieces cut out (edited copies of w4_gemm.cu), timed by bench_fold."""
import os
import tempfile
from pathlib import Path

from fastgemma.kernels import cuda_gemm
from fastgemma.kernels.mma_fold import FOLD_CASES, bench_fold
from fastgemma.kernels.mma_w4a16 import bench_mma, parse_config
from fastgemma.kernels.fused_w4a16 import E4B_CASES

SRC = cuda_gemm.SOURCE.read_text()
H_OLD = """  if (hk) {
    float hv = rnd(bf_lo(av) + rnd(bf_lo(yv) * r1 * (bf_lo(pw) + off)));
    if (scale_kind) hv = rnd(hv * s);
    h[k] = to_bf(hv);
  }"""
P_OLD = "    const float4 v = r < npart ? __ldcg((const float4*)parts + r) : make_float4(0.f, 0.f, 0.f, 0.f);"
P_NEW = "    const float4 v = make_float4(1.f, 1.f, 1.f, 1.f);"
X_NEW = """      v[r][j] = CPR % NT == 0 || c < CPR ? __ldcg((const uint4*)(x + (u64)(r < M ? r : M - 1) * (stride_xm / 2) + c * 4))
                                         : make_uint4(0, 0, 0, 0);"""
import re
X_OLD = SRC[SRC.index("      v[r][j] = r > 0 && r >= M"):SRC.index("make_uint4(0, 0, 0, 0);", SRC.index("      v[r][j] = r > 0 && r >= M")) + len("make_uint4(0, 0, 0, 0);")]
STAGE2 = "  stage_x<NW, K>(rows, w.xs, w.xsum, 2, K, w.lane);"
STAGE8 = "  stage_x<NW, K>(rows, w.xs, w.xsum, npart > 0 ? 2 : 1, K, w.lane);"
EPI_OLD = "  if (w.tq == 0) store_unit<EPI>(out, r2s * (acc[0] + r1 * acc[1]), r2s * (acc[2] + r1 * acc[3]), w.t, w.g, 0, 1, 0);"
EPI_NEW = "  if (w.tq == 0) store_unit<EPI>(out, acc[0] + acc[1], acc[2] + acc[3], w.t, w.g, 0, 1, 0);"
RED_OLD = SRC[SRC.index("#pragma unroll\n  for (int o = 16; o > 0; o >>= 1) {\n    pv.x"):SRC.index("  const float r1 = 1.f / sqrtf")]
RED_NEW = "  __syncthreads();\n  const float4 t = pv;\n"
BODY_OLD = SRC[SRC.index("  using W = WarpTile<NW, S, K, 1>;\n  constexpr int NT = NW * 32;"):SRC.index("template <int NW, int S, int KS>\n__host__ __device__ constexpr int w4_gemm_smem")]
BODY_NEW = """  using W = WarpTile<NW, S, K, 1>;
  extern __shared__ uint4 smem[];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const W w(smem, words, sz, n_tiles);
  w.start();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int M = npart > 0 ? 2 : 1;
  stage_x<NW, K>(rows, w.xs, w.xsum, M, K, w.lane);
  __syncthreads();
  if (!w.live) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (w.live) tile_sums(w, acc);
  store_unit<EPI>(out, acc[0], acc[2], w.t, w.g, w.tq * 2, 1, 0);
  store_unit<EPI>(out, acc[1], acc[3], w.t, w.g, w.tq * 2 + 1, 1, 0);
}

"""
BODY_RT = BODY_NEW.replace("store_unit<EPI>(out, acc[0], acc[2], w.t, w.g, w.tq * 2, 1, 0);\n  store_unit<EPI>(out, acc[1], acc[3], w.t, w.g, w.tq * 2 + 1, 1, 0);",
                           "store_unit<EPI>(out, acc[0], acc[2], w.t, w.g, w.tq * 2, m_out, stride_om);\n  store_unit<EPI>(out, acc[1], acc[3], w.t, w.g, w.tq * 2 + 1, m_out, stride_om);")
assert BODY_RT != BODY_NEW
variants = {
    "shipped (171 registers)": [],
    "the plain kernel's body, store constants (190)": [(BODY_OLD, BODY_NEW)],
    "the plain kernel's body, store arguments (154)": [(BODY_OLD, BODY_RT)],
}
d = Path(tempfile.mkdtemp())
for name, edits in variants.items():
    s = SRC
    for a, b in edits:
        assert a in s, (name, a[:40])
        s = s.replace(a, b)
    p = d / f"v{abs(hash(name))}.cu"
    p.write_text(s)
    cuda_gemm.SOURCE = p
    cuda_gemm.library.cache_clear()
    print(f"##### {name}", flush=True)
    bench_fold({"gate|up": FOLD_CASES["gate|up"]}, configs=[parse_config("cuda5x8g")], plain=True)
    lib = cuda_gemm.library(5, 8, 2560, 1, 1)
    os.system(f"cuobjdump -res-usage {lib._name} | grep -B1 REG | grep -v '^--'")
