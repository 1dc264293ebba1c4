// backward_rows: the backward's per-position elementwise work (trimul.h,
// RowsOp), between the matrix products the caller runs.
//
// A persistent grid (a few blocks per SM) of warps; warp w of the grid takes R
// rows at a time: rows R w .. R w + R - 1, then R (w + W) .. (W warps in the
// grid), each row on 32 / R lanes (R = 2 for the LayerNorm ops' 16-bit rows
// that fit half a warp at two groups: one shuffle of the row sums then serves
// both rows; shape_of). Lane l of a row holds its elements 4 l + 4 (32 / R) j +
// {0..3}, j < J, read and written four at a time (one 8- or 16-byte access
// where the row allows it). A lane's columns never change, so the column sums
// (bias and LayerNorm-affine gradients) and the LayerNorm affine stay in its
// registers; at the end the block's warps add theirs into shared memory one
// warp after the other, the block writes one partial row, and
// column_sums_kernel adds the blocks' rows in order: no atomics, bitwise
// repeatable on a given GPU.
// Every value is computed in fp32 whatever the storage types.
#include <algorithm>

#include "common.cuh"

namespace trimul {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGroup = 4;                // elements per lane access
constexpr int kMaxGroups = kMaxRowsLen / (32 * kGroup);
static_assert(kMaxRowsLen % (32 * kGroup) == 0, "row length limit");

// Blocks per SM of the persistent grid; fewer where a lane holds more of a row.
constexpr int blocks_per_sm(int groups) { return groups == 1 ? 4 : groups == 2 ? 2 : 1; }

// The blocks per SM the kernels' register budgets are set for: the grid's, except for
// gating_grads at one group on sm_100 and later, which needs more than 64 registers there;
// its grid then runs in two waves.
template <RowsOp kOp, int J>
constexpr int resident_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  if (kOp == RowsOp::gating_grads && J == 1) return blocks_per_sm(J) / 2;
#endif
  return blocks_per_sm(J);
}

struct Vec4 {
  float v[kGroup];
};

__device__ __forceinline__ void store_f(void* ptr, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::bf16: static_cast<__nv_bfloat16*>(ptr)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<__half*>(ptr)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(ptr)[i] = v; break;
  }
}

// Elements [i, i + n) of t, zeros from n on (n <= 0: all zeros), in two steps so that a
// row's loads are all in flight before the first of them is used: issue4 loads, arrive4
// converts. `vec`: the row length is a multiple of kGroup and the tensor 16-byte aligned, so
// n is 4 (or <= 0) and the four elements are one aligned access, whose raw bits issue4
// returns (fp32: 16 bytes; 16-bit: 8 bytes in .x, .y). Off the vector path issue4 loads and
// converts element by element and returns the floats' bits. (Converting inside the dtype
// switch, as one step, made every load wait for its data before the next was issued.)
__device__ __forceinline__ uint4 issue4(const void* t, DType dtype, int64_t i, int n, bool vec) {
  uint4 u = make_uint4(0u, 0u, 0u, 0u);
  if (n <= 0) return u;
  if (vec) {
    if (dtype == DType::f32) return *reinterpret_cast<const uint4*>(static_cast<const float*>(t) + i);
    const uint2 h = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(t) + i);
    u.x = h.x, u.y = h.y;
    return u;
  }
  float v[kGroup] = {};
#pragma unroll
  for (int e = 0; e < kGroup; ++e)
    if (e < n) v[e] = load_storage(t, dtype, i + e);
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
}

// Four 16-bit elements as issue4 left them (in .x, .y) as floats.
template <typename T>
__device__ __forceinline__ Vec4 unpack4_16bit(uint4 u) {
  using Pair = typename Vec2<T>::type;
  const float2 lo = Vec2<T>::unpack(*reinterpret_cast<const Pair*>(&u.x));
  const float2 hi = Vec2<T>::unpack(*reinterpret_cast<const Pair*>(&u.y));
  return Vec4{{lo.x, lo.y, hi.x, hi.y}};
}

__device__ __forceinline__ Vec4 arrive4(uint4 u, DType dtype, bool vec) {
  if (vec && dtype == DType::bf16) return unpack4_16bit<__nv_bfloat16>(u);
  if (vec && dtype == DType::f16) return unpack4_16bit<__half>(u);
  return Vec4{{__uint_as_float(u.x), __uint_as_float(u.y), __uint_as_float(u.z), __uint_as_float(u.w)}};
}

