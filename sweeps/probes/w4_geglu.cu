// int4 codes in the tensor-core fragment order (kernels/mma_w4a16.pack_mma, paired GeGLU layout) against up to
// 8 bf16 rows, GeGLU in the store. One warp a 16-row tile over all of K: no reduction across warps, no barrier
// in the main loop. Each warp streams its tile's words and scale / zero words group by group through its own
// ring of S shared-memory stages (cp.async, 16 + 16 + 8 bytes a lane a group); each lane reads back only what it
// copied, so no barrier is needed there either. x (all rows, padded to 8 with the last row) and its per-group
// sums are staged once per CTA.
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" :: "r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// four k steps of one 16x64 block: words w (one per step), B registers xa (steps 0, 1) / xb (steps 2, 3)
__device__ __forceinline__ void tile_block(float* c, uint4 w, uint4 xa, uint4 xb) {
  asm volatile(
    "{\n.reg .b32 a0, a1, a2, a3, t;\n"
    "lop3.b32 a0, %4, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %4, 4;\nlop3.b32 a1, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %4, 8;\nlop3.b32 a2, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %4, 12;\nlop3.b32 a3, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {a0, a1, a2, a3}, {%8, %9}, {%0, %1, %2, %3};\n"
    "lop3.b32 a0, %5, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %5, 4;\nlop3.b32 a1, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %5, 8;\nlop3.b32 a2, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %5, 12;\nlop3.b32 a3, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {a0, a1, a2, a3}, {%10, %11}, {%0, %1, %2, %3};\n"
    "lop3.b32 a0, %6, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %6, 4;\nlop3.b32 a1, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %6, 8;\nlop3.b32 a2, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %6, 12;\nlop3.b32 a3, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {a0, a1, a2, a3}, {%12, %13}, {%0, %1, %2, %3};\n"
    "lop3.b32 a0, %7, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %7, 4;\nlop3.b32 a1, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %7, 8;\nlop3.b32 a2, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "shr.b32 t, %7, 12;\nlop3.b32 a3, t, 0x000F000F, 0x43004300, 0xEA;\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {a0, a1, a2, a3}, {%14, %15}, {%0, %1, %2, %3};\n"
    "}\n"
    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
    : "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w), "r"(xa.x), "r"(xa.y), "r"(xa.z), "r"(xa.w),
      "r"(xb.x), "r"(xb.y), "r"(xb.z), "r"(xb.w));
}

