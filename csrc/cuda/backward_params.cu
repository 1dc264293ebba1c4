// The fused backward's parameter-sized work, one launch at each end of it
// (trimul::_backward_fused): out_back_weights makes the output stage's weights
// as out_stage_back reads them from the fp32 pack, param_grads assembles the
// 16 parameters' gradients from the sums and products the big kernels leave.
// As torch operators these were 23 launches of a few µs of GPU time each and two
// cuBLAS calls, each a host call of tens of µs (benchmarks/NOTES.md, "Host time
// of a training step").
// Every sum runs in a fixed order: the gradients are bitwise repeatable.
#include "common.cuh"
#include "range.cuh"

namespace trimul {
namespace {

constexpr int kWeightThreads = 128;  // out_back_weights: a block per output row p, threads over its columns
constexpr int kGradThreads = 256;    // param_grads: a thread per gradient element

// The block's sum of v, in a fixed order (warp shuffles, then the warps' sums in order).
__device__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < kWeightThreads / 32; ++w) total += scratch[w];
  return total;
}

template <typename T>
__global__ void __launch_bounds__(kWeightThreads) out_back_weights_kernel(OutBackWeightsParams p) {
  __shared__ float scratch[3][kWeightThreads / 32];
  const int row = blockIdx.x;
  const int P = static_cast<int>(p.P), H = static_cast<int>(p.H);
  const float* wo = p.packed + p.layout.w_out + static_cast<int64_t>(row) * H;
  const float* gamma = p.packed + p.layout.ln_out_w;
  const float* beta = p.packed + p.layout.ln_out_b;
  T* wo_g = static_cast<T*>(p.wo_g) + static_cast<int64_t>(row) * H;
  float stored = 0.f, shift = 0.f;  // this thread's parts of s_out and of Wo beta
  for (int h = threadIdx.x; h < H; h += kWeightThreads) {
    const T v = from_float<T>(__fmul_rn(wo[h], gamma[h]));
    wo_g[h] = v;
    stored += to_float(v);
    shift = fmaf(wo[h], beta[h], shift);
  }
  const float* wg = p.packed + p.layout.w_gate + static_cast<int64_t>(row) * P;
  T* wg_op = static_cast<T*>(p.wg) + static_cast<int64_t>(row) * P;
  float rounding = 0.f;  // this thread's part of g_round: Wg less Wg as stored
  for (int q = threadIdx.x; q < P; q += kWeightThreads) {
    const T v = from_float<T>(wg[q]);
    wg_op[q] = v;
    rounding += wg[q] - to_float(v);
  }
  stored = block_sum(stored, scratch[0]);
  shift = block_sum(shift, scratch[1]);
  rounding = block_sum(rounding, scratch[2]);
  if (threadIdx.x == 0) {
    p.s_out[row] = stored;
    p.t_out[row] = p.packed[p.layout.b_out + row] + shift;
    p.g_round[row] = rounding;
  }
}

// The gradients' offsets in trimul.forward's order: the input LayerNorm's affine, the four
// projections' weights and biases (proj_a, gate_a, proj_b, gate_b), the output LayerNorm's
// affine, Wo, bo, Wg, bg.
struct GradLayout {
  int64_t ln_in, w_in, ln_out_w, ln_out_b, w_out, b_out, w_gate, b_gate, total;
};
__host__ __device__ inline GradLayout grad_layout(int64_t P, int64_t H) {
  GradLayout g{};
  g.ln_in = 0;
  g.w_in = 2 * P;  // 4 blocks of [H][P] weights then [H] biases
  g.ln_out_w = g.w_in + 4 * (H * P + H);
  g.ln_out_b = g.ln_out_w + H;
  g.w_out = g.ln_out_b + H;
  g.b_out = g.w_out + P * H;
  g.w_gate = g.b_out + P;
  g.b_gate = g.w_gate + P * P;
  g.total = g.b_gate + P;
  return g;
}

