// Dependent phases inside one thread-block cluster of C CTAs (one multiprocessor each): what a phase boundary
// costs when it is a cluster barrier instead of a kernel launch, and how fast C multiprocessors stream a phase's
// weights. The question behind it: could the MTP drafter's step (~30 dependent launches over ~25 MB, ~71 us on the
// H200 against ~6 us of bytes) run as one cluster?
//
// Phase i maps v (K = dims[i] fp32 values) to u (R = dims[i + 1]): u[r] = tanh(sum_k W_i[r, k] v[k] / sqrt(K)), W_i
// bf16 [R, K] row-major (its own buffer: the chain's weights never repeat, so they stream from memory). CTA `rank`
// owns u's rows rank R / C .. (rank + 1) R / C - 1 in its shared memory (two buffers, phases alternate). A phase:
//   wait at the cluster barrier (the previous phase's rows are all written), gather v from the C CTAs' buffers
//   (mapa + ld.shared::cluster), wait for this phase's weight slice (its cp.async copies were issued before the
//   barrier), one warp a row over K from shared memory, write the rows, issue the next phase's weight slice into the
//   same shared memory, arrive at the barrier (release).
// So a phase's words are in flight across the boundary before it, as the engine's PDL kernels keep theirs. WORK false:
// the boundary alone (gather, copy v's first R / C values of this rank through, barrier).
//
// Built by sweeps/probes/cluster_phases.py (torch.utils.cpp_extension, sm_90a).


typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ u32 cp_smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ u32 cluster_rank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// the float at shared address a (this CTA's layout) in the shared memory of cluster rank r
__device__ __forceinline__ float ld_peer(u32 a, u32 r) {
  float v;
  asm volatile("{\n.reg .b32 p;\nmapa.shared::cluster.u32 p, %1, %2;\nld.shared::cluster.f32 %0, [p];\n}\n"
               : "=f"(v) : "r"(a), "r"(r) : "memory");
  return v;
}

// the CTA's slice of phase i's weights (rows rank R / C ..) into wsm, 16 bytes a copy
template <int THREADS>
__device__ __forceinline__ void issue_slice(uint4* wsm, const u16* w, int R, int K, int C, u32 rank) {
  const int n16 = R / C * K / 8;  // uint4 of the slice
  const uint4* src = (const uint4*)(w + (u64)rank * (R / C) * K);
  for (int i = threadIdx.x; i < n16; i += THREADS)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(cp_smem_u32(wsm + i)), "l"(src + i) : "memory");
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// shared memory: [wmax uint4 weights][vmax fp32 gathered v][2][smax fp32 this rank's rows]
template <int THREADS, bool WORK>
__global__ void __launch_bounds__(THREADS, 1)
cluster_chain(const float* x, const u64* wptr, const int* dims, float* out, int n, int wmax, int vmax, int smax) {
  extern __shared__ uint4 smem[];
  uint4* wsm = smem;
  float* v = (float*)(smem + wmax);
  float* buf = v + vmax;
  const u32 rank = cluster_rank();
  const int C = (int)(gridDim.x), warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // phase -1: this rank's share of x into buffer 0
  {
    const int R = dims[0], per = R / C;
    for (int r = threadIdx.x; r < per; r += THREADS) buf[r] = x[rank * per + r];
  }
  if (WORK && n > 0) issue_slice<THREADS>(wsm, (const u16*)wptr[0], dims[1], dims[0], C, rank);
  __syncthreads();
  cluster_arrive();
  for (int i = 0; i < n; ++i) {
    const int K = dims[i], R = dims[i + 1], kper = K / C, rper = R / C;
    float* cur = buf + (i & 1) * smax;
    float* nxt = buf + ((i + 1) & 1) * smax;
    cluster_wait();  // every rank's rows of v are written
    for (int k = threadIdx.x; k < K; k += THREADS) v[k] = ld_peer(cp_smem_u32(cur + k % kper), (u32)(k / kper));
    if (WORK) asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();  // v gathered, the weight slice landed
    if (WORK) {
      const float scale = rsqrtf((float)K);
      for (int r = warp; r < rper; r += THREADS / 32) {
        const uint4* row = wsm + (u64)r * K / 8;
        float s = 0.f;
        for (int c = lane; c < K / 8; c += 32) {
          const uint4 q = row[c];
          const float* vv = v + c * 8;
          s += __uint_as_float(q.x << 16) * vv[0] + __uint_as_float(q.x & 0xffff0000u) * vv[1]
             + __uint_as_float(q.y << 16) * vv[2] + __uint_as_float(q.y & 0xffff0000u) * vv[3]
             + __uint_as_float(q.z << 16) * vv[4] + __uint_as_float(q.z & 0xffff0000u) * vv[5]
             + __uint_as_float(q.w << 16) * vv[6] + __uint_as_float(q.w & 0xffff0000u) * vv[7];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) nxt[r] = tanhf(s * scale);
      }
    } else {
      for (int r = threadIdx.x; r < rper; r += THREADS) nxt[r] = v[(rank * rper + r) % K];
    }
    __syncthreads();  // the weight slice and v read, the rows written
    if (WORK && i + 1 < n) issue_slice<THREADS>(wsm, (const u16*)wptr[i + 1], dims[i + 2], dims[i + 1], C, rank);
    cluster_arrive();  // this rank's rows of u are written
  }
  cluster_wait();  // every rank is past its last gather: shared memory may go
  const int R = dims[n], per = R / C;
  const float* last = buf + (n & 1) * smax;
  for (int r = threadIdx.x; r < per; r += THREADS) out[rank * per + r] = last[r];
}
