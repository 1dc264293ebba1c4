// Device helpers every kernel file shares (conversions between the storage types
// and fp32, pairs of values, load_any, warp sums), and the tiling of the fp32
// CUDA-core kernels (ln_proj_gate, ln_out_proj_gate):
//
// Both kernels compute a 64-row x 64-column tile of  rows . W^T  with 256
// threads: thread t owns row (t % 64) and the 16 consecutive columns
// 16 * (t / 64) ... + 15. Operand chunks of kChunk along the reduction dimension
// are staged in shared memory, rows transposed (xs[k][row]) so a warp reads 32
// consecutive rows, weights as ws[k][col] read as broadcast float4.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "../trimul.h"

namespace trimul {

constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kChunk = 32;
constexpr int kThreads = 256;
constexpr int kColsPerThread = 16;
constexpr int kColGroups = kThreads / kTileRows;  // 4
static_assert(kColGroups * kColsPerThread == kTileCols, "tile columns");
constexpr int kRowPad = 1;  // xs rows: conflict-free transposed stores
constexpr int kColPad = 4;  // ws rows: keeps float4 alignment
constexpr int64_t kMaxGridY = 65535;

// Division of n < 2^31 by a divisor 1 <= d <= 2^31 fixed for a kernel, as a high multiply, an add
// and a shift: with L = ceil(log2 d) and M = ceil(2^(32 + L) / d) in [2^32, 2^33), m = M - 2^32 and
// q = (umulhi(n, m) + n) >> L (= n M >> (32 + L), which exceeds n / d by less than
// n (d - 1) / (d 2^(32 + L)) < 1 / d and so never reaches the next integer; d = 1 gives m = 0).
// The hardware's division is a ~20-instruction sequence per use that ptxas does not hoist out of
// a tile loop. Built on the host and passed with a launch's arguments, its constants come from the
// parameter space; the constructor is 32-bit arithmetic throughout.
struct FastDiv {
  uint32_t d, m, shift;
  __host__ __device__ explicit FastDiv(uint32_t divisor) : d(divisor), m(0), shift(0) {
    while (shift < 31 && (uint32_t{1} << shift) < d) ++shift;
    // m = ceil((2^L - d) 2^32 / d) by long division: 2^L - d < d <= 2^31, so the remainder's double fits
    uint32_t rem = (uint32_t{1} << shift) - d, q = 0;
    for (int bit = 0; bit < 32; ++bit) {
      rem <<= 1, q <<= 1;
      if (rem >= d) rem -= d, q |= 1;
    }
    m = q + (rem != 0);
  }
  __host__ __device__ __forceinline__ uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    return (__umulhi(n, m) + n) >> shift;
#else
    return static_cast<uint32_t>(((static_cast<uint64_t>(n) * m >> 32) + n) >> shift);
#endif
  }
};

// Tiles of `kPositions` positions along the lines of a (B, N, N) grid of positions: tile = line
// j_tiles + j / kPositions, line = b N + i. The output side's resident stages walk their tiles in
// this order; the host builds the divisors (j_tiles = ceil(N / kPositions), N) with the launch.
template <int kPositions>
struct LineTiles {
  FastDiv by_j_tiles, by_n;
  explicit LineTiles(int64_t N)
      : by_j_tiles(static_cast<uint32_t>(ceil_div(N, kPositions))), by_n(static_cast<uint32_t>(N)) {}
  struct At {
    uint32_t line, j0;  // line within the tiles walked, first position along it
  };
  __device__ __forceinline__ uint32_t j_tiles() const { return by_j_tiles.d; }
  __device__ __forceinline__ uint32_t n() const { return by_n.d; }
  __device__ __forceinline__ At at(uint32_t tile) const {
    const uint32_t line = by_j_tiles.div(tile);
    return At{line, (tile - line * by_j_tiles.d) * kPositions};
  }
  struct Position {
    uint32_t b, i;
  };
  __device__ __forceinline__ Position position(uint32_t line) const {
    const uint32_t b = by_n.div(line);
    return Position{b, line - b * by_n.d};
  }
};

// A resident output-side stage's launch arguments: the stage's, and its tiles' divisors (whose
// constants then come from the parameter space).
template <typename Params, int kPositions>
struct LineLaunch {
  Params p;
  LineTiles<kPositions> tiles;
  explicit LineLaunch(const Params& q) : p(q), tiles(q.N) {}
};