__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ u16 to_bf(float f) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
__device__ __forceinline__ float rnd(float f) { return __uint_as_float(((u32)to_bf(f)) << 16); }
__device__ __forceinline__ float gelu_tanh(float x) {
  float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + __expf(fminf(-2.0f * z, 80.0f)));
}

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
w4_geglu_kernel(const u32* __restrict__ x, const uint4* __restrict__ words, const uint2* __restrict__ sz,
                u16* __restrict__ out, int M, int stride_xm, int stride_om, int n_tiles) {
  constexpr int KB = K / 64, NG = K / 128;
  constexpr int XW = K / 2 + 4;  // a row of x in u32, padded by 16 bytes (rows on different banks)
  extern __shared__ uint4 smem[];
  uint4* wring = smem;                                   // [NW][S][2][32]
  uint2* szring = (uint2*)(wring + NW * S * 2 * 32);     // [NW][S][32]
  u32* xs = (u32*)(szring + NW * S * 32);                // [8][XW]
  float* xsum = (float*)(xs + 8 * XW);                   // [NG][8]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  int t = blockIdx.x * NW + warp;
  const bool live = t < n_tiles;
  uint4* wr = wring + warp * S * 64;
  uint2* sr = szring + warp * S * 32;
  const uint4* wt = words + (u64)t * KB * 32 + lane;
  const uint2* st = sz + (u64)t * NG * 8 + g;
  // the first S groups' words before the wait: weights, which no kernel before writes
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (live && s < NG) {
      cp16(wr + s * 64 + lane, wt + (2 * s) * 32);
      cp16(wr + s * 64 + 32 + lane, wt + (2 * s + 1) * 32);
      cp8(sr + s * 32 + lane, st + s * 8);
    }
    cp_commit();
  }
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
        float s0 = bf_lo(zv.x), z0 = bf_hi(zv.x), s1 = bf_lo(zv.y), z1 = bf_hi(zv.y);
        acc[0] += s0 * p[0] + (z0 - 128.f * s0) * q[0];
        acc[1] += s0 * p[1] + (z0 - 128.f * s0) * q[1];
        acc[2] += s1 * p[2] + (z1 - 128.f * s1) * q[2];
        acc[3] += s1 * p[3] + (z1 - 128.f * s1) * q[3];
      }
      if (gi + S < NG) {
        cp16(wr + s * 64 + lane, wt + (2 * (gi + S)) * 32);
        cp16(wr + s * 64 + 32 + lane, wt + (2 * (gi + S) + 1) * 32);
        cp8(sr + s * 32 + lane, st + (gi + S) * 8);
      }
      cp_commit();
    }
    const int row = t * 8 + g;
    if (DRY) {
      if (tq == 0) out[row] = (u16)fold;
      return;
    }
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      int m = tq * 2 + c2;
      if (m < M) out[(u64)m * stride_om + row] = to_bf(rnd(gelu_tanh(rnd(acc[c2]))) * rnd(acc[2 + c2]));
    }
    return;
  }
  // x into shared memory (rows 0..7, a row past M a copy of row M - 1), every load of a thread issued before
  // its first store; its sums per group of 128 and row from the same registers (16 threads a group, shuffles)
  if constexpr (DIAG != 1) {
    constexpr int NT = NW * 32, CPR = K / 8, J = CPR / NT;  // uint4 a row; a thread's columns per row
    static_assert(CPR % NT == 0 && NT % 16 == 0, "a row of x in whole 16-thread groups");
    uint4 v[8][J];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int rs = r < M ? r : M - 1;
#pragma unroll
      for (int j = 0; j < J; ++j) v[r][j] = *(const uint4*)(x + (u64)rs * (stride_xm / 2) + (threadIdx.x + j * NT) * 4);
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = threadIdx.x + j * NT;
        *(uint4*)(xs + r * XW + c * 4) = v[r][j];
        float a = ((bf_lo(v[r][j].x) + bf_hi(v[r][j].x)) + (bf_lo(v[r][j].y) + bf_hi(v[r][j].y)))
                + ((bf_lo(v[r][j].z) + bf_hi(v[r][j].z)) + (bf_lo(v[r][j].w) + bf_hi(v[r][j].w)));
        a += __shfl_xor_sync(0xffffffffu, a, 8);
        a += __shfl_xor_sync(0xffffffffu, a, 4);
        a += __shfl_xor_sync(0xffffffffu, a, 2);
        a += __shfl_xor_sync(0xffffffffu, a, 1);
        if ((lane & 15) == 0) xsum[(c >> 4) * 8 + r] = a;
      }
    }
  }
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
    if (DIAG != 2 && gi + S < NG) {
      cp16(wr + s * 64 + lane, wt + (2 * (gi + S)) * 32);
      cp16(wr + s * 64 + 32 + lane, wt + (2 * (gi + S) + 1) * 32);
      cp8(sr + s * 32 + lane, st + (gi + S) * 8);
    }
    cp_commit();
    float2 xsv = *(const float2*)(xsum + gi * 8 + tq * 2);
    float s0 = bf_lo(zv.x), z0 = bf_hi(zv.x), s1 = bf_lo(zv.y), z1 = bf_hi(zv.y);
    acc[0] += s0 * p[0] + (z0 - 128.f * s0) * xsv.x;
    acc[1] += s0 * p[1] + (z0 - 128.f * s0) * xsv.y;
    acc[2] += s1 * p[2] + (z1 - 128.f * s1) * xsv.x;
    acc[3] += s1 * p[3] + (z1 - 128.f * s1) * xsv.y;
  }
  const int row = t * 8 + g;
#pragma unroll
  for (int c2 = 0; c2 < 2; ++c2) {
    int m = tq * 2 + c2;
    if (m < M) out[(u64)m * stride_om + row] = to_bf(rnd(gelu_tanh(rnd(acc[c2]))) * rnd(acc[2 + c2]));
  }
}

template <int NW, int S, int K, bool XG>
__host__ __device__ constexpr int w4_geglu_smem() {
  return NW * S * 2 * 32 * 16 + NW * S * 32 * 8 + (XG ? 0 : 8 * (K / 2 + 4) * 4 + (K / 128) * 8 * 4);
}