// A weight gradient's row from q^T x (x = xhat / rstd + mean, so q^T x = dpre^T xhat + m 1^T with
// m = q^T mean, the row's mean: each row of xhat sums to 0), by a warp (lanes over c):
// out[c] = ((raw[c] - m) gamma[c] + sum beta[c]) scale, with m summed in a fixed order (scale a power
// of two: exact).
__device__ void centered_row(const void* raw, DType dtype, int64_t at, int cols, const float* gamma,
                             const float* beta, float sum, float* out, float scale = 1.f) {
  const int lane = threadIdx.x % 32;
  float s = 0.f;
  for (int c = lane; c < cols; c += 32) s += load_any(raw, dtype, at + c);
  const float m = warp_sum(s) / static_cast<float>(cols);
  for (int c = lane; c < cols; c += 32)
    out[c] = scale * fmaf(__fsub_rn(load_any(raw, dtype, at + c), m), gamma[c], __fmul_rn(sum, beta[c]));
}

// What w_in's gradient row of block k (proj_a, gate_a, proj_b, gate_b) is multiplied by: 2^-t for
// the projections under c's headroom (ParamGradsParams::headroom), else 1.
__device__ __forceinline__ float w_in_grad_scale(const ParamGradsParams& p, int k) {
  return k % 2 == 0 ? headroom_scale(p.headroom) : 1.f;
}

// Blocks [0, reduce_blocks) compute the output LayerNorm's affine, a warp per value (lanes over
// p: a thread walking all P alone waited on each of its loads in turn, 40 us at P = 128), where
// gate_centered the gate's weight gradient and where in_centered w_in's, a warp per row; the
// others every other gradient, a thread per element.
__host__ __device__ inline int64_t reduce_warps(const ParamGradsParams& p) {
  return 2 * p.H + (p.gate_centered ? p.P : 0) + (p.in_centered ? 4 * p.H : 0);
}
__host__ __device__ inline int64_t reduce_blocks(const ParamGradsParams& p) {
  return ceil_div(reduce_warps(p), kGradThreads / 32);
}

