// backward_rows: the backward's per-position elementwise work (trimul.h,
// RowsOp), between the matrix products the caller runs. A warp takes one row
// (position) at a time, lanes stride along it; every value is computed in fp32
// whatever the storage types (read and written through a warp-uniform dtype
// switch). Column sums (bias and LayerNorm-affine gradients) accumulate per
// warp in shared memory, then per block in a fixed order, into
// partial[block][...]: no atomics, bitwise repeatable.
#include "common.cuh"

namespace trimul {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kPer = 8;             // row elements per lane held in registers (k = lane + 32 j),
constexpr int kRegLen = 32 * kPer;  // for LayerNorm rows up to this long: one read of each input

// The storage types here: f32, bf16, f16.
__device__ __forceinline__ float load_f(const void* ptr, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(ptr)[i]);
    default: return static_cast<const float*>(ptr)[i];
  }
}

__device__ __forceinline__ void store_f(void* ptr, DType dtype, int64_t i, float v) {
  switch (dtype) {
    case DType::bf16: static_cast<__nv_bfloat16*>(ptr)[i] = __float2bfloat16_rn(v); break;
    case DType::f16: static_cast<__half*>(ptr)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(ptr)[i] = v; break;
  }
}

__device__ __forceinline__ float sigmoid_accurate(float v) { return 1.f / (1.f + __expf(-v)); }

// (mean, rstd) of row `base` of src, len elements: two passes.
__device__ __forceinline__ float2 row_stats(const RowsParams& p, int64_t base, int len, int lane) {
  float sum = 0.f;
#pragma unroll 1
  for (int k = lane; k < len; k += 32) sum += load_f(p.src, p.src_dtype, base + k);
  const float mean = warp_sum(sum) / static_cast<float>(len);
  float sq = 0.f;
#pragma unroll 1
  for (int k = lane; k < len; k += 32) {
    const float d = load_f(p.src, p.src_dtype, base + k) - mean;
    sq += d * d;
  }
  return make_float2(mean, rsqrtf(warp_sum(sq) / static_cast<float>(len) + p.eps));
}

// A row (len <= kRegLen) in registers: the lane's elements k = lane + 32 j, zeros past len.
__device__ __forceinline__ void load_row(const void* t, DType dtype, int64_t base, int len, int lane,
                                         float (&v)[kPer]) {
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int k = lane + 32 * j;
    v[j] = k < len ? load_f(t, dtype, base + k) : 0.f;
  }
}

// (mean, rstd) of a row in registers.
__device__ __forceinline__ float2 stats_of(const float (&v)[kPer], int len, int lane, float eps) {
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) sum += v[j];
  const float mean = warp_sum(sum) / static_cast<float>(len);
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j)
    if (lane + 32 * j < len) sq += (v[j] - mean) * (v[j] - mean);
  return make_float2(mean, rsqrtf(warp_sum(sq) / static_cast<float>(len) + eps));
}

__device__ __forceinline__ void layer_norm_row(const RowsParams& p, int64_t r, int lane) {
  const int len = static_cast<int>(p.len);
  const int64_t base = r * len;
  if (len <= kRegLen) {
    float v[kPer];
    load_row(p.src, p.src_dtype, base, len, lane, v);
    const float2 st = stats_of(v, len, lane, p.eps);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int k = lane + 32 * j;
      if (k < len) store_f(p.out, p.out_dtype, base + k, (v[j] - st.x) * st.y * p.w[k] + p.b[k]);
    }
    return;
  }
  const float2 st = row_stats(p, base, len, lane);
#pragma unroll 1
  for (int k = lane; k < len; k += 32)
    store_f(p.out, p.out_dtype, base + k, (load_f(p.src, p.src_dtype, base + k) - st.x) * st.y * p.w[k] + p.b[k]);
}

