// Warpgroup-level tensor-core products on sm_90a (wgmma), for the 16-bit
// operand types and (operands from shared memory) tf32, which wgmma reads from
// fp32 storage (the top 19 bits: our tf32 operands are stored rounded). Both
// operands come from shared memory through 64-bit matrix
// descriptors, in the K-major layout without swizzle (mma.cuh: CoreBlockedAt):
// 8-row x 16-byte core matrices, 128 contiguous bytes each; the descriptor
// holds the start address, the byte offset between the two core matrices of a
// k step (LBO, along k) and between 8-row groups (SBO), each >> 4, and the
// layout type in bits 62-63 (0: no swizzle). A k step (32 bytes of k: k16 at
// 16 bits, k8 at tf32) advances the start by two core matrices.
//
// The accumulator of m64nNk16 is mma.sync's m16n8 C fragment per warp: warp w
// of the warpgroup holds rows 16 w + g and 16 w + g + 8 (g = lane / 4),
// acc[j][0..1] at columns 8 j + 2 t, + 1 of the first row and acc[j][2..3] of
// the second (t = lane % 4), so epilogues written for warp_mma carry over.
//
// The instructions exist only in sm_90a machine code (TORCH_CUDA_ARCH_LIST
// "9.0a"); elsewhere these functions trap, and the host launches the kernels
// that use them only where the build has sm_90a code and the device is
// compute capability 9.0 (trimul.cpp: plan).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TRIMUL_WGMMA 1
#endif

namespace trimul {

constexpr uint32_t kCoreMatrixBytes = 128;  // 8 rows x 16 bytes

// Descriptor of a K-major, unswizzled operand at shared address `addr`, whose
// 8-row groups lie `group_bytes` apart (SBO); the core matrices along k are
// adjacent (LBO = 128 bytes).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr, uint32_t group_bytes) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | static_cast<uint64_t>((kCoreMatrixBytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((group_bytes >> 4) & 0x3FFF) << 32;
}

