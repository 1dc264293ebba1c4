// Warp-level tensor-core helpers (mma.sync m16n8k16, 16-bit operands, fp32
// accumulators; cp.async and ldmatrix; sm_80 and newer) for the input and
// output stages.
//
// Operand tiles live in shared memory, B as [col][k], A as [row][k] or k-major,
// with row strides of (a multiple of 16) + kSmemPad elements, which keeps the
// ldmatrix row addresses of a matrix in distinct banks. Fragment layout of
// m16n8k16 (g = lane / 4, t = lane % 4):
//   A: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B: b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C: c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "common.cuh"

namespace trimul {

constexpr int kMmaK = 16;
constexpr int kSmemPad = 8;  // elements (16 bytes) of padding per shared-memory row

__host__ __device__ constexpr int64_t round_up16(int64_t v) { return (v + kMmaK - 1) / kMmaK * kMmaK; }

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// acc[mt][nt] += A[row0 + 16 mt .. +15][0 .. kp) . B[nt*8 .. +7][0 .. kp)^T for
// mt < MT, nt < NT (NT even): a warp's (16 MT) x (8 NT) tile. B is [n][k]. A is
// [row][k] (kAKMajor false) or k-major, a[k * lda + row] (kAKMajor true,
// fragments through ldmatrix.trans). For A, matrix m = lane / 8 covers rows
// + 8 (m % 2), k + 8 (m / 2): a0..a3 of the fragment. For a pair of B tiles,
// matrix m covers n + 8 (m / 2), k + 8 (m % 2): b0 b1 of each. Per k step a
// warp loads MT + NT / 2 fragments for MT * NT products.
template <typename T, int MT, int NT, bool kAKMajor>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const T* a, int lda, const T* b, int ldb, int row0,
                                         int kp) {
  static_assert(NT % 2 == 0, "B tiles go in pairs");
  const int lane = threadIdx.x % 32, m = lane / 8, r8 = lane % 8;
  const T* a_lane = kAKMajor ? a + ((m / 2) * 8 + r8) * lda + row0 + (m % 2) * 8
                             : a + (row0 + (m % 2) * 8 + r8) * lda + (m / 2) * 8;
  const T* b_lane = b + ((m / 2) * 8 + r8) * ldb + (m % 2) * 8;
  for (int k = 0; k < kp; k += kMmaK) {
    uint32_t af[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (kAKMajor)
        ldsm_x4_trans(af[mt], a_lane + k * lda + mt * 16);
      else
        ldsm_x4(af[mt], a_lane + mt * 16 * lda + k);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4];
      ldsm_x4(bf, b_lane + nt * 8 * ldb + k);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(acc[mt][nt], af[mt], bf[0], bf[1]);
        mma_16816<T>(acc[mt][nt + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// sigmoid(v) = (1 + tanh(v / 2)) / 2 with the hardware tanh (one MUFU
// operation instead of an exponential and a reciprocal; relative error of tanh
// about 2^-11, no more than the 16-bit outputs' rounding), for the 16-bit stages.
__device__ __forceinline__ float sigmoid_tanh(float v) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * v));
  return fmaf(0.5f, t, 0.5f);
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
// 4 bytes through L1 (.ca: cp.async's only form below 16 bytes)
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Block-wide copy of `rows` rows of `cols` elements into dst[row * ld + k],
// columns [cols, cols_padded) zeroed. src(row) gives the row's first element,
// or nullptr for a row of zeros. With `vec` (cols * sizeof(T) and every row
// start 16-byte aligned, ld * sizeof(T) too) the copy is cp.async, 16 bytes per
// instruction, left in flight: call cp_async_wait_all() and sync before reading.
template <typename T, typename Src>
__device__ __forceinline__ void copy_rows(T* dst, int ld, int rows, int cols, int cols_padded, Src src, bool vec) {
  if (vec) {
    constexpr int V = 16 / sizeof(T);
    const int per_row = cols / V;
    auto copy16 = [&](int r, int q) {
      const T* s = src(r);
      if (s)
        cp_async16(dst + r * ld + q * V, s + q * V);
      else
        *reinterpret_cast<uint4*>(dst + r * ld + q * V) = make_uint4(0, 0, 0, 0);
    };
    if (per_row <= static_cast<int>(blockDim.x)) {  // a thread keeps one column q, steps over rows
      const int q = threadIdx.x % per_row, step = blockDim.x / per_row;
      if (static_cast<int>(threadIdx.x) < step * per_row)
        for (int r = threadIdx.x / per_row; r < rows; r += step) copy16(r, q);
    } else {
      for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) copy16(e / per_row, e % per_row);
    }
  } else {
    for (int e = threadIdx.x; e < rows * cols; e += blockDim.x) {
      const int r = e / cols, k = e % cols;
      const T* s = src(r);
      dst[r * ld + k] = s ? s[k] : from_float<T>(0.f);
    }
  }
  const int pad = cols_padded - cols;
  if (pad > 0)
    for (int e = threadIdx.x; e < rows * pad; e += blockDim.x) dst[(e / pad) * ld + cols + e % pad] = from_float<T>(0.f);
}

// ---- LayerNorm of the rows of a shared-memory tile ----------------------------

__device__ __forceinline__ void load8(const float* p, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
// Pairs of 16-bit values.
template <typename T>
struct Vec2;
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

template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  const uint4 u = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const typename Vec2<T>::type*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Vec2<T>::unpack(h[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
}
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  uint4 u;
  auto* h = reinterpret_cast<typename Vec2<T>::type*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = Vec2<T>::pack(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Two adjacent output elements (p 4- or 8-byte aligned).
__device__ __forceinline__ void store2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  *reinterpret_cast<typename Vec2<T>::type*>(p) = Vec2<T>::pack(a, b);
}

constexpr int kLnLanesPerRow = 8;  // vectorized path: 4 rows per warp at a time
constexpr int kLnMaxChunks = 4;    // 8-element chunks per lane: rows up to 256 elements

// One warp, rows [row0, row0 + rows) (rows a multiple of 4) of a tile:
//   dst[r][k] = normalize ? (src[r][k] - mean_r) * rstd_r * w[k] + bias[k] : src[r][k]   (k < len)
//   dst[r][k] = 0 for k in [len, len_padded), and whole rows with !valid(r) = 0.
// LayerNorm statistics in fp32, two passes over registers. src may be dst (each
// lane rewrites only what it read). 16-byte vectors when len % 8 == 0 and
// len <= 256 (rows 16-byte aligned), else element by element.
template <typename Ts, typename Td, typename Valid>
__device__ __forceinline__ void warp_layer_norm_rows(const Ts* src, int lds, Td* dst, int ldd, int row0, int rows,
                                                     int len, int len_padded, const float* w, const float* bias,
                                                     float eps, bool normalize, Valid valid) {
  const int lane = threadIdx.x % 32;
  if (len % 8 == 0 && len <= kLnLanesPerRow * 8 * kLnMaxChunks) {
    const int chunks = len / 8, q0 = lane % kLnLanesPerRow;
    for (int r = row0 + lane / kLnLanesPerRow; r < row0 + rows; r += 32 / kLnLanesPerRow) {
      float v[kLnMaxChunks][8];
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kLnMaxChunks; ++j) {
        const int q = q0 + j * kLnLanesPerRow;
        if (q < chunks) {
          load8(src + r * lds + q * 8, v[j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum += v[j][e];
        }
      }
#pragma unroll
      for (int o = kLnLanesPerRow / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float mean = sum / static_cast<float>(len);
      float sq = 0.f;
#pragma unroll
      for (int j = 0; j < kLnMaxChunks; ++j)
        if (q0 + j * kLnLanesPerRow < chunks)
#pragma unroll
          for (int e = 0; e < 8; ++e) sq += (v[j][e] - mean) * (v[j][e] - mean);
#pragma unroll
      for (int o = kLnLanesPerRow / 2; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      const float rs = rsqrtf(sq / static_cast<float>(len) + eps);
      const bool ok = valid(r);
#pragma unroll
      for (int j = 0; j < kLnMaxChunks; ++j) {
        const int q = q0 + j * kLnLanesPerRow;
        if (q >= chunks) continue;
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int k = q * 8 + e;
          o[e] = !ok ? 0.f : normalize ? (v[j][e] - mean) * rs * w[k] + bias[k] : v[j][e];
        }
        store8(dst + r * ldd + q * 8, o);
      }
    }
  } else {
    for (int r = row0; r < row0 + rows; ++r) {
      const Ts* s = src + r * lds;
      float mean = 0.f, rs = 1.f;
      if (normalize) {
        float sum = 0.f;
        for (int k = lane; k < len; k += 32) sum += to_float(s[k]);
        mean = warp_sum(sum) / static_cast<float>(len);
        float sq = 0.f;
        for (int k = lane; k < len; k += 32) sq += (to_float(s[k]) - mean) * (to_float(s[k]) - mean);
        rs = rsqrtf(warp_sum(sq) / static_cast<float>(len) + eps);
      }
      const bool ok = valid(r);
      for (int k = lane; k < len; k += 32) {
        const float v = to_float(s[k]);
        dst[r * ldd + k] = from_float<Td>(!ok ? 0.f : normalize ? (v - mean) * rs * w[k] + bias[k] : v);
      }
    }
  }
  for (int r = row0; r < row0 + rows; ++r)
    for (int k = len + lane; k < len_padded; k += 32) dst[r * ldd + k] = from_float<Td>(0.f);
}

}  // namespace trimul