struct TileSmem {
  alignas(16) float xs[kChunk][kTileRows + kRowPad];
  alignas(16) float ws[kChunk][kTileCols + kColPad];
  float mean[kTileRows];
  float rstd[kTileRows];
  float part[kColGroups][kTileRows];  // partial sums of the channel-first statistics
};

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(double v) { return static_cast<float>(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Pairs of values.
template <typename T>
struct Vec2;
template <>
struct Vec2<float> {
  using type = float2;
  static __device__ __forceinline__ float2 unpack(type v) { return v; }
  static __device__ __forceinline__ type pack(float a, float b) { return make_float2(a, b); }
};
template <>
struct Vec2<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 unpack(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type pack(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Vec2<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 unpack(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type pack(float a, float b) { return __floats2half2_rn(a, b); }
};

// Two adjacent elements (p 4- or 8-byte aligned), as floats.
template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  *reinterpret_cast<typename Vec2<T>::type*>(p) = Vec2<T>::pack(a, b);
}
template <typename T>
__device__ __forceinline__ float2 load2(const T* p) {
  return Vec2<T>::unpack(*reinterpret_cast<const typename Vec2<T>::type*>(p));
}

// The DType code of a floating element type.
template <typename T>
constexpr DType dtype_code() {
  return std::is_same<T, __nv_bfloat16>::value ? DType::bf16 : std::is_same<T, __half>::value ? DType::f16 : DType::f32;
}

// Reads element `i` of a tensor of any of the supported dtypes as float.
__device__ __forceinline__ float load_any(const void* ptr, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(ptr)[i];
    case DType::f64: return static_cast<float>(static_cast<const double*>(ptr)[i]);
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(ptr)[i]);
    case DType::b8:
    case DType::u8: return static_cast<float>(static_cast<const uint8_t*>(ptr)[i]);
    case DType::i8: return static_cast<float>(static_cast<const int8_t*>(ptr)[i]);
    case DType::i16: return static_cast<float>(static_cast<const int16_t*>(ptr)[i]);
    case DType::i32: return static_cast<float>(static_cast<const int32_t*>(ptr)[i]);
    case DType::i64: return static_cast<float>(static_cast<const int64_t*>(ptr)[i]);
  }
  return 0.f;
}

// An element of a tensor in one of the three storage types of the kernels' operands and rows (bf16,
// fp16, else fp32) as fp32: where a kernel reads no other, load_any's switch over every DType costs
// code and, in the backward's row kernels, a stack frame.
__device__ __forceinline__ float load_storage(const void* ptr, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(ptr)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(ptr)[i]);
    default: return static_cast<const float*>(ptr)[i];
  }
}

// A parameter's element as fp32: the four floating types parameters come in (add_entry admits no
// other). The pack inlines it at a dozen sites, and its short-lived warps wait on the instruction
// fetch (a fifth of their samples at N = 256, ncu): load_any's switch over every DType there made
// its code 15 % longer (benchmarks/NOTES.md, "Power": "The pack's code made smaller instead").
__device__ __forceinline__ float load_param(const void* ptr, DType dtype, int64_t i) {
  return dtype == DType::f64 ? static_cast<float>(static_cast<const double*>(ptr)[i]) : load_storage(ptr, dtype, i);
}

// Element (r, c) of a pack entry's source as fp32, or its fill where the parameter is missing:
// the value pack_params stores for it.
__device__ __forceinline__ float entry_value(const PackEntry& d, int r, int c) {
  return d.ptr ? load_param(d.ptr, d.dtype, r * d.stride_r + c * d.stride_c) : d.fill;
}

// 2^v by the hardware's approximation (MUFU.EX2, as __expf uses it) with results below 2^-126
// flushed to zero: __expf's form without the flush spends three more instructions a call on those
// (a range test and two scalings), and every use here adds the result to 1 or scales a gate's
// gradient by it, where such a value is zero to fp32 anyway.
__device__ __forceinline__ float exp2_ftz(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
constexpr float kLog2e = 1.44269504088896341f;
// e^(scale v), the bits of __expf(scale * v) wherever those are normal (scale plus or minus a power
// of two: v scale log2 e is then rounded once either way, and a constant scale folds into log2 e)
__device__ __forceinline__ float exp_ftz(float v, float scale = 1.f) { return exp2_ftz(v * (scale * kLog2e)); }

__device__ __forceinline__ float sigmoidf(float v) { return __fdividef(1.f, 1.f + exp_ftz(v, -1.f)); }

// sigmoid(v) and 1 - sigmoid(v), each to a few ulp wherever the gate saturates: e = exp(-|v|) lies
// in (0, 1] (no overflow), sigmoid(|v|) = 1 / (1 + e) and sigmoid(-|v|) = e / (1 + e). 1 - s formed
// from a rounded s loses all of itself past |v| = 17 in fp32 (1e-4 relative at 8), and the
// backward's gate gradients are proportional to it (two MUFU operations, as the division form).
struct SigmoidPair {
  float s, one_minus_s;
};
__device__ __forceinline__ SigmoidPair sigmoid_pair(float v) {
  const float e = exp_ftz(-fabsf(v));
  const float big = __fdividef(1.f, 1.f + e), small = e * big;
  return v >= 0.f ? SigmoidPair{big, small} : SigmoidPair{small, big};
}

// The same from 1 - s = sigmoid(-v) alone, s as its complement: 1 - s to a few ulp at any v, s to
// ~1e-7 absolute (not relative where the gate is closed, v << 0), with fewer registers live. v is
// given as scale u (scale a power of two: it folds into exp_ftz's multiplication by log2 e).
__device__ __forceinline__ SigmoidPair sigmoid_pair_from_complement(float u, float scale = 1.f) {
  const float one_minus_s = __fdividef(1.f, 1.f + exp_ftz(u, scale));
  return SigmoidPair{1.f - one_minus_s, one_minus_s};
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// LayerNorm statistics of the tile's rows, each a contiguous vector of `len`
// elements at row_ptr(r); rows with valid(r) false get mean 0, rstd 0. One warp
// per row at a time; two passes (mean, then centred squares) for accuracy.
template <typename T, typename RowPtr, typename Valid>
__device__ void row_stats(TileSmem& s, RowPtr row_ptr, Valid valid, int64_t len, float eps) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kTileRows; r += kThreads / 32) {
    float mean = 0.f, rstd = 0.f;
    if (valid(r)) {
      const T* p = row_ptr(r);
      float sum = 0.f;
      for (int64_t k = lane; k < len; k += 32) sum += to_float(p[k]);
      mean = warp_sum(sum) / static_cast<float>(len);
      float sq = 0.f;
      for (int64_t k = lane; k < len; k += 32) {
        const float d = to_float(p[k]) - mean;
        sq += d * d;
      }
      rstd = rsqrtf(warp_sum(sq) / static_cast<float>(len) + eps);
    }
    if (lane == 0) {
      s.mean[r] = mean;
      s.rstd[r] = rstd;
    }
  }
}

