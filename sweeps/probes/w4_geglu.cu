// Diagnostic variants of the CUDA gate|up (src/fastgemma/kernels/cuda/w4_gemm.cu, whose helpers this file is
// compiled after; w4_geglu_probe.py times both). The loop here is rolled (unroll 2), one warp a tile:
//   ring     x and its sums staged in shared memory once a CTA (the package kernel's layout)
//   xg       each lane loads its B operand from global (L1 / L2) a group ahead, sums of x by a ones-mma
//   dry      the words streamed through the ring and folded into the output, no arithmetic (the ring's floor)
//   nofill   ring without staging x (garbage x: timing only)
//   nomem    ring with no memory waits in the main loop (the first S groups reused: timing only)
//   split    ring with a group's two blocks in two accumulators
// x: [M, K] bf16 as u32 pairs (row stride stride_xm elements); words [tiles, K/64, 32] uint4; sz [tiles, K/128, 8]
// uint2 (rows g, g + 8: bf16 scale low, zero high); out [M, tiles * 8] bf16 (row stride stride_om).
// sum of x over one 16x64 block's four k steps: A = 1.0
__device__ __forceinline__ void ones_block(float* c, uint4 xa, uint4 xb) {
  asm volatile(
    "{\n.reg .b32 one;\nmov.b32 one, 0x3F803F80;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {one, one, one, one}, {%4, %5}, {%0, %1, %2, %3};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {one, one, one, one}, {%6, %7}, {%0, %1, %2, %3};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {one, one, one, one}, {%8, %9}, {%0, %1, %2, %3};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {one, one, one, one}, {%10, %11}, {%0, %1, %2, %3};\n"
    "}\n"
    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
    : "r"(xa.x), "r"(xa.y), "r"(xa.z), "r"(xa.w), "r"(xb.x), "r"(xb.y), "r"(xb.z), "r"(xb.w));
}

// XG: each lane loads its B operand from global (L1 / L2) a group ahead and sums x with a ones-mma, so no
// shared-memory copy of x and no barrier at all; DRY: the words streamed and folded into the output, no mma
// (the ring's own floor)
// DIAG (timing only, wrong outputs where noted): 1 no x staging (garbage x), 2 no memory waits in the main
// loop (the ring's first S groups reused), 3 the group's two blocks in two accumulators (right outputs)
template <int NW, int S, int K, bool XG, bool DRY, int DIAG = 0>
__global__ void __launch_bounds__(NW * 32, 1)
w4_geglu_diag_kernel(const u32* __restrict__ x, const uint4* __restrict__ words, const uint2* __restrict__ sz,
                u16* __restrict__ out, int M, int stride_xm, int stride_om, int n_tiles) {
  using W = WarpTile<NW, S, K>;  // (with XG or DRY the launch leaves x's shared memory out: xs, xsum unused)
  constexpr int NG = W::NG, XW = W::XW;
  extern __shared__ uint4 smem[];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const W w(smem, words, sz, n_tiles);
  w.start();
  const int lane = w.lane, g = w.g, tq = w.tq, t = w.t;
  const bool live = w.live;
  const uint4* wr = w.wr;
  const uint2* sr = w.sr;
  u32* xs = w.xs;
  float* xsum = w.xsum;
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (XG || DRY) {
    if (!live) return;
    const int xr = g < M ? g : M - 1;
    const uint4* xp = (const uint4*)(x + (u64)xr * (stride_xm / 2) + tq * 8);  // block b: xp[b * 8], xp[b * 8 + 1]
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    u32 fold = 0;
    uint4 xn[4];
    if (!DRY) {
#pragma unroll
      for (int i = 0; i < 4; ++i) xn[i] = __ldg(xp + (i >> 1) * 8 + (i & 1));
    }
#pragma unroll 2
    for (int gi = 0; gi < NG; ++gi) {
      cp_wait<S - 1>();
      const int s = gi % S;
      uint4 w0 = wr[s * 64 + lane], w1 = wr[s * 64 + 32 + lane];
      uint2 zv = sr[s * 32 + lane];
      if (DRY) {
        fold ^= w0.x ^ w0.y ^ w0.z ^ w0.w ^ w1.x ^ w1.y ^ w1.z ^ w1.w ^ zv.x ^ zv.y;
      } else {
        uint4 xc[4] = {xn[0], xn[1], xn[2], xn[3]};
        if (gi + 1 < NG) {
#pragma unroll
          for (int i = 0; i < 4; ++i) xn[i] = __ldg(xp + (2 * (gi + 1) + (i >> 1)) * 8 + (i & 1));
        }
        float p[4] = {0.f, 0.f, 0.f, 0.f}, q[4] = {0.f, 0.f, 0.f, 0.f};
        tile_block(p, w0, xc[0], xc[1]);
        ones_block(q, xc[0], xc[1]);
        tile_block(p, w1, xc[2], xc[3]);
        ones_block(q, xc[2], xc[3]);
        scale_group(acc, p, zv, make_float2(q[0], q[1]));
      }
      if (gi + S < NG) {
        w.issue(s, gi + S);
      }
      cp_commit();
    }
    const int row = t * 8 + g;
    if (DRY) {
      if (tq == 0) out[row] = (u16)fold;
      return;
    }
    store_unit<1>(out, acc[0], acc[2], t, g, tq * 2, M, stride_om);
    store_unit<1>(out, acc[1], acc[3], t, g, tq * 2 + 1, M, stride_om);
    return;
  }
  if constexpr (DIAG != 1) stage_x<NW, K>(x, xs, xsum, M, stride_xm, lane);
  __syncthreads();
  if (!live) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const u32* xrow = xs + g * XW + tq * 8;
  if constexpr (DIAG == 2) cp_wait<0>();
#pragma unroll 2
  for (int gi = 0; gi < NG; ++gi) {
    if constexpr (DIAG != 2) cp_wait<S - 1>();
    const int s = gi % S;
    uint4 w0 = wr[s * 64 + lane], w1 = wr[s * 64 + 32 + lane];
    uint2 zv = sr[s * 32 + lane];
    float p[4] = {0.f, 0.f, 0.f, 0.f};
    const u32* xb = xrow + gi * 64;
    if constexpr (DIAG == 3) {
      float q[4] = {0.f, 0.f, 0.f, 0.f};
      tile_block(p, w0, *(const uint4*)(xb), *(const uint4*)(xb + 4));
      tile_block(q, w1, *(const uint4*)(xb + 32), *(const uint4*)(xb + 36));
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] += q[i];
    } else {
      tile_block(p, w0, *(const uint4*)(xb), *(const uint4*)(xb + 4));
      tile_block(p, w1, *(const uint4*)(xb + 32), *(const uint4*)(xb + 36));
    }
    if (DIAG != 2 && gi + S < NG) w.issue(s, gi + S);
    cp_commit();
    scale_group(acc, p, zv, *(const float2*)(xsum + gi * 8 + tq * 2));
  }
  store_unit<1>(out, acc[0], acc[2], t, g, tq * 2, M, stride_om);
  store_unit<1>(out, acc[1], acc[3], t, g, tq * 2 + 1, M, stride_om);
}

template <int NW, int S, int K, bool XG>
__host__ __device__ constexpr int w4_geglu_diag_smem() {
  return NW * S * 2 * 32 * 16 + NW * S * 32 * 8 + (XG ? 0 : 8 * (K / 2 + 4) * 4 + (K / 128) * 8 * 4);
}


