// W4A16 GEMM on the tensor cores for up to 8 bf16 rows, from int4 codes in kernels/mma_w4a16.py's fragment order:
// a plain store (EPI 0, the natural layout) or gate|up + GeGLU (EPI 1, the paired layout, `pair_order`: a 16-row
// tile holds 8 outputs' gate rows and their up rows).
//
// One warp a 16-row tile over a CTA's K slice: no sums across the warps of a CTA, no barrier in the main loop. Each
// warp streams its tile's words and scale / zero words group by group (128 k: 32 + 8 bytes a lane) through its own
// ring of S shared-memory stages with cp.async; a lane reads back only what it copied, so the ring needs no barrier.
// x's slice (8 rows, a row past M a copy of row M - 1) and its sums per group are staged once a CTA after the PDL
// wait; the first S groups of words are requested before it. The group loop is unrolled (constant stage indices).
// The dependents' launch (PDL): after TRIG groups of a warp's loop, FG_TRIG1 at one row (default once the warp has
// asked for its last group, KS / 128 - S) and FG_TRIGN at several (default at the start; runs LU, LV, NF, NG).
// Arithmetic per 64-k block as mma_w4a16's TILE_ASM (4 LOP3 + 3 shifts and one mma per 8 weights a lane); per
// group out += s P + (z - 128 s) sum x, the sums of x by plain fp32 adds (16 threads a group, in shuffle order).
// K split (C > 1): the C CTAs of a thread-block cluster take one K slice each of the same NW tiles; their partial
// sums meet in distributed shared memory, each CTA adding a 1/C share of the outputs over the C ranks in rank
// order. Outputs are not bit-equal to the Triton kernel's, but a row's result does not depend on the rows beside
// it, and is the same at every M. The norm fold's consumer (w4_fold_kernel, C = 1): the same tile loop on the
// producer's two rows, the residual norm's scalars from its partial sums applied in the store, h written on the
// side (kernels/norm_fold.py). Built by kernels/cuda_gemm.py with nvcc (sm_90a), one library per
// (FG_NW, FG_S, FG_KS, FG_C, FG_EPI, FG_TRIG1, FG_TRIGN), holding fg_w4_gemm and, where FG_C is 1, fg_w4_fold.

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


// group gi of a warp's tile into ring stage s: its two word blocks (wt: the tile's lane word, block b at wt + b * 32)
// and its scale / zero words (st: the tile's row-g words, group gi at st + gi * 8)
__device__ __forceinline__ void issue_group(uint4* wr, uint2* sr, int s, const uint4* wt, const uint2* st, int gi,
                                            int lane) {
  cp16(wr + s * 64 + lane, wt + (2 * gi) * 32);
  cp16(wr + s * 64 + 32 + lane, wt + (2 * gi + 1) * 32);
  cp8(sr + s * 32 + lane, st + gi * 8);
}