// Four floats to adjacent 16-bit elements (p 8-byte aligned), in one access.
template <typename T>
__device__ __forceinline__ void store4_16bit(T* p, const Vec4& x) {
  using Pair = typename Vec2<T>::type;
  uint2 u;
  *reinterpret_cast<Pair*>(&u.x) = Vec2<T>::pack(x.v[0], x.v[1]);
  *reinterpret_cast<Pair*>(&u.y) = Vec2<T>::pack(x.v[2], x.v[3]);
  *reinterpret_cast<uint2*>(p) = u;
}

__device__ __forceinline__ void store4(void* t, DType dtype, int64_t i, int n, bool vec, const Vec4& x) {
  if (n <= 0) return;
  if (vec) {
    switch (dtype) {
      case DType::bf16: store4_16bit(static_cast<__nv_bfloat16*>(t) + i, x); return;
      case DType::f16: store4_16bit(static_cast<__half*>(t) + i, x); return;
      default:
        *reinterpret_cast<float4*>(static_cast<float*>(t) + i) = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
        return;
    }
  }
#pragma unroll
  for (int e = 0; e < kGroup; ++e)
    if (e < n) store_f(t, dtype, i + e, x.v[e]);
}

// What a lane holds of every row: its J groups' first element and count, with R rows per warp
// (the lane's row: lane / kLanes of the warp's R); and 1 / len for the row means.
template <int J, int R>
struct Lane {
  static constexpr int kLanes = 32 / R;          // lanes of a row
  static constexpr int kSpan = kGroup * kLanes;  // row elements one group index covers
  int k0[J], n[J];
  float inv_len;
  __device__ __forceinline__ Lane(int len, int lane) : inv_len(1.f / static_cast<float>(len)) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      k0[j] = kSpan * j + kGroup * (lane % kLanes);
      n[j] = min(kGroup, len - k0[j]);
    }
  }
  // The lane on a row past the last: nothing read or written, zeros in every sum.
  __device__ __forceinline__ Lane none() const {
    Lane o = *this;
#pragma unroll
    for (int j = 0; j < J; ++j) o.n[j] = 0;
    return o;
  }
};

// The sum of v over the kLanes lanes of a row.
template <int R>
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int o = 16 / R; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A row's lane elements in the two steps of issue4 / arrive4: a tensor's row is `Issued`
// until arrive_row converts it; load_row does both at once.
template <int J>
struct Issued {
  uint4 u[J];
};

template <int J, int R>
__device__ __forceinline__ Issued<J> issue_row(const void* t, DType dtype, int64_t base, const Lane<J, R>& L, bool vec) {
  Issued<J> r;
#pragma unroll
  for (int j = 0; j < J; ++j) r.u[j] = issue4(t, dtype, base + L.k0[j], L.n[j], vec);
  return r;
}

template <int J>
__device__ __forceinline__ void arrive_row(const Issued<J>& r, DType dtype, bool vec, Vec4 (&v)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) v[j] = arrive4(r.u[j], dtype, vec);
}

template <int J, int R>
__device__ __forceinline__ void load_row(const void* t, DType dtype, int64_t base, const Lane<J, R>& L, bool vec,
                                         Vec4 (&v)[J]) {
  arrive_row(issue_row(t, dtype, base, L, vec), dtype, vec, v);
}

template <int J, int R>
__device__ __forceinline__ void store_row(void* t, DType dtype, int64_t base, const Lane<J, R>& L, bool vec,
                                          const Vec4 (&v)[J]) {
#pragma unroll
  for (int j = 0; j < J; ++j) store4(t, dtype, base + L.k0[j], L.n[j], vec, v[j]);
}

// A vector of the LayerNorm affine (fp32, as long as a row), the lane's elements.
template <int J, int R>
__device__ __forceinline__ void load_affine(const float* t, const Lane<J, R>& L, Vec4 (&v)[J]) {
  load_row(t, DType::f32, 0, L, false, v);
}

// (mean, rstd) of a row held as v (zeros past len): two passes for accuracy.
template <int J, int R>
__device__ __forceinline__ float2 stats_of(const Vec4 (&v)[J], const Lane<J, R>& L, float eps) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < kGroup; ++e) sum += v[j].v[e];
  const float mean = row_sum<R>(sum) * L.inv_len;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      const float d = e < L.n[j] ? v[j].v[e] - mean : 0.f;
      sq += d * d;
    }
  return make_float2(mean, rsqrtf(row_sum<R>(sq) * L.inv_len + eps));
}

// Per-op row work. S: the column-sum sets (the sums are S x len columns).
template <RowsOp kOp> constexpr int kSumSets = kOp == RowsOp::layer_norm ? 0 : kOp == RowsOp::gating_grads ? 4 : 2;