// Stages ws[k][col] = w[(col0 + col) * ld + k0 + k] for col < cols_valid and
// k0 + k < k_len, zero elsewhere.
__device__ __forceinline__ void load_weight_chunk(TileSmem& s, const float* w, int64_t ld, int64_t col0,
                                                  int64_t cols_valid, int64_t k0, int64_t k_len) {
  for (int e = threadIdx.x; e < kChunk * kTileCols; e += kThreads) {
    const int col = e / kChunk, k = e % kChunk;
    float v = 0.f;
    if (col < cols_valid && k0 + k < k_len) v = w[(col0 + col) * ld + k0 + k];
    s.ws[k][col] = v;
  }
}

// acc[c] += sum_k xs[k][row] * ws[k][group * 16 + c] (ws rows 16-byte aligned: read as broadcast float4)
__device__ __forceinline__ void multiply_chunk(const TileSmem& s, int row, int group, float (&acc)[kColsPerThread]) {
  const float* xs = &s.xs[0][0];
  const float* ws = &s.ws[0][0];
#pragma unroll 8
  for (int k = 0; k < kChunk; ++k) {
    const float xv = xs[k * (kTileRows + kRowPad) + row];
    const float4* w = reinterpret_cast<const float4*>(ws + k * (kTileCols + kColPad) + group * kColsPerThread);
#pragma unroll
    for (int q = 0; q < kColsPerThread / 4; ++q) {
      const float4 wq = w[q];
      acc[4 * q + 0] = fmaf(xv, wq.x, acc[4 * q + 0]);
      acc[4 * q + 1] = fmaf(xv, wq.y, acc[4 * q + 1]);
      acc[4 * q + 2] = fmaf(xv, wq.z, acc[4 * q + 2]);
      acc[4 * q + 3] = fmaf(xv, wq.w, acc[4 * q + 3]);
    }
  }
}

// Lets `kernel` launch with `smem` bytes of dynamic shared memory on the current device:
// cudaFuncSetAttribute once per kernel, device and larger size (each call costs ~1.5 us of
// host time, as much as a small problem's kernel).
inline cudaError_t allow_dynamic_smem(const void* kernel, size_t smem) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return e;
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const std::lock_guard<std::mutex> hold(lock);
  size_t& set = allowed[{kernel, device}];
  if (set >= smem) return cudaSuccess;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e == cudaSuccess) set = smem;
  return e;
}

// Blocks of `kernel` (`threads` each, `smem` bytes of dynamic shared memory, which it allows
// first) that fit on one SM of the current device; 0 where none does or a query fails. Cached
// per kernel, device, block size and shared memory (the occupancy query costs host time).
inline int blocks_per_sm(const void* kernel, int threads, size_t smem) {
  int device = 0;
  if (allow_dynamic_smem(kernel, smem) != cudaSuccess || cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, int, size_t>, int> known;
  const std::lock_guard<std::mutex> hold(lock);
  const auto key = std::make_tuple(kernel, device, threads, smem);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  known[key] = blocks;
  return blocks;
}

// Launches kernel(p, y0) on a (grid_x, rows) grid, rows in slices of at most
// kMaxGridY (y0: a slice's first row), with `smem` bytes of dynamic shared memory.
template <typename Params>
cudaError_t launch_grid_rows(void (*kernel)(Params, int64_t), int64_t grid_x, int64_t rows, int threads,
                             size_t smem, const Params& p, cudaStream_t stream) {
  if (smem > 0) {
    const cudaError_t e = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    if (e != cudaSuccess) return e;
  }
  for (int64_t y0 = 0; y0 < rows; y0 += kMaxGridY) {
    const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(std::min<int64_t>(rows - y0, kMaxGridY)));
    kernel<<<grid, threads, smem, stream>>>(p, y0);
  }
  return cudaGetLastError();
}

}  // namespace trimul