// x [M, K] (row stride stride_xm elements) into xs [8][K / 2 + 4] u32 (a row past M a copy of row M - 1, read once)
// and its sums per group of 128 and row into xsum [K / 128][8]: every load of a thread before its first store, the
// sums from the same registers (16 threads a group, in shuffle order; a group's threads are all in the row or all
// past it, and every lane meets the shuffles). The caller syncs before reading them. x is the PDL predecessor's
// output: coherent loads (ld.global.cg), never the non-coherent path, which ptxas may move above griddepcontrol.wait
// (it did: x read before the producer finished, wrong tokens in the CUDA-graph step).
template <int NW, int K>
__device__ __forceinline__ void stage_x(const u32* x, u32* xs, float* xsum, int M, int stride_xm, int lane) {
  constexpr int XW = K / 2 + 4, NT = NW * 32, CPR = K / 8, J = (CPR + NT - 1) / NT;  // uint4 of x a row; a thread's
  static_assert(K % 128 == 0 && NT % 16 == 0, "x in whole 16-thread groups of columns");
  uint4 v[8][J];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
#pragma unroll
    for (int j = 0; j < J; ++j) {  // a row past M: row M - 1's registers, not another read of it
      const int c = threadIdx.x + j * NT;
      v[r][j] = r > 0 && r >= M                    ? v[r > 0 ? r - 1 : 0][j]
                : CPR % NT == 0 || c < CPR ? __ldcg((const uint4*)(x + (u64)r * (stride_xm / 2) + c * 4))
                                           : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int r = 0; r < 8; ++r) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = threadIdx.x + j * NT;
      const bool in = CPR % NT == 0 || c < CPR;
      if (in) *(uint4*)(xs + r * XW + c * 4) = v[r][j];
      float a = ((bf_lo(v[r][j].x) + bf_hi(v[r][j].x)) + (bf_lo(v[r][j].y) + bf_hi(v[r][j].y)))
              + ((bf_lo(v[r][j].z) + bf_hi(v[r][j].z)) + (bf_lo(v[r][j].w) + bf_hi(v[r][j].w)));
      a += __shfl_xor_sync(0xffffffffu, a, 8);
      a += __shfl_xor_sync(0xffffffffu, a, 4);
      a += __shfl_xor_sync(0xffffffffu, a, 2);
      a += __shfl_xor_sync(0xffffffffu, a, 1);
      if (in && (lane & 15) == 0) xsum[(c >> 4) * 8 + r] = a;
    }
  }
}

// acc += s P + (z - 128 s) sum x for one group: p its mma sums, zv the scale / zero words of rows g and g + 8, xsv
// the sums of x of the lane's two B columns
__device__ __forceinline__ void scale_group(float* acc, const float* p, uint2 zv, float2 xsv) {
  const float s0 = bf_lo(zv.x), z0 = bf_hi(zv.x), s1 = bf_lo(zv.y), z1 = bf_hi(zv.y);
  acc[0] += s0 * p[0] + (z0 - 128.f * s0) * xsv.x;
  acc[1] += s0 * p[1] + (z0 - 128.f * s0) * xsv.y;
  acc[2] += s1 * p[2] + (z1 - 128.f * s1) * xsv.x;
  acc[3] += s1 * p[3] + (z1 - 128.f * s1) * xsv.y;
}

// B column m = tq * 2 + c2 of tile t and lane row g, if m < M: v0 its row-g sum, v1 its row-(g + 8) sum. EPI 0:
// outputs t * 16 + g and t * 16 + g + 8 as they are; EPI 1 (paired): output t * 8 + g = gelu_tanh(gate v0) * up v1,
// rounded as the eager layer rounds
template <int EPI>
__device__ __forceinline__ void store_unit(u16* out, float v0, float v1, int t, int g, int m, int M, int stride_om) {
  if (m >= M) return;
  u16* o = out + (u64)m * stride_om;
  if (EPI == 1) {
    o[t * 8 + g] = to_bf(rnd(gelu_tanh(rnd(v0))) * rnd(v1));
  } else {
    o[t * 16 + g] = to_bf(v0);
    o[t * 16 + g + 8] = to_bf(v1);
  }
}

// every thread of the cluster's CTAs; release / acquire, so each CTA's shared-memory writes before it are seen by the
// others after it (sm_90a: MEMBAR.ALL.GPU, then the cluster barrier)
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// the float2 at shared address a (this CTA's layout) in the shared memory of cluster rank r
__device__ __forceinline__ float2 ld_rank(u32 a, u32 r) {
  float2 v;
  asm volatile("{\n.reg .b32 p;\nmapa.shared::cluster.u32 p, %2, %3;\nld.shared::cluster.v2.f32 {%0, %1}, [p];\n}\n"
               : "=f"(v.x), "=f"(v.y) : "r"(a), "r"(r) : "memory");
  return v;
}

