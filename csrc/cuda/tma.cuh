// Tensor-memory-accelerator copies on sm_90a: a whole tile between global and
// shared memory by one instruction of one thread, described by a tensor map the
// host encodes (cuTensorMapEncodeTiled, reached through the runtime's driver
// entry point, so the extension needs no link to the driver library).
//
// The maps here are 4-D, 16-bit, with the 128-byte swizzle: a box's rows of 64
// elements (128 bytes) lie in shared memory densely, and in each 1024-byte block
// of 8 rows the 16-byte piece q of row r sits at piece q ^ (r % 8) — so eight
// rows' pieces at one column fall in eight distinct bank groups, what the padded
// rows of a cp.async tile buy, with no padding. Destinations are 1024-byte
// aligned for that pattern. Elements of a box outside the tensor load as zeros
// and are not stored.
//
// Loads complete on an mbarrier that counts the bytes (expect_tx); stores are
// bulk groups their issuing thread waits for before the staging is rewritten.
// As with wgmma.cuh, the instructions exist only in sm_90a machine code.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "wgmma.cuh"

namespace trimul {

constexpr int kSwizzleRowBytes = 128;     // a swizzled box row: 64 16-bit elements
constexpr int kSwizzleBlockBytes = 1024;  // the pattern's period (8 rows), the tiles' alignment

// Byte offset of element column `col` (16-bit) of row `row` in a swizzled box of 128-byte rows.
__host__ __device__ __forceinline__ uint32_t swizzled(int row, int col) {
  return row * kSwizzleRowBytes + ((((col * 2) / 16) ^ (row % 8)) * 16) + (col * 2) % 16;
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
#ifdef TRIMUL_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
#endif
}
// One arrival that also expects `bytes` of copies to complete on the barrier.
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
#ifdef TRIMUL_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// Until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#ifdef TRIMUL_WGMMA
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

// The box of `map` at coordinates (c0 innermost .. c3) into shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
#ifdef TRIMUL_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#endif
}
// The box of `map` at (c0 .. c3) from shared memory at `src` (written by this thread's proxy
// before a fence_proxy_async_shared), as part of the thread's current bulk group.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, int c0, int c1, int c2, int c3, uint32_t src) {
#ifdef TRIMUL_WGMMA
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#ifdef TRIMUL_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Until this thread's bulk groups have read their shared memory.
__device__ __forceinline__ void bulk_wait_read() {
#ifdef TRIMUL_WGMMA
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
#endif
}

// Host: a 4-D map of a 16-bit tensor (dims[0] innermost and contiguous; strides in elements of
// dims 1..3) with boxes of `box` elements and the 128-byte swizzle (box[0] = 64).
cudaError_t encode_map_16bit(CUtensorMap* map, const void* base, bool bf16, const int64_t (&dims)[4],
                             const int64_t (&strides)[3], const uint32_t (&box)[4]);

}  // namespace trimul