// KS warps a tile, each a 1/KS of K (its groups g0 .. g0 + NG/KS - 1), their sums added through shared memory at
// the end (one barrier): up to KS x more warps a multiprocessor at E4B's 1,280 tiles. x and its sums staged as
// above; the group loop fully unrolled (stage indices and offsets constant).
template <int NW, int S, int K, int KS>
__global__ void __launch_bounds__(NW * 32, 1)
w4_geglu_ks_kernel(const u32* __restrict__ x, const uint4* __restrict__ words, const uint2* __restrict__ sz,
                   u16* __restrict__ out, int M, int stride_xm, int stride_om, int n_tiles) {
  constexpr int KB = K / 64, NG = K / 128, NGW = NG / KS, TW = NW / KS;  // TW: tiles a CTA
  static_assert(NG % KS == 0 && NW % KS == 0, "whole groups and tiles");
  constexpr int XW = K / 2 + 4;
  extern __shared__ uint4 smem[];
  uint4* wring = smem;                                   // [NW][S][2][32]
  uint2* szring = (uint2*)(wring + NW * S * 2 * 32);     // [NW][S][32]
  u32* xs = (u32*)(szring + NW * S * 32);                // [8][XW]
  float* xsum = (float*)(xs + 8 * XW);                   // [NG][8]
  float4* red = (float4*)(xsum + NG * 8);                // [KS - 1][TW][32]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int half = warp / TW, g0 = half * NGW;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int t = blockIdx.x * TW + warp % TW;
  const bool live = t < n_tiles;
  uint4* wr = wring + warp * S * 64;
  uint2* sr = szring + warp * S * 32;
  const uint4* wt = words + (u64)t * KB * 32 + lane + g0 * 64;
  const uint2* st = sz + (u64)t * NG * 8 + g + g0 * 8;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (live && s < NGW) {
      cp16(wr + s * 64 + lane, wt + (2 * s) * 32);
      cp16(wr + s * 64 + 32 + lane, wt + (2 * s + 1) * 32);
      cp8(sr + s * 32 + lane, st + s * 8);
    }
    cp_commit();
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  {
    constexpr int NT = NW * 32, CPR = K / 8;
    static_assert(NT % 16 == 0, "16-thread groups");
    constexpr int J = (CPR + NT - 1) / NT;
    uint4 v[8][J];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const int rs = r < M ? r : M - 1;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = threadIdx.x + j * NT;
        if (c < CPR) v[r][j] = *(const uint4*)(x + (u64)rs * (stride_xm / 2) + c * 4);
      }
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = threadIdx.x + j * NT;
        if (j * NT + NT <= CPR || c < CPR) {  // whole 16-thread groups: CPR % 16 == 0
          if (c < CPR) *(uint4*)(xs + r * XW + c * 4) = v[r][j];
          float a = c < CPR ? ((bf_lo(v[r][j].x) + bf_hi(v[r][j].x)) + (bf_lo(v[r][j].y) + bf_hi(v[r][j].y)))
                  + ((bf_lo(v[r][j].z) + bf_hi(v[r][j].z)) + (bf_lo(v[r][j].w) + bf_hi(v[r][j].w))) : 0.f;
          a += __shfl_xor_sync(0xffffffffu, a, 8);
          a += __shfl_xor_sync(0xffffffffu, a, 4);
          a += __shfl_xor_sync(0xffffffffu, a, 2);
          a += __shfl_xor_sync(0xffffffffu, a, 1);
          if ((lane & 15) == 0 && c < CPR) xsum[(c >> 4) * 8 + r] = a;
        }
      }
    }
  }
  __syncthreads();
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (live) {
    const u32* xrow = xs + g * XW + tq * 8 + g0 * 64;
    const float* xsr = xsum + g0 * 8 + tq * 2;
#pragma unroll
    for (int gi = 0; gi < NGW; ++gi) {
      cp_wait<S - 1>();
      const int s = gi % S;
      uint4 w0 = wr[s * 64 + lane], w1 = wr[s * 64 + 32 + lane];
      uint2 zv = sr[s * 32 + lane];
      float p[4] = {0.f, 0.f, 0.f, 0.f};
      const u32* xb = xrow + gi * 64;
      tile_block(p, w0, *(const uint4*)(xb), *(const uint4*)(xb + 4));
      tile_block(p, w1, *(const uint4*)(xb + 32), *(const uint4*)(xb + 36));
      if (gi + S < NGW) {
        cp16(wr + s * 64 + lane, wt + (2 * (gi + S)) * 32);
        cp16(wr + s * 64 + 32 + lane, wt + (2 * (gi + S) + 1) * 32);
        cp8(sr + s * 32 + lane, st + (gi + S) * 8);
      }
      cp_commit();
      float2 xsv = *(const float2*)(xsr + gi * 8);
      float s0 = bf_lo(zv.x), z0 = bf_hi(zv.x), s1 = bf_lo(zv.y), z1 = bf_hi(zv.y);
      acc[0] += s0 * p[0] + (z0 - 128.f * s0) * xsv.x;
      acc[1] += s0 * p[1] + (z0 - 128.f * s0) * xsv.y;
      acc[2] += s1 * p[2] + (z1 - 128.f * s1) * xsv.x;
      acc[3] += s1 * p[3] + (z1 - 128.f * s1) * xsv.y;
    }
  }
  if (KS > 1) {
    if (half > 0) red[((half - 1) * TW + warp % TW) * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (half > 0 || !live) return;
#pragma unroll
    for (int h = 1; h < KS; ++h) {
      float4 o = red[((h - 1) * TW + warp) * 32 + lane];
      acc[0] += o.x; acc[1] += o.y; acc[2] += o.z; acc[3] += o.w;
    }
  }
  if (!live) return;
  const int row = t * 8 + g;
#pragma unroll
  for (int c2 = 0; c2 < 2; ++c2) {
    int m = tq * 2 + c2;
    if (m < M) out[(u64)m * stride_om + row] = to_bf(rnd(gelu_tanh(rnd(acc[c2]))) * rnd(acc[2 + c2]));
  }
}

template <int NW, int S, int K, int KS>
__host__ __device__ constexpr int w4_geglu_ks_smem() {
  return NW * S * 2 * 32 * 16 + NW * S * 32 * 8 + 8 * (K / 2 + 4) * 4 + (K / 128) * 8 * 4 + (KS - 1) * (NW / KS) * 32 * 16;
}