// One warp's tile and its share of the CTA's shared memory ([NW][S][2][32] uint4 word stages, [NW][S][32] uint2
// scale / zero stages, then x [8][KS / 2 + 4] u32 and its sums [KS / 128][8] float): tile t = (blockIdx.x / C) * NW +
// warp over the K slice of cluster rank r = blockIdx.x % C (k in [r KS, (r + 1) KS)); the lane's words (block b of the
// slice at wt + b * 32) and scale / zero words (group gi of the slice at st + gi * 8).
template <int NW, int S, int KS, int C = 1>
struct WarpTile {
  static constexpr int K = KS * C, KB = K / 64, NG = KS / 128, XW = KS / 2 + 4;  // x rows padded by 16 bytes
  int lane, g, tq, t, rank;
  bool live;
  uint4* wr;
  uint2* sr;
  u32* xs;
  float* xsum;
  const uint4* wt;
  const uint2* st;
  __device__ __forceinline__ WarpTile(uint4* smem, const uint4* words, const uint2* sz, int n_tiles) {
    const int warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    rank = blockIdx.x % C;
    t = (blockIdx.x / C) * NW + warp;
    live = t < n_tiles;
    uint2* szring = (uint2*)(smem + NW * S * 2 * 32);
    wr = smem + warp * S * 64;
    sr = szring + warp * S * 32;
    xs = (u32*)(szring + NW * S * 32);
    xsum = (float*)(xs + 8 * XW);
    wt = words + ((u64)t * KB + rank * (KS / 64)) * 32 + lane;
    st = sz + ((u64)t * (K / 128) + rank * NG) * 8 + g;
  }
  // group gi of the slice into ring stage s
  __device__ __forceinline__ void issue(int s, int gi) const { issue_group(wr, sr, s, wt, st, gi, lane); }
  // the first S groups (weights: no kernel before writes them, so this comes before the PDL wait)
  __device__ __forceinline__ void start() const {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      if (live && s < NG) issue(s, s);
      cp_commit();
    }
  }
};