template <int J, int R>
__device__ __forceinline__ void layer_norm_row(const RowsParams& p, int64_t base, const Lane<J, R>& L,
                                               const Vec4 (&w)[J], const Vec4 (&b)[J]) {
  Vec4 v[J];
  load_row(p.src, p.src_dtype, base, L, p.vec, v);
  const float2 st = stats_of(v, L, p.eps);
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < kGroup; ++e) v[j].v[e] = (v[j].v[e] - st.x) * st.y * w[j].v[e] + b[j].v[e];
  store_row(p.out, p.out_dtype, base, L, p.vec, v);
}

// g' = g (+ residual before); dxhat = g' w; out = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
// (+ residual after). acc[0] += g' xhat, acc[1] += g'.
template <int J, int R>
__device__ __forceinline__ void layer_norm_back_row(const RowsParams& p, int64_t base, const Lane<J, R>& L,
                                                    const Vec4 (&w)[J], Vec4 (&acc)[2][J]) {
  Vec4 xh[J], g[J], res[J] = {};
  const Issued<J> xh_in = issue_row(p.src, p.src_dtype, base, L, p.vec);
  const Issued<J> g_in = issue_row(p.src2, p.src2_dtype, base, L, p.vec);
  const bool has_res = p.residual != Residual::none;
  Issued<J> res_in{};
  if (has_res) res_in = issue_row(p.src3, p.src3_dtype, base, L, p.vec);
  arrive_row(xh_in, p.src_dtype, p.vec, xh);
  arrive_row(g_in, p.src2_dtype, p.vec, g);
  if (has_res) arrive_row(res_in, p.src3_dtype, p.vec, res);
  if (p.residual == Residual::before) {
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < kGroup; ++e) g[j].v[e] += res[j].v[e];
  }
  const float2 st = stats_of(xh, L, p.eps);
  float s1 = 0.f, s2 = 0.f;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      // past len: xh, g are zero, so every term below is too
      xh[j].v[e] = e < L.n[j] ? (xh[j].v[e] - st.x) * st.y : 0.f;
      const float dxh = g[j].v[e] * w[j].v[e];
      acc[0][j].v[e] += g[j].v[e] * xh[j].v[e];
      acc[1][j].v[e] += g[j].v[e];
      s1 += dxh;
      s2 += dxh * xh[j].v[e];
    }
  const float m1 = row_sum<R>(s1) * L.inv_len, m2 = row_sum<R>(s2) * L.inv_len;
  const bool after = p.residual == Residual::after;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < kGroup; ++e)
      g[j].v[e] = st.y * (g[j].v[e] * w[j].v[e] - m1 - xh[j].v[e] * m2) + (after ? res[j].v[e] : 0.f);
  store_row(p.out, p.out_dtype, base, L, p.vec, g);
}

// y = src, gpre = src2, G = src3: dy -> out, dgp -> out2; acc[0] += dy, acc[1] += dgp.
template <int J, int R>
__device__ __forceinline__ void gate_grads_row(const RowsParams& p, int64_t base, const Lane<J, R>& L,
                                               Vec4 (&acc)[2][J]) {
  Vec4 y[J], gp[J], G[J];
  const Issued<J> y_in = issue_row(p.src, p.src_dtype, base, L, p.vec);
  const Issued<J> gp_in = issue_row(p.src2, p.src2_dtype, base, L, p.vec);
  const Issued<J> G_in = issue_row(p.src3, p.src3_dtype, base, L, p.vec);
  arrive_row(y_in, p.src_dtype, p.vec, y);
  arrive_row(gp_in, p.src2_dtype, p.vec, gp);
  arrive_row(G_in, p.src3_dtype, p.vec, G);
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      const SigmoidPair s = sigmoid_pair(gp[j].v[e]);
      const float dy = G[j].v[e] * s.s;
      gp[j].v[e] = dy * y[j].v[e] * s.one_minus_s;  // dgp
      G[j].v[e] = dy;
      acc[0][j].v[e] += dy;
      acc[1][j].v[e] += gp[j].v[e];
    }
  store_row(p.out, p.out_dtype, base, L, p.vec, G);
  store_row(p.out2, p.out_dtype, base, L, p.vec, gp);
}

