// The fused backward's parameter-sized work, one launch at each end of it
// (trimul::_backward_fused): out_back_weights makes the output stage's weights
// as out_stage_back reads them from the fp32 pack, param_grads assembles the
// 16 parameters' gradients from the sums and products the big kernels leave.
// As torch operators these were 23 launches of a few µs of GPU time each and two
// cuBLAS calls, each a host call of tens of µs (benchmarks/NOTES.md, "Host time
// of a training step").
// Every sum runs in a fixed order: the gradients are bitwise repeatable.
#include "common.cuh"

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
  __shared__ float scratch[2][kWeightThreads / 32];
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
  for (int q = threadIdx.x; q < P; q += kWeightThreads) wg_op[q] = from_float<T>(wg[q]);
  stored = block_sum(stored, scratch[0]);
  shift = block_sum(shift, scratch[1]);
  if (threadIdx.x == 0) {
    p.s_out[row] = stored;
    p.t_out[row] = p.packed[p.layout.b_out + row] + shift;
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

// Blocks [0, reduce_blocks) compute the output LayerNorm's affine, a warp per value (lanes over
// p: a thread walking all P alone waited on each of its loads in turn, 40 us at P = 128), and where
// gate_centered the gate's weight gradient, a warp per row; the others every other gradient, a
// thread per element.
__host__ __device__ inline int64_t reduce_warps(const ParamGradsParams& p) {
  return 2 * p.H + (p.gate_centered ? p.P : 0);
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
    if (at >= 2 * H) {
      // the gate's row r = at - 2H from q^T x (OutBackLaunch::gate_centered): x = xhat / rstd + mean,
      // so q^T x = dgp^T xhat + m 1^T with m = q^T mean, the row's mean (each row of xhat sums to 0);
      // dWg = (q^T x - m 1^T) diag(gamma_in) + sum(dgp) beta_in^T
      const int r = at - 2 * H;
      const int64_t row = static_cast<int64_t>(r) * P;
      float s = 0.f;
      for (int q = lane; q < P; q += 32) s += load_any(p.d_wg, p.d_wg_dtype, row + q);
      const float m = warp_sum(s) / static_cast<float>(P), sum_dgp = p.gate_sums[P + r];
      for (int q = lane; q < P; q += 32)
        p.grads[w_gate + row + q] = fmaf(__fsub_rn(load_any(p.d_wg, p.d_wg_dtype, row + q), m),
                                         p.packed[p.layout.ln_in_w + q],
                                         __fmul_rn(sum_dgp, p.packed[p.layout.ln_in_b + q]));
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
      v = at < H * P ? load_any(p.d_w_in, p.d_w_in_dtype, (4 * (at / P) + k) * P + at % P)
                     : p.d_b_in[4 * (at - H * P) + k];
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

cudaError_t launch_param_grads(const ParamGradsParams& p, cudaStream_t stream) {
  const int64_t blocks = reduce_blocks(p) + ceil_div(param_grads_size(p.P, p.H), kGradThreads);
  param_grads_kernel<<<static_cast<unsigned>(blocks), kGradThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace trimul