// the warp's tile over its K slice into acc (rows g, g + 8 of B columns tq * 2, tq * 2 + 1), from the ring that
// `start` filled and x staged in shared memory
template <int TRIG, int NW, int S, int KS, int C>
__device__ __forceinline__ void tile_sums(const WarpTile<NW, S, KS, C>& w, float* acc) {
  using W = WarpTile<NW, S, KS, C>;
  const u32* xrow = w.xs + w.g * W::XW + w.tq * 8;
#pragma unroll
  for (int gi = 0; gi < W::NG; ++gi) {
    cp_wait<S - 1>();  // group gi has landed (a group is committed every step, empty past the last)
    const int s = gi % S;
    uint4 w0 = w.wr[s * 64 + w.lane], w1 = w.wr[s * 64 + 32 + w.lane];
    uint2 zv = w.sr[s * 32 + w.lane];
    float p[4] = {0.f, 0.f, 0.f, 0.f};
    const u32* xb = xrow + gi * 64;
    tile_block(p, w0, *(const uint4*)(xb), *(const uint4*)(xb + 4));
    tile_block(p, w1, *(const uint4*)(xb + 32), *(const uint4*)(xb + 36));
    // the stage just read: its values are in registers, used by the mmas above
    if (gi + S < W::NG) w.issue(s, gi + S);
    cp_commit();
    scale_group(acc, p, zv, *(const float2*)(w.xsum + gi * 8 + w.tq * 2));
    // TRIG groups summed: the dependents may launch (0 or past the last group: not here; gi is a constant once
    // unrolled, so one iteration holds it)
    if (gi + 1 == TRIG && TRIG < W::NG) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
}

// C > 1: each warp's sums into the start of its ring (free: every copy has landed and been read) as [lane][c2]
// float2 (row g, row g + 8); after a cluster barrier, thread i of rank r adds unit u = r U / C + i (U = NW x 64 a
// CTA) over ranks 0 .. C - 1 in order and stores it; a second barrier keeps each CTA's shared memory until its
// peers have read it
template <int NW, int S, int KS, int C, int EPI>
__device__ __forceinline__ void cluster_reduce(const WarpTile<NW, S, KS, C>& w, uint4* smem, const float* acc,
                                               u16* out, int M, int stride_om, int n_tiles) {
  constexpr int U = NW * 64, PER = U / C;
  static_assert(U % C == 0 && PER <= NW * 32, "a unit a thread");
  cp_wait<0>();
  float2* red = (float2*)w.wr;
  red[w.lane * 2] = make_float2(acc[0], acc[2]);
  red[w.lane * 2 + 1] = make_float2(acc[1], acc[3]);
  cluster_sync();
  const int i = threadIdx.x;
  if (i < PER) {
    const int u = w.rank * PER + i, wu = u / 64, lu = (u % 64) / 2, c2 = u % 2;
    const u32 a = smem_u32((const float2*)(smem + wu * S * 64) + lu * 2 + c2);
    float2 v = make_float2(0.f, 0.f);
#pragma unroll
    for (int r = 0; r < C; ++r) {
      const float2 p = ld_rank(a, r);
      v.x += p.x;
      v.y += p.y;
    }
    const int t = (blockIdx.x / C) * NW + wu;
    if (t < n_tiles) store_unit<EPI>(out, v.x, v.y, t, lu >> 2, (lu & 3) * 2 + c2, M, stride_om);
  }
  cluster_sync();
}

// x: [M, K] bf16 (row stride stride_xm elements, rows 16-byte aligned); words [tiles, K/64, 32] uint4; sz
// [tiles, K/128, 8] uint2 (rows g, g + 8: bf16 scale low, zero high); out [M, N] (EPI 1: N / 2) bf16 (row stride
// stride_om). NW warps a CTA, one tile each; S ring stages a warp; K = KS x C, C CTAs a cluster (one slice each).
// TRIG: the groups of its K slice a warp sums before its CTA lets the dependents launch (griddepcontrol.
// launch_dependents): 0 at its start, KS / 128 or more after its main loop.
template <int NW, int S, int KS, int C, int EPI, int TRIG>
__global__ void __launch_bounds__(NW * 32, 1)
w4_gemm_kernel(const u32* x, const uint4* __restrict__ words, const uint2* __restrict__ sz,
               u16* __restrict__ out, int M, int stride_xm, int stride_om, int n_tiles) {
  using W = WarpTile<NW, S, KS, C>;
  extern __shared__ uint4 smem[];
  if constexpr (TRIG <= 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const W w(smem, words, sz, n_tiles);
  w.start();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stage_x<NW, KS>(x + w.rank * (KS / 2), w.xs, w.xsum, M, stride_xm, w.lane);
  __syncthreads();
  if (C == 1 && !w.live) return;  // with C > 1 every thread meets the cluster barriers
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (w.live) tile_sums<TRIG>(w, acc);
  // every thread (the warps past the last tile sum nothing; where the loop triggered, a second changes nothing)
  if constexpr (TRIG > 0) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if constexpr (C == 1) {
    store_unit<EPI>(out, acc[0], acc[2], w.t, w.g, w.tq * 2, M, stride_om);
    store_unit<EPI>(out, acc[1], acc[3], w.t, w.g, w.tq * 2 + 1, M, stride_om);
  } else {
    cluster_reduce<NW, S, KS, C, EPI>(w, smem, acc, out, M, stride_om, n_tiles);
  }
}

// (r1, r2 s) from the warps' partial sums red[0 .. NW - 1] (added in warp order) and the layer scalar red[NW].x, read
// through volatile loads so that a second call after the main loop reads shared memory again instead of holding the
// first call's values in registers through it
template <int NW>
__device__ __forceinline__ float2 fold_scalars(const float4* red, int K, float eps) {
  const volatile float* v = (const volatile float*)red;
  float t0 = v[0], t1 = v[1], t2 = v[2], t3 = v[3];
#pragma unroll
  for (int i = 1; i < NW; ++i) t0 += v[4 * i], t1 += v[4 * i + 1], t2 += v[4 * i + 2], t3 += v[4 * i + 3];
  const float s = v[4 * NW];
  const float r1 = 1.f / sqrtf(t0 / K + eps);
  return make_float2(r1, s / sqrtf(s * s * (t1 + r1 * (2.f * t2 + r1 * t3)) / K + eps));
}

// The norm fold's consumer (kernels/norm_fold.py, one output row, all of K in a CTA): x is the producer's two rows
// [2, K] (a p and u p, B columns 0 and 1); its partials [npart, 4] (a tile's sums of y^2, a^2, a u, u^2) are added in
// one order in every CTA, so every CTA has the same r1 = rsqrt(mean y^2 + eps) and r2 s = s rsqrt(mean h^2 + eps);
// the output row is r2 s (column 0 + r1 column 1) through the EPI store, and the first CTAs write
// h = (a + y r1 (post + off)) s, NT entries each, rounded as the eager layer rounds. scale_kind: 0 no layer scalar,
// 1 bf16, 2 fp32. Every load after the weights' copies reads an earlier kernel's output or a parameter: after the
// wait, coherent.
template <int NW, int S, int K, int EPI>
__global__ void __launch_bounds__(NW * 32, 1)
w4_fold_kernel(const u32* rows, const uint4* __restrict__ words, const uint2* __restrict__ sz, u16* __restrict__ out,
               const float* parts, int npart, const u16* res, const u16* y, const u16* post, const void* scale,
               int scale_kind, u16* h, float eps, float off, int n_tiles, int m_out, int stride_om) {
  using W = WarpTile<NW, S, K, 1>;
  constexpr int NT = NW * 32;
  extern __shared__ uint4 smem[];
  __shared__ float4 red[NW + 1];  // the warps' partial sums, then the layer scalar
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const W w(smem, words, sz, n_tiles);
  w.start();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // this thread's partial rows (npart <= 2 NT), in order: a fixed count, no loop (a loop of per-thread trip counts
  // made ptxas emulate every later shuffle as a collective: 2.4x the kernel's time, run JQ)
  float4 pv = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = threadIdx.x + i * NT;
    const float4 v = r < npart ? __ldcg((const float4*)parts + r) : make_float4(0.f, 0.f, 0.f, 0.f);
    pv.x += v.x, pv.y += v.y, pv.z += v.z, pv.w += v.w;
  }
  const int k = blockIdx.x * NT + threadIdx.x;  // this thread's entry of h
  const bool hk = k < K;
  const u32 av = hk ? __ldcg(res + k) : 0, yv = hk ? __ldcg(y + k) : 0, pw = hk ? __ldcg(post + k) : 0;
  const float s = scale_kind == 1 ? bf_lo(__ldcg((const u16*)scale)) : scale_kind == 2 ? __ldcg((const float*)scale)
                                                                                       : 1.f;
  stage_x<NW, K>(rows, w.xs, w.xsum, 2, K, w.lane);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    pv.x += __shfl_xor_sync(0xffffffffu, pv.x, o);
    pv.y += __shfl_xor_sync(0xffffffffu, pv.y, o);
    pv.z += __shfl_xor_sync(0xffffffffu, pv.z, o);
    pv.w += __shfl_xor_sync(0xffffffffu, pv.w, o);
  }
  if (w.lane == 0) red[threadIdx.x >> 5] = pv;
  if (threadIdx.x == 0) red[NW] = make_float4(s, 0.f, 0.f, 0.f);
  __syncthreads();  // x staged, the warps' partial sums in
  float2 r = fold_scalars<NW>(red, K, eps);
  if (hk) {
    const float sc = red[NW].x;
    float hv = rnd(bf_lo(av) + rnd(bf_lo(yv) * r.x * (bf_lo(pw) + off)));
    if (scale_kind) hv = rnd(hv * sc);
    h[k] = to_bf(hv);
  }
  if (!w.live) return;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  tile_sums<0>(w, acc);
  // the scalars made again from shared memory, not held through the main loop, and the output row count and stride
  // as arguments (m_out = 1): with constants and held scalars ptxas took 183-191 registers against the plain
  // kernel's 152, and the kernel ran 2.4-5 us slower (runs JR-JW; the plain kernel's body with these arguments in
  // this kernel: 150 registers, 9.22 us)
  r = fold_scalars<NW>(red, K, eps);
  // B columns 0 and 1 are the lane's acc[0] / acc[1] (rows g) and acc[2] / acc[3] (rows g + 8) where tq = 0
  store_unit<EPI>(out, r.y * (acc[0] + r.x * acc[1]), r.y * (acc[2] + r.x * acc[3]), w.t, w.g, w.tq * 2, m_out,
                  stride_om);
}

