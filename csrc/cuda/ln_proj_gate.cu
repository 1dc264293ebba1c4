// ln_proj_gate: the input half of the update, up to the contraction operands.
//
//   xn = LayerNorm(x[b, r, c, :])                         (over P, fp32 statistics)
//   a  = (xn.Wpa^T + bpa) * sigmoid(xn.Wga^T + bga) * m    b likewise
//   a_out[b*H + h][r][c] = a[h]                            (channel-first, k = c contiguous)
//
// Grid: x over (r, 64-wide tiles of c), y over (b, groups of 16 hidden units).
// A tile is 64 positions x 64 columns, the columns being 16 hidden units x {proj_a, gate_a, proj_b, gate_b} (PackedLayout interleaves w_in that way),
// so each thread's 16 accumulators are four complete (a, b) pairs. Positions in
// the padding (r or c >= N) are written as zeros: the contraction sums over them.
#include "common.cuh"

namespace trimul {

constexpr int kHiddenPerTile = kTileCols / 4;

template <typename Tx, typename Tab>
__global__ void __launch_bounds__(kThreads) ln_proj_gate_kernel(const LnProjGateParams p, int64_t z0) {
  __shared__ TileSmem s;
  const int row = threadIdx.x % kTileRows, group = threadIdx.x / kTileRows;
  const int64_t c_tiles = ceil_div(p.Npad, kTileRows);
  const int64_t c0 = (blockIdx.x % c_tiles) * kTileRows;
  const int64_t r = blockIdx.x / c_tiles;
  const int64_t hidden_tiles = ceil_div(p.H, kHiddenPerTile);
  const int64_t z = z0 + blockIdx.y;
  const int64_t b = z / hidden_tiles;
  const int64_t h0 = (z % hidden_tiles) * kHiddenPerTile;
  const Tx* x = static_cast<const Tx*>(p.x);
  const float* prm = p.params;

  auto valid = [&](int rr) { return r < p.N && c0 + rr < p.N; };
  auto row_ptr = [&](int rr) { return x + b * p.x_stride_b + r * p.x_stride_r + (c0 + rr) * p.x_stride_c; };
  row_stats<Tx>(s, row_ptr, valid, p.P, p.eps);

  float acc[kColsPerThread] = {};
  const int64_t w_rows = 4 * (p.H - h0);  // weight rows left from this tile's first
  for (int64_t k0 = 0; k0 < p.P; k0 += kChunk) {
    __syncthreads();  // statistics ready / previous chunk consumed
    for (int e = threadIdx.x; e < kChunk * kTileRows; e += kThreads) {
      const int rr = e / kChunk, k = e % kChunk;
      float v = 0.f;
      if (valid(rr) && k0 + k < p.P) {
        const float xv = to_float(row_ptr(rr)[k0 + k]);
        v = (xv - s.mean[rr]) * s.rstd[rr] * prm[p.layout.ln_in_w + k0 + k] + prm[p.layout.ln_in_b + k0 + k];
      }
      s.xs[k][rr] = v;
    }
    load_weight_chunk(s, prm + p.layout.w_in, p.P, 4 * h0, w_rows, k0, p.P);
    __syncthreads();
    multiply_chunk(s, row, group, acc);
  }

  const int64_t c = c0 + row;
  if (c >= p.Npad) return;
  const bool inside = valid(row);
  float m = 1.f;
  if (inside && p.mask) m = load_any(p.mask, p.mask_dtype, b * p.mask_stride_b + r * p.mask_stride_r + c * p.mask_stride_c);
  Tab* a_out = static_cast<Tab*>(p.a);
  Tab* b_out = static_cast<Tab*>(p.b);
  const float* bias = prm + p.layout.b_in;
#pragma unroll
  for (int u = 0; u < kColsPerThread / 4; ++u) {
    const int64_t h = h0 + group * (kColsPerThread / 4) + u;
    if (h >= p.H) break;
    float av = 0.f, bv = 0.f;
    if (inside) {
      av = (acc[4 * u + 0] + bias[4 * h + 0]) * sigmoidf(acc[4 * u + 1] + bias[4 * h + 1]) * m;
      bv = (acc[4 * u + 2] + bias[4 * h + 2]) * sigmoidf(acc[4 * u + 3] + bias[4 * h + 3]) * m;
    }
    const int64_t o = ((b * p.H + h) * p.Npad + r) * p.Npad + c;
    a_out[o] = from_float<Tab>(av);
    b_out[o] = from_float<Tab>(bv);
  }
}

template <typename Tx, typename Tab>
static cudaError_t launch_typed(const LnProjGateParams& p, cudaStream_t stream) {
  return launch_grid_rows(ln_proj_gate_kernel<Tx, Tab>, ceil_div(p.Npad, kTileRows) * p.Npad,
                          p.B * ceil_div(p.H, kHiddenPerTile), kThreads, 0, p, stream);
}

template <typename Tx>
static cudaError_t launch_for_x(const LnProjGateParams& p, cudaStream_t stream) {
  switch (p.ab_dtype) {
    case DType::bf16: return launch_typed<Tx, __nv_bfloat16>(p, stream);
    case DType::f16: return launch_typed<Tx, __half>(p, stream);
    default: return launch_typed<Tx, float>(p, stream);
  }
}

cudaError_t launch_ln_proj_gate(const LnProjGateParams& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_for_x<__nv_bfloat16>(p, stream);
    case DType::f16: return launch_for_x<__half>(p, stream);
    default: return launch_for_x<float>(p, stream);
  }
}

}  // namespace trimul