// LayerNorm's output gradient g' = g (+ the residual, where it is added before).
__device__ __forceinline__ float back_grad(const RowsParams& p, int64_t i) {
  const float g = load_f(p.src2, p.src2_dtype, i);
  return p.residual == Residual::before ? g + load_f(p.src3, p.src3_dtype, i) : g;
}

// g' = g (+ residual before); dxhat = g' w; out = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
// (+ residual after). acc[k] += g' xhat, acc[len + k] += g'.
__device__ __forceinline__ void layer_norm_back_row(const RowsParams& p, int64_t r, int lane, float* acc) {
  const int len = static_cast<int>(p.len);
  const int64_t base = r * len;
  if (len <= kRegLen) {
    float xh[kPer], g[kPer];
    load_row(p.src, p.src_dtype, base, len, lane, xh);
    load_row(p.src2, p.src2_dtype, base, len, lane, g);
    if (p.residual == Residual::before) {
      float res[kPer];
      load_row(p.src3, p.src3_dtype, base, len, lane, res);
#pragma unroll
      for (int j = 0; j < kPer; ++j) g[j] += res[j];
    }
    const float2 st = stats_of(xh, len, lane, p.eps);
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int k = lane + 32 * j;
      if (k >= len) continue;
      xh[j] = (xh[j] - st.x) * st.y;
      const float dxh = g[j] * p.w[k];
      acc[k] += g[j] * xh[j];
      acc[len + k] += g[j];
      s1 += dxh;
      s2 += dxh * xh[j];
    }
    const float m1 = warp_sum(s1) / static_cast<float>(len), m2 = warp_sum(s2) / static_cast<float>(len);
    float res[kPer];  // added to the result
    if (p.residual == Residual::after) {
      load_row(p.src3, p.src3_dtype, base, len, lane, res);
    } else {
#pragma unroll
      for (int j = 0; j < kPer; ++j) res[j] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int k = lane + 32 * j;
      if (k < len) store_f(p.out, p.out_dtype, base + k, st.y * (g[j] * p.w[k] - m1 - xh[j] * m2) + res[j]);
    }
    return;
  }
  const float2 st = row_stats(p, base, len, lane);
  float s1 = 0.f, s2 = 0.f;
#pragma unroll 1
  for (int k = lane; k < len; k += 32) {
    const float xh = (load_f(p.src, p.src_dtype, base + k) - st.x) * st.y;
    const float g = back_grad(p, base + k), dxh = g * p.w[k];
    acc[k] += g * xh;
    acc[len + k] += g;
    s1 += dxh;
    s2 += dxh * xh;
  }
  const float m1 = warp_sum(s1) / static_cast<float>(len), m2 = warp_sum(s2) / static_cast<float>(len);
#pragma unroll 1
  for (int k = lane; k < len; k += 32) {
    const float xh = (load_f(p.src, p.src_dtype, base + k) - st.x) * st.y;
    const float dxh = back_grad(p, base + k) * p.w[k];
    float v = st.y * (dxh - m1 - xh * m2);
    if (p.residual == Residual::after) v += load_f(p.src3, p.src3_dtype, base + k);
    store_f(p.out, p.out_dtype, base + k, v);
  }
}

// y = src, gpre = src2, G = src3 (rows of len): dy -> out, dgp -> out2.
__device__ __forceinline__ void gate_grads_row(const RowsParams& p, int64_t r, int lane, float* acc) {
  const int len = static_cast<int>(p.len);
  const int64_t base = r * len;
  for (int k = lane; k < len; k += 32) {
    const float s = sigmoid_accurate(load_f(p.src2, p.src2_dtype, base + k));
    const float dy = load_f(p.src3, p.src3_dtype, base + k) * s;
    const float dgp = dy * load_f(p.src, p.src_dtype, base + k) * (1.f - s);
    store_f(p.out, p.out_dtype, base + k, dy);
    store_f(p.out2, p.out_dtype, base + k, dgp);
    acc[k] += dy;
    acc[len + k] += dgp;
  }
}

