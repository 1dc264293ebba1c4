// ln_out_proj_gate: the output half of the update.
//
//   y   = LayerNorm(c[b, i, j, :]) . Wo^T + bo          (c read channel-first, fp32 or 16-bit)
//   g   = u . Wg^T + bg,  u = x[b, i, j, :] or LayerNorm(x[b, i, j, :])
//   out = y * sigmoid(g)
//
// Grid: x over (i, 64-wide tiles of j), y over (b, 64-wide tiles of p). Each
// thread owns one position j and 16 output channels; the two products share
// the tile machinery of common.cuh and run one after the other.
#include "common.cuh"
#include "range.cuh"

namespace trimul {

template <typename Tx, typename Tc>
__global__ void __launch_bounds__(kThreads) ln_out_proj_gate_kernel(const LnOutProjGateParams p, int64_t z0) {
  __shared__ TileSmem s;
  const int row = threadIdx.x % kTileRows, group = threadIdx.x / kTileRows;
  const int64_t j_tiles = ceil_div(p.N, kTileRows);
  const int64_t i = blockIdx.x / j_tiles;
  const int64_t j0 = (blockIdx.x % j_tiles) * kTileRows;
  const int64_t p_tiles = ceil_div(p.P, kTileCols);
  const int64_t z = z0 + blockIdx.y;
  const int64_t b = z / p_tiles;
  const int64_t p0 = (z % p_tiles) * kTileCols;
  const float* prm = p.params;
  const int64_t plane = p.Npad * p.Npad;
  const Tc* c = static_cast<const Tc*>(p.c) + b * p.H * plane + i * p.Npad + j0;  // + h * plane + row
  auto valid = [&](int rr) { return j0 + rr < p.N; };

  // LayerNorm statistics of c over h: four partial sums per position.
  {
    float sum = 0.f;
    if (valid(row))
      for (int64_t h = group; h < p.H; h += kColGroups) sum += to_float(c[h * plane + row]);
    s.part[group][row] = sum;
    __syncthreads();
    const float mean = (s.part[0][row] + s.part[1][row] + s.part[2][row] + s.part[3][row]) / static_cast<float>(p.H);
    __syncthreads();
    float sq = 0.f;
    if (valid(row))
      for (int64_t h = group; h < p.H; h += kColGroups) {
        const float d = to_float(c[h * plane + row]) - mean;
        sq += d * d;
      }
    s.part[group][row] = sq;
    __syncthreads();
    if (group == 0) {
      const float var = (s.part[0][row] + s.part[1][row] + s.part[2][row] + s.part[3][row]) / static_cast<float>(p.H);
      s.mean[row] = mean;
      s.rstd[row] = valid(row) ? rsqrtf(var + headroom_c_eps(p.eps, p.headroom)) : 0.f;
    }
  }

  float y[kColsPerThread] = {};
  for (int64_t k0 = 0; k0 < p.H; k0 += kChunk) {
    __syncthreads();
    for (int e = threadIdx.x; e < kChunk * kTileRows; e += kThreads) {
      const int k = e / kTileRows, rr = e % kTileRows;
      const int64_t h = k0 + k;
      float v = 0.f;
      if (valid(rr) && h < p.H)
        v = (to_float(c[h * plane + rr]) - s.mean[rr]) * s.rstd[rr] * prm[p.layout.ln_out_w + h] +
            prm[p.layout.ln_out_b + h];
      s.xs[k][rr] = v;
    }
    load_weight_chunk(s, prm + p.layout.w_out, p.H, p0, p.P - p0, k0, p.H);
    __syncthreads();
    multiply_chunk(s, row, group, y);
  }

  const Tx* x = static_cast<const Tx*>(p.x);
  auto row_ptr = [&](int rr) { return x + b * p.x_stride_b + i * p.x_stride_i + (j0 + rr) * p.x_stride_j; };
  __syncthreads();  // the c statistics are consumed
  if (p.gate_from_normalized) row_stats<Tx>(s, row_ptr, valid, p.P, p.eps);

  float g[kColsPerThread] = {};
  for (int64_t k0 = 0; k0 < p.P; k0 += kChunk) {
    __syncthreads();
    for (int e = threadIdx.x; e < kChunk * kTileRows; e += kThreads) {
      const int rr = e / kChunk, k = e % kChunk;
      float v = 0.f;
      if (valid(rr) && k0 + k < p.P) {
        v = to_float(row_ptr(rr)[k0 + k]);
        if (p.gate_from_normalized)
          v = (v - s.mean[rr]) * s.rstd[rr] * prm[p.layout.ln_in_w + k0 + k] + prm[p.layout.ln_in_b + k0 + k];
      }
      s.xs[k][rr] = v;
    }
    load_weight_chunk(s, prm + p.layout.w_gate, p.P, p0, p.P - p0, k0, p.P);
    __syncthreads();
    multiply_chunk(s, row, group, g);
  }

  if (!valid(row)) return;
  Tx* out = static_cast<Tx*>(p.out) + ((b * p.N + i) * p.N + j0 + row) * p.P;
#pragma unroll
  for (int q = 0; q < kColsPerThread; ++q) {
    const int64_t ch = p0 + group * kColsPerThread + q;
    if (ch >= p.P) break;
    const float v = (y[q] + prm[p.layout.b_out + ch]) * sigmoidf(g[q] + prm[p.layout.b_gate + ch]);
    out[ch] = from_float<Tx>(v);
  }
}

template <typename Tx, typename Tc>
static cudaError_t launch_typed(const LnOutProjGateParams& p, cudaStream_t stream) {
  return launch_grid_rows(ln_out_proj_gate_kernel<Tx, Tc>, ceil_div(p.N, kTileRows) * p.N,
                          p.B * ceil_div(p.P, kTileCols), kThreads, 0, p, stream);
}

template <typename Tx>
static cudaError_t launch_for_x(const LnOutProjGateParams& p, cudaStream_t stream) {
  switch (p.c_dtype) {
    case DType::bf16: return launch_typed<Tx, __nv_bfloat16>(p, stream);
    case DType::f16: return launch_typed<Tx, __half>(p, stream);
    default: return launch_typed<Tx, float>(p, stream);
  }
}

cudaError_t launch_ln_out_proj_gate(const LnOutProjGateParams& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_for_x<__nv_bfloat16>(p, stream);
    case DType::f16: return launch_for_x<__half>(p, stream);
    default: return launch_for_x<float>(p, stream);
  }
}

}  // namespace trimul