__global__ void __launch_bounds__(kGradThreads) param_grads_kernel(ParamGradsParams p) {
  // 32-bit index math (P, H <= kOutBackMaxWidth: ~10^5 elements); 64-bit divisions are calls
  // around which ptxas spilled
  const int P = static_cast<int>(p.P), H = static_cast<int>(p.H);
  const GradLayout l = grad_layout(P, H);
  const int w_in = static_cast<int>(l.w_in), ln_out_w = static_cast<int>(l.ln_out_w);
  const int w_out = static_cast<int>(l.w_out), b_out = static_cast<int>(l.b_out);
  const int w_gate = static_cast<int>(l.w_gate), b_gate = static_cast<int>(l.b_gate);
  const int total = static_cast<int>(l.total), block_stride = H * P + H;
  const float* wo = p.packed + p.layout.w_out;  // [P][H]
  const float* sum_dy = p.gate_sums;            // then sum(dgp)
  const int first = static_cast<int>(reduce_blocks(p));
  if (static_cast<int>(blockIdx.x) < first) {
    const int at = blockIdx.x * (kGradThreads / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    if (at >= static_cast<int>(reduce_warps(p))) return;
    const float* gamma_in = p.packed + p.layout.ln_in_w;
    const float* beta_in = p.packed + p.layout.ln_in_b;
    const int gate_rows = p.gate_centered ? P : 0;
    if (at >= 2 * H + gate_rows) {
      // w_in's pack row r = 4 h + k (InputBackParams::dx): dW = (q^T x - m 1^T) diag(gamma_in) +
      // sum(dpre) beta_in^T, into block k's row h
      const int r = at - 2 * H - gate_rows;
      centered_row(p.d_w_in, p.d_w_in_dtype, static_cast<int64_t>(r) * P, P, gamma_in, beta_in, p.d_b_in[r],
                   p.grads + w_in + (r % 4) * block_stride + (r / 4) * P, w_in_grad_scale(p, r % 4));
      return;
    }
    if (at >= 2 * H) {  // the gate's row r from q^T x (OutBackLaunch::gate_centered)
      const int r = at - 2 * H;
      centered_row(p.d_wg, p.d_wg_dtype, static_cast<int64_t>(r) * P, P, gamma_in, beta_in, p.gate_sums[P + r],
                   p.grads + w_gate + r * P);
      return;
    }
    // dgamma = sum_p Wo (dy^T chat), dbeta = Wo^T sum(dy)
    const int h = at % H;
    const bool scale = at < H;
    float s = 0.f;
    for (int r = lane; r < P; r += 32)
      s = fmaf(wo[r * H + h], scale ? load_any(p.m_wo, p.m_wo_dtype, r * H + h) : sum_dy[r], s);
    s = warp_sum(s);
    if (lane == 0) p.grads[ln_out_w + at] = s;
    return;
  }
  for (int i = (blockIdx.x - first) * kGradThreads + threadIdx.x; i < total; i += (gridDim.x - first) * kGradThreads) {
    float v;
    if (i < w_in) {
      v = p.in_sums[i];
    } else if (i < ln_out_w) {  // block k of [H][P] weights, then [H] biases; the pack's rows are 4 h + k
      const int k = (i - w_in) / block_stride, at = (i - w_in) % block_stride;
      if (at < H * P && p.in_centered) continue;  // (the reducing blocks')
      v = w_in_grad_scale(p, k) * (at < H * P ? load_any(p.d_w_in, p.d_w_in_dtype, (4 * (at / P) + k) * P + at % P)
                                              : p.d_b_in[4 * (at - H * P) + k]);
    } else if (i < w_out) {
      continue;  // (the reducing blocks')
    } else if (i < b_out) {  // dWo = (dy^T chat) gamma + (sum dy) beta^T
      const int r = (i - w_out) / H, h = (i - w_out) % H;
      v = __fadd_rn(__fmul_rn(load_any(p.m_wo, p.m_wo_dtype, r * H + h), p.packed[p.layout.ln_out_w + h]),
                    __fmul_rn(sum_dy[r], p.packed[p.layout.ln_out_b + h]));
    } else if (i < w_gate) {
      v = sum_dy[i - b_out];
    } else if (i < b_gate) {
      if (p.gate_centered) continue;  // (the reducing blocks')
      v = load_any(p.d_wg, p.d_wg_dtype, i - w_gate);
    } else {
      v = p.gate_sums[P + (i - b_gate)];
    }
    p.grads[i] = v;
  }
}

__global__ void __launch_bounds__(kGradThreads)
    centered_rows_kernel(const float* raw, const float* gamma, const float* beta, const float* sums, int64_t rows,
                         int cols, float* out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * (kGradThreads / 32) + threadIdx.x / 32;
  if (r < rows) centered_row(raw, DType::f32, r * cols, cols, gamma, beta, sums[r], out + r * cols);
}

}  // namespace

cudaError_t launch_out_back_weights(const OutBackWeightsParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.P));
  if (p.op_dtype == DType::bf16)
    out_back_weights_kernel<__nv_bfloat16><<<grid, kWeightThreads, 0, stream>>>(p);
  else if (p.op_dtype == DType::f16)
    out_back_weights_kernel<__half><<<grid, kWeightThreads, 0, stream>>>(p);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

int64_t param_grads_size(int64_t P, int64_t H) { return grad_layout(P, H).total; }

cudaError_t launch_centered_rows(const float* raw, const float* gamma, const float* beta, const float* sums,
                                 int64_t rows, int64_t cols, float* out, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = ceil_div(rows, kGradThreads / 32);
  centered_rows_kernel<<<static_cast<unsigned>(blocks), kGradThreads, 0, stream>>>(raw, gamma, beta, sums, rows,
                                                                                   static_cast<int>(cols), out);
  return cudaGetLastError();
}

cudaError_t launch_param_grads(const ParamGradsParams& p, cudaStream_t stream) {
  const int64_t blocks = reduce_blocks(p) + ceil_div(param_grads_size(p.P, p.H), kGradThreads);
  param_grads_kernel<<<static_cast<unsigned>(blocks), kGradThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace trimul