template <int NW, int S, int KS>
__host__ __device__ constexpr int w4_gemm_smem() {
  return NW * S * 2 * 32 * 16 + NW * S * 32 * 8 + 8 * (KS / 2 + 4) * 4 + (KS / 128) * 8 * 4;
}

#ifdef FG_NW
#include <cuda_runtime.h>
#ifndef FG_TRIG1
// one row: once the warp's last group is asked for (its copy issued in the loop), the S groups in flight still to sum
#define FG_TRIG1 (FG_KS / 128 > FG_S ? FG_KS / 128 - FG_S : 1)
#endif
#ifndef FG_TRIGN
#define FG_TRIGN 0
#endif
// one launch of `kernel` (its shared-memory limit raised once a device): grid CTAs, clusters of `cluster`, PDL if
// asked; 0 on success, else the CUDA error code (cudaGetErrorString names it)
template <auto kernel, typename... Args>
static int fg_launch(int grid, int cluster, void* stream, int pdl, Args... args) {
  constexpr int smem = w4_gemm_smem<FG_NW, FG_S, FG_KS>();
  static bool ready[64] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  if (dev >= 64 || !ready[dev]) {
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    if (dev < 64) ready[dev] = true;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(FG_NW * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute a[2];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
  a[1].id = cudaLaunchAttributeClusterDimension;
  a[1].val.clusterDim.x = cluster;
  a[1].val.clusterDim.y = 1;
  a[1].val.clusterDim.z = 1;
  cfg.attrs = a;
  cfg.numAttrs = cluster > 1 ? 2 : 1;
  return (int)cudaLaunchKernelEx(&cfg, kernel, args...);
}

extern "C" int fg_w4_gemm(const void* x, const void* words, const void* sz, void* out, int M, int stride_xm,
                          int stride_om, int n_tiles, void* stream, int pdl) {
  const int grid = (n_tiles + FG_NW - 1) / FG_NW * FG_C;
  if (M > 1)
    return fg_launch<w4_gemm_kernel<FG_NW, FG_S, FG_KS, FG_C, FG_EPI, FG_TRIGN>>(
        grid, FG_C, stream, pdl, (const u32*)x, (const uint4*)words, (const uint2*)sz, (u16*)out, M, stride_xm,
        stride_om, n_tiles);
  return fg_launch<w4_gemm_kernel<FG_NW, FG_S, FG_KS, FG_C, FG_EPI, FG_TRIG1>>(
      grid, FG_C, stream, pdl, (const u32*)x, (const uint4*)words, (const uint2*)sz, (u16*)out, M, stride_xm,
      stride_om, n_tiles);
}

#if FG_C == 1
// the norm fold's consumer (w4_fold_kernel) on this library's warps, stages and epilogue; K = FG_KS
extern "C" int fg_w4_fold(const void* rows, const void* words, const void* sz, void* out, const void* parts,
                          int npart, const void* res, const void* y, const void* post, const void* scale,
                          int scale_kind, void* h, float eps, float off, int n_tiles, void* stream, int pdl) {
  return fg_launch<w4_fold_kernel<FG_NW, FG_S, FG_KS, FG_EPI>>(
      (n_tiles + FG_NW - 1) / FG_NW, 1, stream, pdl, (const u32*)rows, (const uint4*)words, (const uint2*)sz,
      (u16*)out, (const float*)parts, npart, (const u16*)res, (const u16*)y, (const u16*)post, scale, scale_kind,
      (u16*)h, eps, off, n_tiles, 1, 0);
}
#endif

extern "C" const char* fg_error_string(int e) { return cudaGetErrorString((cudaError_t)e); }
#endif