// pre = src (rows of 4 len: pa | ga | pb | gb), da = src2, db = src3 (rows of len),
// mask per row: out = d(pa | ga | pb | gb); acc[q] += out's part q.
template <int J, int R>
__device__ __forceinline__ void gating_grads_row(const RowsParams& p, int64_t r, const Lane<J, R>& L,
                                                 Vec4 (&acc)[4][J]) {
  const int64_t len = p.len, base = r * len, base4 = 4 * base;
  const float m = p.mask ? p.mask[r] : 1.f;
#pragma unroll
  for (int ab = 0; ab < 2; ++ab) {  // a: parts 0, 1; b: parts 2, 3
    Vec4 pj[J], gt[J], d[J];
    const DType d_dtype = ab ? p.src3_dtype : p.src2_dtype;
    const Issued<J> pj_in = issue_row(p.src, p.src_dtype, base4 + 2 * ab * len, L, p.vec);
    const Issued<J> gt_in = issue_row(p.src, p.src_dtype, base4 + (2 * ab + 1) * len, L, p.vec);
    const Issued<J> d_in = issue_row(ab ? p.src3 : p.src2, d_dtype, base, L, p.vec);
    arrive_row(pj_in, p.src_dtype, p.vec, pj);
    arrive_row(gt_in, p.src_dtype, p.vec, gt);
    arrive_row(d_in, d_dtype, p.vec, d);
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int e = 0; e < kGroup; ++e) {
        const SigmoidPair s = sigmoid_pair(gt[j].v[e]);
        const float dp = d[j].v[e] * m * s.s;
        gt[j].v[e] = dp * pj[j].v[e] * s.one_minus_s;  // d(gate pre-activation)
        pj[j].v[e] = dp;                           // d(projection)
        acc[2 * ab][j].v[e] += dp;
        acc[2 * ab + 1][j].v[e] += gt[j].v[e];
      }
    store_row(p.out, p.out_dtype, base4 + 2 * ab * len, L, p.vec, pj);
    store_row(p.out, p.out_dtype, base4 + (2 * ab + 1) * len, L, p.vec, gt);
  }
}

template <RowsOp kOp, int J, int R>
__global__ void __launch_bounds__(kThreads, resident_blocks<kOp, J>()) backward_rows_kernel(const RowsParams p) {
  constexpr int kSets = kSumSets<kOp>;
  extern __shared__ float block_sums[];  // [kSets * len]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int len = static_cast<int>(p.len);
  const Lane<J, R> L(len, lane);
  constexpr int kLanes = Lane<J, R>::kLanes;
  Vec4 w[J] = {}, b[J] = {};
  if constexpr (kOp == RowsOp::layer_norm || kOp == RowsOp::layer_norm_back) load_affine(p.w, L, w);
  if constexpr (kOp == RowsOp::layer_norm) load_affine(p.b, L, b);
  Vec4 acc[kSets > 0 ? kSets : 1][J] = {};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps * R;
  // (the whole warp stays in the loop while any of its rows is left: the row sums shuffle over it)
#pragma unroll 1
  for (int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * R; r0 < p.rows; r0 += stride) {
    const int64_t r = r0 + lane / kLanes;
    const Lane<J, R> Lr = r < p.rows ? L : L.none();
    if constexpr (kOp == RowsOp::layer_norm) layer_norm_row(p, r * len, Lr, w, b);
    if constexpr (kOp == RowsOp::layer_norm_back) layer_norm_back_row(p, r * len, Lr, w, acc);
    if constexpr (kOp == RowsOp::gate_grads) gate_grads_row(p, r * len, Lr, acc);
    if constexpr (kOp == RowsOp::gating_grads) gating_grads_row(p, r, Lr, acc);
  }
  if constexpr (kSets > 0) {
    // the warp's R rows' sums into the lanes of its first, in a fixed order
#pragma unroll
    for (int o = 16; o >= kLanes; o >>= 1)
#pragma unroll
      for (int s = 0; s < kSets; ++s)
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int e = 0; e < kGroup; ++e) acc[s][j].v[e] += __shfl_xor_sync(0xffffffffu, acc[s][j].v[e], o);
    for (int c = threadIdx.x; c < kSets * len; c += kThreads) block_sums[c] = 0.f;
    // the warps add theirs one after the other: a fixed order
#pragma unroll 1
    for (int w8 = 0; w8 < kWarps; ++w8) {
      __syncthreads();
      if (warp != w8) continue;
#pragma unroll
      for (int s = 0; s < kSets; ++s)
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int e = 0; e < kGroup; ++e)
            if (lane < kLanes && e < L.n[j]) block_sums[s * len + L.k0[j] + e] += acc[s][j].v[e];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < kSets * len; c += kThreads)
      p.partial[static_cast<int64_t>(blockIdx.x) * kSets * len + c] = block_sums[c];
  }
}

