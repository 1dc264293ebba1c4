// pair_layout: the backward's copies between channel-first pair tensors
// ([B][H][S][S], the contraction's layout) and position-major rows
// ([B][N][N][H], the per-position stages' layout); see trimul.h.
//
// A block moves a 64 (h) x 64 (positions along the contiguous spatial index)
// tile of one (b, outer index) through shared memory, so both the pair side
// (contiguous along positions) and the row side (contiguous along h) are read
// and written in whole 64-element runs; each thread has 16 elements in flight.
// Elements are moved as raw bits.
#include <cstdint>

#include "common.cuh"

namespace trimul {
namespace {

constexpr int kTile = 64;
constexpr int kLanes = 32;                   // blockDim.x; a thread takes columns tx and tx + 32
constexpr int kRowsPerPass = 8;              // blockDim.y
constexpr int kColsPerThread = kTile / kLanes;
constexpr int kPasses = kTile / kRowsPerPass;

// Grid: x = B * outer extent, y = tiles along the inner (contiguous) spatial
// index, z = tiles along h. The pair element (b, h, o, i) is rows element
// (b, o, i, h), or (b, i, o, h) with swap.
template <typename T>
__global__ void __launch_bounds__(kLanes * kRowsPerPass) pair_layout_kernel(const PairLayoutParams p) {
  __shared__ T tile[kTile][kTile + 1];
  const int64_t outer = p.to_rows ? p.N : p.S;
  const int64_t b = blockIdx.x / outer, o = blockIdx.x % outer;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile, h0 = static_cast<int64_t>(blockIdx.z) * kTile;
  T* pair = static_cast<T*>(p.pair) + b * p.stride_b + o * p.stride_s;
  T* rows = static_cast<T*>(p.rows) + b * p.N * p.N * p.H;
  const int64_t row_o = p.swap ? p.H : p.N * p.H, row_i = p.swap ? p.N * p.H : p.H;  // rows strides of o, i
  rows += o * row_o;
  if (p.to_rows) {
#pragma unroll
    for (int k = 0; k < kPasses; ++k)
#pragma unroll
      for (int q = 0; q < kColsPerThread; ++q) {  // r: h within the tile, c: position
        const int r = threadIdx.y + kRowsPerPass * k, c = threadIdx.x + kLanes * q;
        const int64_t h = h0 + r, i = i0 + c;
        if (h < p.H && i < p.N) tile[r][c] = pair[h * p.stride_h + i];
      }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kPasses; ++k)
#pragma unroll
      for (int q = 0; q < kColsPerThread; ++q) {  // r: position within the tile, c: h
        const int r = threadIdx.y + kRowsPerPass * k, c = threadIdx.x + kLanes * q;
        const int64_t h = h0 + c, i = i0 + r;
        if (h < p.H && i < p.N) rows[i * row_i + h] = tile[c][r];
      }
  } else {
    const bool o_in = o < p.N;
#pragma unroll
    for (int k = 0; k < kPasses; ++k)
#pragma unroll
      for (int q = 0; q < kColsPerThread; ++q) {  // r: position, c: h
        const int r = threadIdx.y + kRowsPerPass * k, c = threadIdx.x + kLanes * q;
        const int64_t h = h0 + c, i = i0 + r;
        if (h < p.H && i < p.S) tile[c][r] = o_in && i < p.N ? rows[i * row_i + h] : T(0);
      }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kPasses; ++k)
#pragma unroll
      for (int q = 0; q < kColsPerThread; ++q) {  // r: h, c: position
        const int r = threadIdx.y + kRowsPerPass * k, c = threadIdx.x + kLanes * q;
        const int64_t h = h0 + r, i = i0 + c;
        if (h < p.H && i < p.S) pair[h * p.stride_h + i] = tile[r][c];
      }
  }
}

}  // namespace

cudaError_t launch_pair_layout(const PairLayoutParams& p, cudaStream_t stream) {
  const int64_t outer = p.to_rows ? p.N : p.S, inner = outer;
  const dim3 grid(static_cast<unsigned>(p.B * outer), static_cast<unsigned>(ceil_div(inner, kTile)),
                  static_cast<unsigned>(ceil_div(p.H, kTile)));
  const dim3 block(kLanes, kRowsPerPass);
  if (p.dtype == DType::f32)
    pair_layout_kernel<uint32_t><<<grid, block, 0, stream>>>(p);
  else
    pair_layout_kernel<uint16_t><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace trimul