// Descriptor of an N-major (transposed) B operand in the same storage: a K-major
// tile of another product read along its rows. For B (n x k) = S^T where S (k rows
// x n columns) sits in the K-major layout above (S's 8-row groups `group_bytes`
// apart, its core matrices along a row adjacent), the core matrices adjacent along
// n lie 128 bytes apart (SBO) and the 8-row groups of k `group_bytes` apart (LBO):
// PTX's canonical N-major layout without swizzle, ((8,n),(8,k)) : ((1,SBO),(8,LBO))
// in 16-bit elements. A k16 step then advances the start by two groups.
__device__ __forceinline__ uint64_t wgmma_desc_n_major(uint32_t addr, uint32_t group_bytes) {
  return static_cast<uint64_t>((addr >> 4) & 0x3FFF) | static_cast<uint64_t>((group_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((kCoreMatrixBytes >> 4) & 0x3FFF) << 32;
}

// Orders this thread's accumulator registers before the warpgroup's wgmma, and
// its earlier shared-memory writes before the async proxy's reads.
__device__ __forceinline__ void wgmma_fence() {
#ifdef TRIMUL_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// A barrier of the 128 threads of warpgroup wg alone (named barrier wg + 1; 0 is __syncthreads').
__device__ __forceinline__ void warpgroup_barrier(int wg) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
}
__device__ __forceinline__ void fence_proxy_async_shared() {
#ifdef TRIMUL_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// acc = A (64 x k) . B (128 x k)^T (+ acc where accumulate) for one k step, both from
// shared memory, K-major. acc[j][0..3] are the asm operands %0 .. %63. SHAPE_TYPES: the
// instruction's shape and types; SCALES: its immediate operands (the 16-bit forms also
// take the two transpose flags, 0: K-major; tf32 has none, being K-major only).
#define TRIMUL_ACC4(j) "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
#define TRIMUL_WGMMA_N128(SHAPE_TYPES, SCALES)                                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
               "wgmma.mma_async.sync.aligned." SHAPE_TYPES " {"                                                   \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "   \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "   \
               "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "   \
               "%59, %60, %61, %62, %63}, %64, %65, p, " SCALES ";\n}\n"                                         \
               : TRIMUL_ACC4(0), TRIMUL_ACC4(1), TRIMUL_ACC4(2), TRIMUL_ACC4(3), TRIMUL_ACC4(4), TRIMUL_ACC4(5),   \
                 TRIMUL_ACC4(6), TRIMUL_ACC4(7), TRIMUL_ACC4(8), TRIMUL_ACC4(9), TRIMUL_ACC4(10), TRIMUL_ACC4(11), \
                 TRIMUL_ACC4(12), TRIMUL_ACC4(13), TRIMUL_ACC4(14), TRIMUL_ACC4(15)                              \
               : "l"(desc_a), "l"(desc_b), "r"(accumulate))

// The same with A from registers: a[0..3] is the warp's m16n8k16 A fragment (rows 16 w + g and
// + 8, columns 2t.. and 2t + 8.. as 16-bit pairs: a0 (g, 2t) a1 (g + 8, 2t) a2 (g, 2t + 8) a3
// (g + 8, 2t + 8)). The registers are not to be accessed, read or written, until the wgmma
// completes (PTX: undefined otherwise); stage them before issuing it. TRANS_B: "0"
// for a K-major B, "1" for an N-major one (wgmma_desc_n_major).
#define TRIMUL_WGMMA_N128_RS(TYPES, TRANS_B)                                                                     \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                     \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPES " {"                                          \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "   \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "   \
               "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "   \
               "%59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, " TRANS_B ";\n}\n"                    \
               : TRIMUL_ACC4(0), TRIMUL_ACC4(1), TRIMUL_ACC4(2), TRIMUL_ACC4(3), TRIMUL_ACC4(4), TRIMUL_ACC4(5),   \
                 TRIMUL_ACC4(6), TRIMUL_ACC4(7), TRIMUL_ACC4(8), TRIMUL_ACC4(9), TRIMUL_ACC4(10), TRIMUL_ACC4(11), \
                 TRIMUL_ACC4(12), TRIMUL_ACC4(13), TRIMUL_ACC4(14), TRIMUL_ACC4(15)                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

// The m64n64k16 form (acc[j], j < 8: columns 8 j + 2 t, + 1 as above), for a chain split in two
// halves of n whose epilogues then run one under the other's products.
#define TRIMUL_WGMMA_N64_RS(TYPES, TRANS_B)                                                                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                     \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPES " {"                                           \
               "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "   \
               "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, "     \
               TRANS_B ";\n}\n"                                                                                 \
               : TRIMUL_ACC4(0), TRIMUL_ACC4(1), TRIMUL_ACC4(2), TRIMUL_ACC4(3), TRIMUL_ACC4(4), TRIMUL_ACC4(5),   \
                 TRIMUL_ACC4(6), TRIMUL_ACC4(7)                                                                  \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

// One k16 step with A from registers: n = 8 kJ (128 or 64) columns of B.
template <typename T, bool kTransB = false, int kJ>
__device__ __forceinline__ void wgmma_m64k16_rs(float (&acc)[kJ][4], const uint32_t (&a)[4], uint64_t desc_b,
                                                int accumulate) {
#ifdef TRIMUL_WGMMA
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value, "16-bit operands");
  static_assert(kJ == 16 || kJ == 8, "n128 or n64");
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  // (the operand types and B's layout as the instruction's string literals)
#define TRIMUL_WGMMA_RS_TYPED(FORM)     \
  if constexpr (kBf16 && kTransB)       \
    FORM("bf16.bf16", "1");             \
  else if constexpr (kBf16)             \
    FORM("bf16.bf16", "0");             \
  else if constexpr (kTransB)           \
    FORM("f16.f16", "1");               \
  else                                  \
    FORM("f16.f16", "0");
  if constexpr (kJ == 16) {
    TRIMUL_WGMMA_RS_TYPED(TRIMUL_WGMMA_N128_RS)
  } else {
    TRIMUL_WGMMA_RS_TYPED(TRIMUL_WGMMA_N64_RS)
  }
#undef TRIMUL_WGMMA_RS_TYPED
#else
  __trap();
#endif
}
#undef TRIMUL_WGMMA_N128_RS
#undef TRIMUL_WGMMA_N64_RS

template <typename T>
__device__ __forceinline__ void wgmma_m64n128_step(float (&acc)[16][4], uint64_t desc_a, uint64_t desc_b,
                                                   int accumulate) {
#ifdef TRIMUL_WGMMA
  static_assert(std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value ||
                    std::is_same<T, float>::value,
                "16-bit or tf32 operands");
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    TRIMUL_WGMMA_N128("m64n128k16.f32.bf16.bf16", "1, 1, 0, 0");
  else if constexpr (std::is_same<T, __half>::value)
    TRIMUL_WGMMA_N128("m64n128k16.f32.f16.f16", "1, 1, 0, 0");
  else
    TRIMUL_WGMMA_N128("m64n128k8.f32.tf32.tf32", "1, 1");
#else
  __trap();
#endif
}
#undef TRIMUL_WGMMA_N128
#undef TRIMUL_ACC4

// acc[j][e] = sum over k < ksteps k steps (>= 1) of A[64 rows][k] B[128 rows][k],
// A and B described by desc_a and desc_b (wgmma_desc) at k = 0: wgmma issued,
// not waited for. acc's values before are not read (the first step overwrites),
// so the caller need not zero it: zeroing that ptxas places between two chains
// makes it wait for the first. Chains go between one wgmma_fence (after the
// caller's shared-memory writes are fenced, fence_proxy_async_shared, and a
// barrier) and one wgmma_commit; acc is left alone until wgmma_wait.
template <typename T>
__device__ __forceinline__ void wgmma_chain(float (&acc)[16][4], uint64_t desc_a, uint64_t desc_b, int ksteps) {
  constexpr uint32_t kStep = 2 * kCoreMatrixBytes >> 4;  // a k step: two core matrices, in the address field
  // Only the start address moves, in the descriptors' low words (a shared address >> 4 stays
  // below 2^14 however far it steps within the block's shared memory).
  const uint32_t a_hi = static_cast<uint32_t>(desc_a >> 32), b_hi = static_cast<uint32_t>(desc_b >> 32);
  uint32_t a_lo = static_cast<uint32_t>(desc_a), b_lo = static_cast<uint32_t>(desc_b);
  auto desc = [](uint32_t lo, uint32_t hi) { return static_cast<uint64_t>(hi) << 32 | lo; };
#pragma unroll 1  // (unrolled, ptxas puts a wait after every wgmma)
  for (int k = 0; k < ksteps; ++k, a_lo += kStep, b_lo += kStep)
    wgmma_m64n128_step<T>(acc, desc(a_lo, a_hi), desc(b_lo, b_hi), k > 0);
}

// acc = A . B^T over kSteps k16 steps (acc += with `accumulate`), A from registers (a[s]: step
// s's fragment), B (8 kJ rows) described by desc_b at k = 0; issued, not waited for, as wgmma_chain.
// kTransB: B is N-major (wgmma_desc_n_major, its 8-row groups of k kGroupBytes apart).
template <typename T, int kSteps, bool kTransB = false, uint32_t kGroupBytes = kCoreMatrixBytes, int kJ>
__device__ __forceinline__ void wgmma_chain_rs(float (&acc)[kJ][4], const uint32_t (&a)[kSteps][4], uint64_t desc_b,
                                               bool accumulate = false) {
  static_assert(kTransB || kGroupBytes == kCoreMatrixBytes, "K-major: the core matrices along k adjacent");
  constexpr uint32_t kStep = 2 * kGroupBytes >> 4;  // two groups of 8 along k, in the address field
  const uint32_t b_hi = static_cast<uint32_t>(desc_b >> 32), b_lo = static_cast<uint32_t>(desc_b);
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
    wgmma_m64k16_rs<T, kTransB>(acc, a[s], static_cast<uint64_t>(b_hi) << 32 | (b_lo + s * kStep), s > 0 || accumulate);
}

// stmatrix (sm_90): the inverse of ldsm_x4 / ldsm_x4_trans, four 8 x 8 16-bit matrices from
// the warp's registers r[i] (matrix i: row g, columns 2t, 2t + 1 in lane (g, t); transposed:
// column g, rows 2t, 2t + 1), lane l giving the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4]) {
#ifdef TRIMUL_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, const uint32_t (&r)[4]) {
#ifdef TRIMUL_WGMMA
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef TRIMUL_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this warpgroup's groups are in flight; acc
// is readable after it (each register passes through an empty asm after the
// wait, so no read of acc is scheduled before it).
template <int kPending, int kJ>
__device__ __forceinline__ void wgmma_wait(float (&acc)[kJ][4]) {
#ifdef TRIMUL_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[j][e])::"memory");
}

}  // namespace trimul