// sums[c] = sum over blocks b, in order, of partial[b][c]: a block per 32 columns, its
// warps take every kWarps-th block row, then warp 0 adds the warps' sums in order.
__global__ void __launch_bounds__(kThreads) column_sums_kernel(const float* partial, int blocks, int cols,
                                                               float* sums) {
  __shared__ float part[kWarps][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int c = blockIdx.x * 32 + lane;
  float s = 0.f;
  if (c < cols)
    for (int i = warp; i < blocks; i += kWarps) s += partial[static_cast<int64_t>(i) * cols + c];
  part[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && c < cols) {
    float t = 0.f;
    for (int w = 0; w < kWarps; ++w) t += part[w][lane];
    sums[c] = t;
  }
}

// The lanes' layout for a call's rows: (J groups, R rows per warp). The LayerNorm ops, whose rows
// take four row sums each, two rows a warp where they hold up to 128 16-bit elements (16 lanes at
// two groups; N=768 bf16, layer_norm_back: 0.242 -> 0.229 ms, where fp32 rows went 0.6 % the other
// way); everything else one.
struct RowShape {
  int groups, rows_per_warp;
};
constexpr bool has_row_sums(RowsOp op) { return op == RowsOp::layer_norm || op == RowsOp::layer_norm_back; }
RowShape shape_of(const RowsParams& p) {
  const bool narrow = p.src_dtype == DType::bf16 || p.src_dtype == DType::f16;
  if (has_row_sums(p.op) && narrow && p.len <= 128) return {p.len <= 64 ? 1 : 2, 2};
  return {p.len <= 128 ? 1 : p.len <= 256 ? 2 : kMaxGroups, 1};
}

template <RowsOp kOp, int J, int R>
cudaError_t launch_op(const RowsParams& p, int blocks, cudaStream_t stream) {
  const size_t smem = sizeof(float) * kSumSets<kOp> * p.len;
  if (smem > 48 * 1024) {
    const cudaError_t e = allow_dynamic_smem(reinterpret_cast<const void*>(backward_rows_kernel<kOp, J, R>), smem);
    if (e != cudaSuccess) return e;
  }
  backward_rows_kernel<kOp, J, R><<<blocks, kThreads, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || kSumSets<kOp> == 0) return e;
  return launch_column_sums(p.partial, blocks, kSumSets<kOp> * p.len, p.sums, stream);
}

template <RowsOp kOp>
cudaError_t launch_groups(const RowsParams& p, int blocks, cudaStream_t stream) {
  const RowShape shape = shape_of(p);
  if (shape.rows_per_warp == 2) {  // (the LayerNorm ops alone: shape_of)
    if constexpr (has_row_sums(kOp))
      return shape.groups == 1 ? launch_op<kOp, 1, 2>(p, blocks, stream) : launch_op<kOp, 2, 2>(p, blocks, stream);
    return cudaErrorInvalidValue;
  }
  switch (shape.groups) {
    case 1: return launch_op<kOp, 1, 1>(p, blocks, stream);
    case 2: return launch_op<kOp, 2, 1>(p, blocks, stream);
    default: return launch_op<kOp, kMaxGroups, 1>(p, blocks, stream);
  }
}

}  // namespace

int64_t backward_rows_sum_cols(const RowsParams& p) {
  switch (p.op) {
    case RowsOp::layer_norm: return 0;
    case RowsOp::gating_grads: return 4 * p.len;
    default: return 2 * p.len;
  }
}

int64_t backward_rows_blocks(const RowsParams& p, int sm_count) {
  const RowShape shape = shape_of(p);
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(p.rows, kWarps * shape.rows_per_warp),
                                                static_cast<int64_t>(sm_count) * blocks_per_sm(shape.groups)));
}

cudaError_t launch_column_sums(const float* partial, int64_t blocks, int64_t cols, float* sums, cudaStream_t stream) {
  column_sums_kernel<<<static_cast<unsigned>(ceil_div(cols, 32)), kWarps * 32, 0, stream>>>(
      partial, static_cast<int>(blocks), static_cast<int>(cols), sums);
  return cudaGetLastError();
}

cudaError_t launch_backward_rows(const RowsParams& p, int64_t blocks, cudaStream_t stream) {
  if (p.rows == 0)
    return p.sums ? cudaMemsetAsync(p.sums, 0, sizeof(float) * backward_rows_sum_cols(p), stream) : cudaSuccess;
  const int b = static_cast<int>(blocks);
  switch (p.op) {
    case RowsOp::layer_norm: return launch_groups<RowsOp::layer_norm>(p, b, stream);
    case RowsOp::layer_norm_back: return launch_groups<RowsOp::layer_norm_back>(p, b, stream);
    case RowsOp::gate_grads: return launch_groups<RowsOp::gate_grads>(p, b, stream);
    default: return launch_groups<RowsOp::gating_grads>(p, b, stream);
  }
}

}  // namespace trimul