// pre = src (rows of 4 len: pa | ga | pb | gb), da = src2, db = src3 (rows of len),
// mask per row: out = d(pa | ga | pb | gb).
__device__ __forceinline__ void gating_grads_row(const RowsParams& p, int64_t r, int lane, float* acc) {
  const int len = static_cast<int>(p.len);
  const int64_t base = r * len, base4 = 4 * base;
  const float m = p.mask ? p.mask[r] : 1.f;
  for (int k = lane; k < len; k += 32) {
#pragma unroll
    for (int ab = 0; ab < 2; ++ab) {  // a: columns [0, 2 len), b: [2 len, 4 len)
      const int c = 2 * ab * len + k;
      const float pj = load_f(p.src, p.src_dtype, base4 + c);
      const float s = sigmoid_accurate(load_f(p.src, p.src_dtype, base4 + c + len));
      const float d = (ab ? load_f(p.src3, p.src3_dtype, base + k) : load_f(p.src2, p.src2_dtype, base + k)) * m;
      const float dp = d * s, dg = dp * pj * (1.f - s);
      store_f(p.out, p.out_dtype, base4 + c, dp);
      store_f(p.out, p.out_dtype, base4 + c + len, dg);
      acc[c] += dp;
      acc[c + len] += dg;
    }
  }
}

template <RowsOp kOp>
__global__ void __launch_bounds__(kWarps * 32) backward_rows_kernel(const RowsParams p, int cols) {
  extern __shared__ float acc_all[];  // [kWarps][cols]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* acc = acc_all + warp * cols;
  for (int c = lane; c < cols; c += 32) acc[c] = 0.f;
  __syncwarp();
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp;
  for (int i = 0; i < kRowsPerWarp && first + i < p.rows; ++i) {
    const int64_t r = first + i;
    if constexpr (kOp == RowsOp::layer_norm) layer_norm_row(p, r, lane);
    if constexpr (kOp == RowsOp::layer_norm_back) layer_norm_back_row(p, r, lane, acc);
    if constexpr (kOp == RowsOp::gate_grads) gate_grads_row(p, r, lane, acc);
    if constexpr (kOp == RowsOp::gating_grads) gating_grads_row(p, r, lane, acc);
    __syncwarp();
  }
  if (cols == 0) return;
  __syncthreads();
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < kWarps; ++w) s += acc_all[w * cols + c];
    p.partial[static_cast<int64_t>(blockIdx.x) * cols + c] = s;
  }
}

template <RowsOp kOp>
cudaError_t launch_op(const RowsParams& p, int cols, cudaStream_t stream) {
  const size_t smem = sizeof(float) * kWarps * cols;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(backward_rows_kernel<kOp>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  const int64_t blocks = ceil_div(p.rows, kRowsPerBlock);
  if (blocks > 0) backward_rows_kernel<kOp><<<static_cast<unsigned>(blocks), kWarps * 32, smem, stream>>>(p, cols);
  return cudaGetLastError();
}

}  // namespace

int64_t backward_rows_blocks(int64_t rows) { return ceil_div(rows, kRowsPerBlock); }

int64_t backward_rows_sum_cols(const RowsParams& p) {
  switch (p.op) {
    case RowsOp::layer_norm: return 0;
    case RowsOp::gating_grads: return 4 * p.len;
    default: return 2 * p.len;
  }
}

cudaError_t launch_backward_rows(const RowsParams& p, cudaStream_t stream) {
  const int cols = static_cast<int>(backward_rows_sum_cols(p));
  switch (p.op) {
    case RowsOp::layer_norm: return launch_op<RowsOp::layer_norm>(p, cols, stream);
    case RowsOp::layer_norm_back: return launch_op<RowsOp::layer_norm_back>(p, cols, stream);
    case RowsOp::gate_grads: return launch_op<RowsOp::gate_grads>(p, cols, stream);
    default: return launch_op<RowsOp::gating_grads>(p, cols, stream);
  }
}

}  // namespace trimul
