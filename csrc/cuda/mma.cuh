// Warp-level tensor-core helpers (mma.sync m16n8k16, 16-bit operands, fp32
// accumulators; sm_80 and newer) for the input and output stages.
//
// Operand tiles live in shared memory with the reduction index k contiguous:
// A as [row][k], B as [col][k], both with a row stride of kp + kSmemPad
// elements (kp a multiple of 16), which makes the fragment loads below
// conflict-free. Fragment layout of m16n8k16 (g = lane / 4, t = lane % 4):
//   A: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B: b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C: c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

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

template <typename T>
__device__ __forceinline__ uint32_t lds32(const T* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// acc[nt] += A[row0 .. row0+15][0 .. kp) . B[nt*8 .. nt*8+7][0 .. kp)^T for nt < NT
template <typename T, int NT>
__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const T* a, const T* b, int ld, int row0, int kp) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* a_lo = a + (row0 + g) * ld + 2 * t;
  const T* a_hi = a_lo + 8 * ld;
  const T* b_row = b + g * ld + 2 * t;
  for (int k = 0; k < kp; k += kMmaK) {
    const uint32_t af[4] = {lds32(a_lo + k), lds32(a_hi + k), lds32(a_lo + k + 8), lds32(a_hi + k + 8)};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const T* bp = b_row + nt * 8 * ld + k;
      mma_16816<T>(acc[nt], af, lds32(bp), lds32(bp + 8));
    }
  }
}

}  // namespace trimul
