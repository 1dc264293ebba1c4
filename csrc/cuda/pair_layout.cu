// pair_layout: the backward's copies between channel-first pair tensors
// ([B][H][S][S], the contraction's layout) and position-major rows
// ([B][N][N][H], the per-position stages' layout); see trimul.h.
//
// A block moves a 64 (h) x 64 (positions along the contiguous spatial index)
// tile of one (b, outer index) through shared memory, so both the pair side
// (contiguous along positions) and the row side (contiguous along h) are read
// and written in whole 64-element runs; each thread has 16 elements in flight.
// Elements are moved as raw bits, but for precision tf32 on the fp16 stages: c from the fp16
// pair (times 2^range_c_log2) to fp32 rows with its scale undone, for the backward, and the
// backward's dc from fp32 rows to an fp16 pair with its own scale (GradScale).
#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>

#include "common.cuh"
#include "range.cuh"

namespace trimul {
namespace {

constexpr int kTile = 64;
constexpr int kLanes = 32;                   // blockDim.x; a thread takes columns tx and tx + 32
constexpr int kRowsPerPass = 8;              // blockDim.y
constexpr int kColsPerThread = kTile / kLanes;
constexpr int kPasses = kTile / kRowsPerPass;

// f(r, c) for each of the thread's elements of a tile: rows r = y + 8 k, columns c = x + 32 q.
template <typename F>
__device__ __forceinline__ void for_each_element(F f) {
#pragma unroll
  for (int k = 0; k < kPasses; ++k)
#pragma unroll
    for (int q = 0; q < kColsPerThread; ++q) f(threadIdx.y + kRowsPerPass * k, threadIdx.x + kLanes * q);
}

// Grid: x = B * outer extent, y = tiles along the inner (contiguous) spatial
// index, z = tiles along h. The pair element (b, h, o, i) is rows element
// (b, o, i, h), or (b, i, o, h) with swap. The tile is tile[h][position] in
// shared memory; each side is read and written along its contiguous index. kHalfPair: the pair
// side in fp16, the rows fp32 (T = uint32_t, the tile holding fp32 values): to_rows, times
// 2^-range_c_log2; else times 2^grad_log2 (PairLayoutParams).
template <typename T, bool kHalfPair = false>
__global__ void __launch_bounds__(kLanes * kRowsPerPass) pair_layout_kernel(const PairLayoutParams p) {
  using Pair = std::conditional_t<kHalfPair, __half, T>;
  __shared__ T tile[kTile][kTile + 1];
  const int64_t outer = p.to_rows ? p.N : p.S;
  const int64_t b = blockIdx.x / outer, o = blockIdx.x % outer;
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile, h0 = static_cast<int64_t>(blockIdx.z) * kTile;
  Pair* pair = static_cast<Pair*>(p.pair) + b * p.stride_b + o * p.stride_s;
  int scale_log2 = 0;  // (kHalfPair: each value times 2^scale_log2 by ldexpf, exact where representable)
  if constexpr (kHalfPair) {
    if (p.to_rows) {
      scale_log2 = -range_c_log2(*p.range);
    } else {
      scale_log2 = range_grad_log2(*p.grad, *p.range);
      if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 && threadIdx.y == 0)
        p.grad->unscale = ldexpf(1.f, -(scale_log2 + range_ab_scale_log2(*p.range)));
    }
  }
  T* rows = static_cast<T*>(p.rows) + b * p.N * p.N * p.H;
  const int64_t row_o = p.swap ? p.H : p.N * p.H, row_i = p.swap ? p.N * p.H : p.H;  // rows strides of o, i
  rows += o * row_o;
  const int64_t n_pair = p.to_rows ? p.N : p.S;  // positions of the pair side this block covers
  const bool o_in = o < p.N;                   // from rows: pair positions past N are zeros
  // pair side: r = h, c = position (contiguous)
  auto pair_side = [=](int r, int c, T* t, bool read) {
    const int64_t h = h0 + r, i = i0 + c;
    if (h >= p.H || i >= n_pair) return;
    if constexpr (kHalfPair) {
      if (read)
        t[r * (kTile + 1) + c] = __float_as_uint(ldexpf(__half2float(pair[h * p.stride_h + i]), scale_log2));
      else
        pair[h * p.stride_h + i] = __float2half_rn(ldexpf(__uint_as_float(t[r * (kTile + 1) + c]), scale_log2));
    } else if (read)
      t[r * (kTile + 1) + c] = pair[h * p.stride_h + i];
    else
      pair[h * p.stride_h + i] = t[r * (kTile + 1) + c];
  };
  // rows side: r = position, c = h (contiguous)
  auto rows_side = [=](int r, int c, T* t, bool read) {
    const int64_t h = h0 + c, i = i0 + r;
    if (h >= p.H || i >= n_pair) return;
    if (read) t[c * (kTile + 1) + r] = o_in && i < p.N ? rows[i * row_i + h] : T(0);
    else if (i < p.N) rows[i * row_i + h] = t[c * (kTile + 1) + r];
  };
  T* t = &tile[0][0];
  if (p.to_rows) {
    for_each_element([=](int r, int c) { pair_side(r, c, t, true); });
    __syncthreads();
    for_each_element([=](int r, int c) { rows_side(r, c, t, false); });
  } else {
    for_each_element([=](int r, int c) { rows_side(r, c, t, true); });
    __syncthreads();
    for_each_element([=](int r, int c) { pair_side(r, c, t, false); });
  }
}

}  // namespace

cudaError_t launch_pair_layout(const PairLayoutParams& p, cudaStream_t stream) {
  const int64_t outer = p.to_rows ? p.N : p.S, inner = outer;
  const dim3 grid(static_cast<unsigned>(p.B * outer), static_cast<unsigned>(ceil_div(inner, kTile)),
                  static_cast<unsigned>(ceil_div(p.H, kTile)));
  const dim3 block(kLanes, kRowsPerPass);
  if (p.range != nullptr) {
    if (p.dtype != DType::f16 || (p.grad == nullptr) != p.to_rows) return cudaErrorInvalidValue;
    pair_layout_kernel<uint32_t, true><<<grid, block, 0, stream>>>(p);
  } else if (p.grad != nullptr) {
    return cudaErrorInvalidValue;
  } else if (p.dtype == DType::f32)
    pair_layout_kernel<uint32_t><<<grid, block, 0, stream>>>(p);
  else
    pair_layout_kernel<uint16_t><<<grid, block, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace trimul
