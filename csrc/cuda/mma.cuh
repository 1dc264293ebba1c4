// Warp-level tensor-core helpers (mma.sync, fp32 accumulators; cp.async and
// ldmatrix; sm_80 and newer) for the input and output stages. Operand types:
// bf16 and fp16 (m16n8k16), and float, which the products read as tf32
// (m16n8k8): rounded to nearest once (precision "tf32"), or split into a tf32
// pair hi + lo with three products per step, lo.hi + hi.lo + hi.hi (3xTF32,
// precision "ieee": about fp32's accuracy).
//
// Operand tiles live in shared memory, B as [col][k], A as [row][k] or k-major,
// with row strides of (a multiple of 16) elements + 16 bytes, which keeps the
// ldmatrix row addresses of a matrix in distinct banks. A k step is 32 bytes
// for every operand type, so the ldmatrix addressing is the same in bytes.
// Fragment layouts (g = lane / 4, t = lane % 4), m16n8k16:
//   A: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B: b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
// m16n8k8 (tf32): A: a0 (g, t)  a1 (g+8, t)  a2 (g, t+4)  a3 (g+8, t+4)
//   B: b0 (k t, n g)  b1 (k t+4, n g)
// C, both: c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace trimul {

template <typename T>
constexpr int kMmaK = 32 / static_cast<int>(sizeof(T));  // k per mma: 16 (16-bit), 8 (tf32)
template <typename T>
constexpr int kSmemPad = static_cast<int>(kOperandRowPadBytes / sizeof(T));  // elements of padding per row

// Blocks per SM that the stages' shared memory allows: for 16-bit operands (~100
// KB each at P = H = 128) two where an SM has 228 KB (sm_90, sm_100), one
// elsewhere (sm_80: 164 KB; sm_86, sm_89, sm_120: 100 KB); fp32 operands (~190
// KB) one. Their __launch_bounds__ follow, so the register cap (128 per thread
// at two blocks of 256) applies only where two blocks fit; elsewhere it would
// only cost spills.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900 || __CUDA_ARCH__ == 1000)
template <typename T>
constexpr int kStageBlocksPerSm = sizeof(T) == 2 ? 2 : 1;
#else
template <typename T>
constexpr int kStageBlocksPerSm = 1;
#endif

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

__device__ __forceinline__ void mma_1688_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// fp32 bits rounded to the nearest tf32 (the low 13 mantissa bits cleared).
__device__ __forceinline__ uint32_t tf32_rna(uint32_t v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(__uint_as_float(v)));
  return r;
}

// v rounded to the nearest tf32, as a float (the value the tf32 products read exactly).
__device__ __forceinline__ float round_tf32(float v) { return __uint_as_float(tf32_rna(__float_as_uint(v))); }

// A fragment of n fp32 registers as the tf32 products read it: hi = tf32(v),
// and with kSplit lo = tf32(v - hi), which carries the next 11 bits.
template <bool kSplit, int n>
__device__ __forceinline__ void tf32_split(uint32_t (&hi)[n], uint32_t (&lo)[n]) {
#pragma unroll
  for (int i = 0; i < n; ++i) {
    const uint32_t h = tf32_rna(hi[i]);
    if (kSplit) lo[i] = tf32_rna(__float_as_uint(__uint_as_float(hi[i]) - __uint_as_float(h)));
    hi[i] = h;
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 16-bit matrices; lane l gives the (32-bit shared-memory) address of
// row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// acc[mt][nt] += A[row0 + 16 mt .. +15][0 .. kp) . B[nt*8 .. +7][0 .. kp)^T for
// mt < MT, nt < NT (NT even): a warp's (16 MT) x (8 NT) tile. B is [n][k], or
// k-major, b[k * ldb + n] (kBKMajor, 16-bit operands: ldmatrix.trans). A is
// [row][k] (kAKMajor false) or k-major, a[k * lda + row] (kAKMajor true:
// fragments through ldmatrix.trans for 16-bit operands, which has no 32-bit
// form; four 32-bit loads per fragment for float, conflict-free when lda % 32
// == 8). For A, ldmatrix matrix m = lane / 8 covers rows + 8 (m % 2), k + 16
// bytes (m / 2): a0..a3 of the fragment. For a pair of B tiles, matrix m covers
// n + 8 (m / 2), k + 16 bytes (m % 2): b0 b1 of each (k-major: k + 8 (m % 2),
// n + 8 (m / 2), transposed). Per k step a warp loads
// MT + NT / 2 fragments for MT * NT products (three each with kSplit, float
// only); the lane's fragment addresses are 32-bit shared-memory addresses, set
// once and stepped by a constant per k step, so the loop is loads and products.
// kARounded / kBRounded (float operands at tf32, not split): the tile's values are
// tf32 already (round_tf32 where it was written), so the fragments go to the
// products as loaded, with no rounding per fragment.
template <typename T, int MT, int NT, bool kAKMajor, bool kSplit = false, bool kBKMajor = false,
          bool kARounded = false, bool kBRounded = false>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NT][4], const T* a, int lda, const T* b, int ldb, int row0,
                                         int kp) {
  static_assert(NT % 2 == 0, "B tiles go in pairs");
  constexpr bool kTf32 = std::is_same<T, float>::value;
  static_assert(kTf32 || !kSplit, "3xTF32 is for float operands");
  static_assert(!kTf32 || !kBKMajor, "k-major B through ldmatrix.trans: 16-bit operands");
  static_assert(!kSplit || !(kARounded || kBRounded), "3xTF32 splits the full fp32 values");
  constexpr int kK = kMmaK<T>, kV = 16 / static_cast<int>(sizeof(T));  // elements per 16 bytes
  constexpr bool kScalarA = kTf32 && kAKMajor;
  const int lane = threadIdx.x % 32, m = lane / 8, r8 = lane % 8, g = lane / 4, t = lane % 4;
  const uint32_t a0 = smem_addr(kScalarA  ? a + t * lda + row0 + g
                                : kAKMajor ? a + ((m / 2) * 8 + r8) * lda + row0 + (m % 2) * 8
                                           : a + (row0 + (m % 2) * 8 + r8) * lda + (m / 2) * kV);
  const uint32_t b0 = smem_addr(kBKMajor ? b + ((m % 2) * 8 + r8) * ldb + (m / 2) * 8
                                         : b + ((m / 2) * 8 + r8) * ldb + (m % 2) * kV);
  const uint32_t a_mt = (kAKMajor ? 16 : 16 * lda) * sizeof(T);  // next 16 rows
  const uint32_t a_k = (kAKMajor ? kK * lda : kK) * sizeof(T);  // next k step
  const uint32_t b_nt = (kBKMajor ? 16 : 16 * ldb) * sizeof(T), b_k = (kBKMajor ? kK * ldb : kK) * sizeof(T);
  uint32_t a_addr = a0, b_addr = b0;
#pragma unroll 3
  for (int k = 0; k < kp; k += kK, a_addr += a_k, b_addr += b_k) {
    uint32_t af[MT][4], al[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if constexpr (kScalarA) {  // a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
        const uint32_t at = a_addr + mt * a_mt, k4 = 4 * lda * sizeof(T), r8b = 8 * sizeof(T);
        af[mt][0] = lds32(at), af[mt][1] = lds32(at + r8b);
        af[mt][2] = lds32(at + k4), af[mt][3] = lds32(at + k4 + r8b);
      } else if constexpr (kAKMajor) {
        ldsm_x4_trans(af[mt], a_addr + mt * a_mt);
      } else {
        ldsm_x4(af[mt], a_addr + mt * a_mt);
      }
      if constexpr (kTf32 && !kARounded) tf32_split<kSplit>(af[mt], al[mt]);
    }
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t bf[4], bl[4];
      if constexpr (kBKMajor)
        ldsm_x4_trans(bf, b_addr + (nt / 2) * b_nt);
      else
        ldsm_x4(bf, b_addr + (nt / 2) * b_nt);
      if constexpr (kTf32 && !kBRounded) tf32_split<kSplit>(bf, bl);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (!kTf32) {
          mma_16816<T>(acc[mt][nt], af[mt], bf[0], bf[1]);
          mma_16816<T>(acc[mt][nt + 1], af[mt], bf[2], bf[3]);
        } else {
          if constexpr (kSplit) {  // the small terms first
            mma_1688_tf32(acc[mt][nt], al[mt], bf[0], bf[1]);
            mma_1688_tf32(acc[mt][nt + 1], al[mt], bf[2], bf[3]);
            mma_1688_tf32(acc[mt][nt], af[mt], bl[0], bl[1]);
            mma_1688_tf32(acc[mt][nt + 1], af[mt], bl[2], bl[3]);
          }
          mma_1688_tf32(acc[mt][nt], af[mt], bf[0], bf[1]);
          mma_1688_tf32(acc[mt][nt + 1], af[mt], bf[2], bf[3]);
        }
      }
    }
  }
}

constexpr float kOperandScale = 0.5f;  // of the packed weights (OperandLayout)

// proj * sigmoid(gate) from the half-scale products p = proj / 2, g = gate / 2
// of the packed operands (OperandLayout): sigmoid(2 g) = (1 + tanh(g)) / 2, so
// the product is p + p tanh(g). The hardware tanh is one MUFU operation
// (relative error about 2^-11, no more than the 16-bit outputs' rounding).
__device__ __forceinline__ float gated_half_scale(float p, float g) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(g));
  return fmaf(p, t, p);
}
// The same to fp32 accuracy, for the fp32 precisions: 2 p sigmoid(2 g).
__device__ __forceinline__ float gated_half_scale_accurate(float p, float g) {
  return __fdividef(2.f * p, 1.f + exp_ftz(g, -2.f));
}
template <typename T>
__device__ __forceinline__ float gated_half_scale_for(float p, float g) {
  if constexpr (std::is_same<T, float>::value)
    return gated_half_scale_accurate(p, g);
  else
    return gated_half_scale(p, g);
}

// Column sums over the eight lanes g of a column of the fragment layout (lanes t, t + 4, ...,
// t + 28), reduce-scattered: v[kN] holds a lane's kN values, one per column it covers; three
// exchanges of halves (xor 4, 8, 16: kN / 2 + kN / 4 + kN / 8 shuffles, in a fixed order) leave
// in v[0 .. kN / 8) the sums of entries scatter_first<kN>(g) + e. Every lane of the warp calls it.
template <int kHalf, int kN>
__device__ __forceinline__ void fold_half(float (&v)[kN], int mask) {
  const bool upper = threadIdx.x & mask;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? v[i] : v[i + kHalf], keep = upper ? v[i + kHalf] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}
template <int kN>
__device__ __forceinline__ void column_sums_scatter(float (&v)[kN]) {
  static_assert(kN % 8 == 0, "three halvings over the eight lanes of a column");
  fold_half<kN / 2>(v, 4);
  fold_half<kN / 4>(v, 8);
  fold_half<kN / 8>(v, 16);
}
template <int kN>
__device__ __forceinline__ int scatter_first(int g) {
  return kN / 2 * (g & 1) + kN / 4 * (g >> 1 & 1) + kN / 8 * (g >> 2 & 1);
}

// LayerNorm statistics (mean, rstd) of one row of a 16-bit A fragment held as floats: v[s]
// is the thread's four values of k16 step s (pieces 0 and 1: two values each), over the row's
// `len` columns (inv_len = 1 / len) where in_row(s, piece) says which of the thread's pieces
// are among them (the rest zero), summed over the row's 4 lanes t. Two passes, each summed in
// four interleaved parts (short dependency chains).
template <int kSteps, typename InRow>
__device__ __forceinline__ float2 fragment_row_stats(const float (&v)[kSteps][4], float inv_len, float eps,
                                                     InRow in_row) {
  float part[2][2] = {};
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int piece = 0; piece < 2; ++piece) part[s % 2][piece] += v[s][2 * piece] + v[s][2 * piece + 1];
  float sum = (part[0][0] + part[0][1]) + (part[1][0] + part[1][1]);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const float mean = sum * inv_len;
  float sq_part[2][2] = {};
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int piece = 0; piece < 2; ++piece)
      if (in_row(s, piece)) {
        const float d0 = v[s][2 * piece] - mean, d1 = v[s][2 * piece + 1] - mean;
        sq_part[s % 2][piece] += d0 * d0 + d1 * d1;
      }
  float sq = (sq_part[0][0] + sq_part[0][1]) + (sq_part[1][0] + sq_part[1][1]);
  sq += __shfl_xor_sync(0xffffffffu, sq, 1);
  sq += __shfl_xor_sync(0xffffffffu, sq, 2);
  return make_float2(mean, rsqrtf(sq * inv_len + eps));
}
// The same where the fragment holds the row's columns in order (columns 16 s + 2 t + {0, 1},
// then + 8) and the row is its first `len` (len % 8 == 0: a run of 8 is in or out whole).
struct FirstColumns {
  int len;
  __device__ __forceinline__ bool operator()(int s, int piece) const { return 16 * s + 8 * piece < len; }
};
template <int kSteps>
__device__ __forceinline__ float2 fragment_row_stats(const float (&v)[kSteps][4], int len, float inv_len, float eps) {
  return fragment_row_stats(v, inv_len, eps, FirstColumns{len});
}

// a and b summed over the four lanes t of a quad (the lanes holding one fragment row).
__device__ __forceinline__ void quad_sums(float& a, float& b) {
  a += __shfl_xor_sync(0xffffffffu, a, 1);
  b += __shfl_xor_sync(0xffffffffu, b, 1);
  a += __shfl_xor_sync(0xffffffffu, a, 2);
  b += __shfl_xor_sync(0xffffffffu, b, 2);
}

// A 32-bit register of a 16-bit fragment as its two values, and back (rounded to nearest).
template <typename T>
__device__ __forceinline__ float2 unpack_reg(uint32_t r) {
  return Vec2<T>::unpack(*reinterpret_cast<const typename Vec2<T>::type*>(&r));
}
template <typename T>
__device__ __forceinline__ uint32_t pack_reg(float a, float b) {
  const typename Vec2<T>::type v = Vec2<T>::pack(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The same statistics of a thread's row half (0: row g, 1: row g + 8) of a 16-bit A fragment
// held packed (a[s]: k16 step s, as ldmatrix leaves it).
template <typename T, int kSteps>
__device__ __forceinline__ float2 fragment_row_stats(const uint32_t (&a)[kSteps][4], int half, int len, float inv_len,
                                                     float eps) {
  float v[kSteps][4];
#pragma unroll
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int piece = 0; piece < 2; ++piece) {
      const float2 f = unpack_reg<T>(a[s][half + 2 * piece]);
      v[s][2 * piece] = f.x, v[s][2 * piece + 1] = f.y;
    }
  return fragment_row_stats(v, len, inv_len, eps);
}

// sigmoid(v) = (1 + tanh(v / 2)) / 2: one MUFU operation (tanh.approx, relative error
// about 2^-11, below the 16-bit operands' rounding).
__device__ __forceinline__ float sigmoid_tanh(float v) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * v));
  return fmaf(0.5f, t, 0.5f);
}

// 0, as a value the compiler cannot see through: what is derived from it in a loop is
// recomputed there rather than held in registers across the loop.
__device__ __forceinline__ int opaque_zero() {
  int z;
  asm volatile("mov.u32 %0, 0;\n" : "=r"(z));
  return z;
}

// The line holding p into L2 (no register holds the data).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ void cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem));
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) { cp_async16(smem_addr(smem), gmem); }
// 4 bytes through L1 (.ca: cp.async's only form below 16 bytes)
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}
// cp.async in groups: close the group of the copies issued since the last one; wait until at
// most kPending groups are in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Rows of a strided source: row i at base + i * stride for i < count; rows
// from count on read as zeros.
template <typename T>
struct StridedRows {
  const T* base;
  int64_t stride;
  int count;
};

// Where element (r, k) of a shared-memory operand tile sits, in elements, and
// how a warp's row-wise passes spread over it so that the 16-byte accesses of
// each quarter warp fall in distinct banks: kLanesPerRow lanes per row, 32 /
// kLanesPerRow rows at a time, lanes along a row first or (kRowsFast) along
// the rows first. Rows `ld` apart (the mma.sync stages' tiles, read by ldmatrix):
struct RowMajorAt {
  static constexpr int kLanesPerRow = 8;
  static constexpr bool kRowsFast = false;
  int ld;
  __device__ __forceinline__ int operator()(int r, int k) const { return r * ld + k; }
};
// wgmma's K-major layout without swizzle: 8 x 16-byte core matrices, each 128
// contiguous bytes (row r % 8 at 16-byte step), `kq` of them along k per
// 8-row group (k / (16 bytes) the core matrix within the group). Any run of
// 16 bytes along k that starts 16-byte aligned stays contiguous. The banks of
// a 16-byte piece follow r % 8 alone, so a quarter warp takes 8 rows.
template <typename T>
struct CoreBlockedAt {
  static constexpr int kLanesPerRow = 4;
  static constexpr bool kRowsFast = true;
  static constexpr int kV = 16 / sizeof(T);  // elements per 16 bytes
  int kq;                                      // 16-byte units per row (k extent / kV)
  __device__ __host__ __forceinline__ int operator()(int r, int k) const {
    return ((r >> 3) * kq + k / kV) * (8 * kV) + (r & 7) * kV + k % kV;
  }
};

// Tile row r is source row r.
struct SameRow {
  __device__ __forceinline__ int operator()(int r) const { return r; }
};

// Block-wide copy of `rows` tile rows of `cols` elements into dst[at(r, k)],
// columns [cols, cols_padded) zeroed; tile row r is source row row_of(r). With
// `vec` (cols * sizeof(T) and every source row start 16-byte aligned, each
// tile row's 16-byte runs too) the copy is cp.async, 16 bytes per instruction,
// left in flight: call cp_async_wait_all() and sync before reading.
// (`tid`, `threads`: the copying threads, by default the block.)
template <typename T, typename At, typename RowOf>
__device__ __forceinline__ void copy_rows(T* dst, At at, int rows, int cols, int cols_padded, StridedRows<T> src,
                                          RowOf row_of, bool vec, int tid, int threads) {
  if (vec) {
    constexpr int V = 16 / sizeof(T);
    const int per_row = cols / V;
    auto copy16 = [&](int r, int q) {
      const int i = row_of(r);
      if (i < src.count)
        cp_async16(dst + at(r, q * V), src.base + i * src.stride + q * V);
      else
        *reinterpret_cast<uint4*>(dst + at(r, q * V)) = make_uint4(0, 0, 0, 0);
    };
    if constexpr (At::kRowsFast) {  // a thread keeps (r % 8, q), steps over 8-row groups (rows % 8 == 0)
      const int per_group = 8 * per_row, t = tid;
      if (per_group <= threads) {
        const int step = threads / per_group;
        if (t < step * per_group)
          for (int r = (t / per_group) * 8 + t % 8; r < rows; r += 8 * step) copy16(r, (t / 8) % per_row);
      } else {
        for (int e = t; e < rows * per_row; e += threads)
          copy16((e / per_group) * 8 + e % 8, (e / 8) % per_row);
      }
    } else if (per_row <= threads) {  // a thread keeps one column q, steps over rows
      const int q = tid % per_row, step = threads / per_row;
      if (tid < step * per_row) {
        if constexpr (std::is_same<RowOf, SameRow>::value) {  // the source stepped, no per-row products
          int r = tid / per_row;
          const int64_t src_step = static_cast<int64_t>(step) * src.stride;
          for (const T* s = src.base + r * src.stride + q * V; r < rows; r += step, s += src_step) {
            T* d = dst + at(r, q * V);
            if (r < src.count)
              cp_async16(d, s);
            else
              *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
          }
        } else {
          for (int r = tid / per_row; r < rows; r += step) copy16(r, q);
        }
      }
    } else {
      for (int e = tid; e < rows * per_row; e += threads) copy16(e / per_row, e % per_row);
    }
  } else {
    for (int e = tid; e < rows * cols; e += threads) {
      const int r = e / cols, k = e % cols, i = row_of(r);
      dst[at(r, k)] = i < src.count ? src.base[i * src.stride + k] : from_float<T>(0.f);
    }
  }
  const int pad = cols_padded - cols;
  if (pad > 0)
    for (int e = tid; e < rows * pad; e += threads) dst[at(e / pad, cols + e % pad)] = from_float<T>(0.f);
}
template <typename T, typename At, typename RowOf>
__device__ __forceinline__ void copy_rows(T* dst, At at, int rows, int cols, int cols_padded, StridedRows<T> src,
                                          RowOf row_of, bool vec) {
  copy_rows(dst, at, rows, cols, cols_padded, src, row_of, vec, static_cast<int>(threadIdx.x),
            static_cast<int>(blockDim.x));
}
template <typename T, typename RowOf>
__device__ __forceinline__ void copy_rows(T* dst, int ld, int rows, int cols, int cols_padded, StridedRows<T> src,
                                          RowOf row_of, bool vec, int tid, int threads) {
  copy_rows(dst, RowMajorAt{ld}, rows, cols, cols_padded, src, row_of, vec, tid, threads);
}
template <typename T, typename RowOf>
__device__ __forceinline__ void copy_rows(T* dst, int ld, int rows, int cols, int cols_padded, StridedRows<T> src,
                                          RowOf row_of, bool vec) {
  copy_rows(dst, RowMajorAt{ld}, rows, cols, cols_padded, src, row_of, vec);
}

// Block-wide copy of `bytes` (a multiple of 16, both ends 16-byte aligned) from
// global src to shared dst by cp.async, left in flight like copy_rows: packed
// weight rows, which lie in memory as the stages lay them out (OperandLayout).
template <int kThreads>
__device__ __forceinline__ void copy_linear(void* dst, const void* src, int bytes) {
  constexpr int kStep = 16 * kThreads;
  const uint32_t d = smem_addr(dst);
  const char* s = static_cast<const char*>(src);
#pragma unroll 4
  for (int o = 16 * static_cast<int>(threadIdx.x); o < bytes; o += kStep) cp_async16(d + o, s + o);
}

// ---- LayerNorm of the rows of a shared-memory tile ----------------------------

// 8 floats as two 16-byte halves at p and p4
__device__ __forceinline__ void load8(const float* p, const float* p4, float (&v)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p4);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void load8(const float* p, float (&v)[8]) { load8(p, p + 4, v); }
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
__device__ __forceinline__ void store8(float* p, float* p4, const float (&v)[8]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p4) = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(float* p, const float (&v)[8]) { store8(p, p + 4, v); }
template <typename T>
__device__ __forceinline__ void store8(T* p, const float (&v)[8]) {
  uint4 u;
  auto* h = reinterpret_cast<typename Vec2<T>::type*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = Vec2<T>::pack(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = u;
}

// Elements k .. k + 7 of tile row r (k % 8 == 0) at at(r, k): one 16-byte piece of a 16-bit
// tile, two of a float one, found each by `at` (the pieces of a CoreBlockedAt row are not adjacent).
template <typename T, typename At>
__device__ __forceinline__ void load8_at(const T* tile, At at, int r, int k, float (&v)[8]) {
  if constexpr (std::is_same<T, float>::value)
    load8(tile + at(r, k), tile + at(r, k + 4), v);
  else
    load8(tile + at(r, k), v);
}
template <typename T, typename At>
__device__ __forceinline__ void store8_at(T* tile, At at, int r, int k, const float (&v)[8]) {
  if constexpr (std::is_same<T, float>::value)
    store8(tile + at(r, k), tile + at(r, k + 4), v);
  else
    store8(tile + at(r, k), v);
}

constexpr int kLnMaxLen = 256;  // vectorized path: rows up to this many elements

// One warp, rows [row0, row0 + rows) (rows a multiple of 32 / DstAt::kLanesPerRow) of a tile, element
// (r, k) of src at src[sat(r, k)], of dst at dst[dat(r, k)]:
//   dst[r][k] = normalize ? (src[r][k] - mean_r) * rstd_r * w[k] + bias[k] : src[r][k]   (k < len;
//   !kAffine: without w and bias, which are not read)
//   dst[r][k] = 0 for k in [len, len_padded), and whole rows with !valid(r) = 0.
// means (where not nullptr): means[r] = mean_r, 0 for rows with !valid(r).
// LayerNorm statistics in fp32, two passes over registers. src may be dst (each
// lane rewrites only what it read). 16-byte vectors when len % 8 == 0 and
// len <= 256 (rows' 8-element runs, w and bias 16-byte aligned), else element by element.
// kRoundTf32 (float dst): values stored rounded to tf32 (warp_mma's kARounded).
template <bool kAffine = true, bool kRoundTf32 = false, typename Ts, typename SrcAt, typename Td, typename DstAt,
          typename Valid>
__device__ __forceinline__ void warp_layer_norm_rows(const Ts* src, SrcAt sat, Td* dst, DstAt dat, int row0, int rows,
                                                     int len, int len_padded, const float* w, const float* bias,
                                                     float eps, bool normalize, Valid valid,
                                                     float* means = nullptr) {
  // lanes per row as the destination's layout wants them (the source is either
  // the destination or a row-major tile); 8-element chunks per lane
  constexpr int kLnLanesPerRow = DstAt::kLanesPerRow, kLnMaxChunks = kLnMaxLen / (8 * kLnLanesPerRow);
  constexpr int kRowsPerPass = 32 / kLnLanesPerRow;
  // a row's lanes are kRowsPerPass apart (rows fast) or adjacent: the xor offsets that sum them
  constexpr int kShflFirst = DstAt::kRowsFast ? 16 : kLnLanesPerRow / 2;
  constexpr int kShflLast = DstAt::kRowsFast ? kRowsPerPass : 1;
  const int lane = threadIdx.x % 32;
  if (len % 8 == 0 && len <= kLnMaxLen) {
    const int chunks = len / 8;
    const int q0 = DstAt::kRowsFast ? lane / kRowsPerPass : lane % kLnLanesPerRow;
    const int r_lane = DstAt::kRowsFast ? lane % kRowsPerPass : lane / kLnLanesPerRow;
    for (int r = row0 + r_lane; r < row0 + rows; r += kRowsPerPass) {
      float v[kLnMaxChunks][8];
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kLnMaxChunks; ++j) {
        const int q = q0 + j * kLnLanesPerRow;
        if (q < chunks) {
          load8_at(src, sat, r, q * 8, v[j]);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum += v[j][e];
        }
      }
#pragma unroll
      for (int o = kShflFirst; o >= kShflLast; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float mean = sum / static_cast<float>(len);
      float sq = 0.f;
#pragma unroll
      for (int j = 0; j < kLnMaxChunks; ++j)
        if (q0 + j * kLnLanesPerRow < chunks)
#pragma unroll
          for (int e = 0; e < 8; ++e) sq += (v[j][e] - mean) * (v[j][e] - mean);
#pragma unroll
      for (int o = kShflFirst; o >= kShflLast; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      const float rs = rsqrtf(sq / static_cast<float>(len) + eps);
      const bool ok = valid(r);
      if (means != nullptr && q0 == 0) means[r] = ok ? mean : 0.f;
#pragma unroll
      for (int j = 0; j < kLnMaxChunks; ++j) {
        const int q = q0 + j * kLnLanesPerRow;
        if (q >= chunks) continue;
        float o[8], wq[8], bq[8];
        if constexpr (kAffine) {
          if (ok && normalize) load8(w + q * 8, wq), load8(bias + q * 8, bq);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) wq[e] = 1.f, bq[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          o[e] = !ok ? 0.f : normalize ? (v[j][e] - mean) * rs * wq[e] + bq[e] : v[j][e];
          if constexpr (kRoundTf32) o[e] = round_tf32(o[e]);
        }
        store8_at(dst, dat, r, q * 8, o);
      }
    }
  } else {
    for (int r = row0; r < row0 + rows; ++r) {
      auto s = [&](int k) { return to_float(src[sat(r, k)]); };
      float mean = 0.f, rs = 1.f;
      if (normalize || means != nullptr) {
        float sum = 0.f;
        for (int k = lane; k < len; k += 32) sum += s(k);
        mean = warp_sum(sum) / static_cast<float>(len);
      }
      if (normalize) {
        float sq = 0.f;
        for (int k = lane; k < len; k += 32) sq += (s(k) - mean) * (s(k) - mean);
        rs = rsqrtf(warp_sum(sq) / static_cast<float>(len) + eps);
      }
      const bool ok = valid(r);
      if (means != nullptr && lane == 0) means[r] = ok ? mean : 0.f;
      for (int k = lane; k < len; k += 32) {
        const float v = s(k);
        float o;
        if constexpr (kAffine)
          o = !ok ? 0.f : normalize ? (v - mean) * rs * w[k] + bias[k] : v;
        else
          o = !ok ? 0.f : normalize ? (v - mean) * rs : v;
        dst[dat(r, k)] = from_float<Td>(kRoundTf32 ? round_tf32(o) : o);
      }
    }
  }
  for (int r = row0; r < row0 + rows; ++r)
    for (int k = len + lane; k < len_padded; k += 32) dst[dat(r, k)] = from_float<Td>(0.f);
}
template <bool kAffine = true, bool kRoundTf32 = false, typename Ts, typename Td, typename Valid>
__device__ __forceinline__ void warp_layer_norm_rows(const Ts* src, int lds, Td* dst, int ldd, int row0, int rows,
                                                     int len, int len_padded, const float* w, const float* bias,
                                                     float eps, bool normalize, Valid valid,
                                                     float* means = nullptr) {
  warp_layer_norm_rows<kAffine, kRoundTf32>(src, RowMajorAt{lds}, dst, RowMajorAt{ldd}, row0, rows, len, len_padded,
                                            w, bias, eps, normalize, valid, means);
}

// LayerNorm statistics over the rows h < H of an h-major tile, tile[h * ld + j]
// (positions j contiguous), each warp for kQ pairs of positions (kQ = 4 or 8; warp
// w of the tile's warps takes pairs kQ w .. kQ w + kQ - 1): ColumnStatsLane<kQ> gives a
// thread's pair (positions 2 pair, 2 pair + 1) and its part of h, part p of the 32 / kQ
// parts taking h = p kQ / 4 + j (mod 8), j < kQ / 4. With ld = 8 (mod 64) elements of a
// 16-bit type (a row 4 words past a multiple of 32 banks) every load of the warp meets
// 32 distinct banks. The parts are summed by shuffles in a fixed order; two passes
// (mean, then centred squares). Returns the (mean, rstd) of the thread's two positions
// in mean and rstd (x: position 2 pair, y: 2 pair + 1), the same in every part. Every
// lane of a warp calls it.
template <int kQ>
struct ColumnStatsLane {
  static_assert(kQ == 4 || kQ == 8, "pairs per warp");
  static __device__ __forceinline__ int pair(int warp) { return warp * kQ + static_cast<int>(threadIdx.x) % kQ; }
  static __device__ __forceinline__ int part() { return threadIdx.x % 32 / kQ; }
};
template <int kQ, typename T>
__device__ __forceinline__ void warp_pair_column_stats(const T* tile, int ld, int H, float eps, int warp, float2& mean,
                                                       float2& rstd) {
  using V2 = Vec2<T>;
  constexpr int kSub = kQ / 4;  // rows h of a part among every 8
  const int h_first = ColumnStatsLane<kQ>::part() * kSub;
  // (h, 2 pair) at col[h * ld / 2]
  const auto* col = reinterpret_cast<const typename V2::type*>(tile) + ColumnStatsLane<kQ>::pair(warp);
  auto over_parts = [&](float2 v) {
#pragma unroll
    for (int o = kQ; o < 32; o <<= 1) {
      v.x += __shfl_xor_sync(0xffffffffu, v.x, o);
      v.y += __shfl_xor_sync(0xffffffffu, v.y, o);
    }
    return make_float2(v.x / static_cast<float>(H), v.y / static_cast<float>(H));
  };
  // the mean of term(c) over the column: each lane sums its part, the shuffles add the parts
  auto column_mean = [&](auto term) {
    float2 acc = make_float2(0.f, 0.f);
    for (int h8 = 0; h8 < H; h8 += 8)
#pragma unroll
      for (int j = 0; j < kSub; ++j) {
        const int h = h8 + h_first + j;
        if (h < H) {
          const float2 v = term(V2::unpack(col[h * (ld / 2)]));
          acc.x += v.x, acc.y += v.y;
        }
      }
    return over_parts(acc);
  };
  mean = column_mean([](float2 v) { return v; });
  const float2 var = column_mean([&](float2 v) {
    return make_float2((v.x - mean.x) * (v.x - mean.x), (v.y - mean.y) * (v.y - mean.y));
  });
  rstd = make_float2(rsqrtf(var.x + eps), rsqrtf(var.y + eps));
}

// LayerNorm statistics (mean, rstd) of one row of `len` elements of a shared-memory
// tile, by lanes l and l ^ 8 of a warp (every lane of the warp calls it, each pair with
// its row): lane l takes the 8-element runs (elements, where len % 8 != 0) q with
// q % 2 == (l >> 3) % 2, and the pair adds its sums by one shuffle per pass; two passes
// (mean, then centred squares), 16-byte reads where len % 8 == 0 (the row 16-byte
// aligned). With the rows of lanes 0-7 (and 16-23) consecutive rows of a padded tile
// (row stride 16 bytes past a multiple of 128), each quarter warp meets distinct banks.
template <typename T>
__device__ __forceinline__ float2 paired_row_stats(const T* row, int len, float eps) {
  const int half = (threadIdx.x >> 3) & 1;
  float sum = 0.f;
  if (len % 8 == 0) {
    for (int k = 8 * half; k < len; k += 16) {
      float v[8];
      load8(row + k, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += v[e];
    }
  } else {
    for (int k = half; k < len; k += 2) sum += to_float(row[k]);
  }
  sum += __shfl_xor_sync(0xffffffffu, sum, 8);
  const float mean = sum / static_cast<float>(len);
  float sq = 0.f;
  if (len % 8 == 0) {
    for (int k = 8 * half; k < len; k += 16) {
      float v[8];
      load8(row + k, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) sq += (v[e] - mean) * (v[e] - mean);
    }
  } else {
    for (int k = half; k < len; k += 2) sq += (to_float(row[k]) - mean) * (to_float(row[k]) - mean);
  }
  sq += __shfl_xor_sync(0xffffffffu, sq, 8);
  return make_float2(mean, rsqrtf(sq / static_cast<float>(len) + eps));
}

// The kBiasCols bias columns (OperandLayout) of rows [row0, row0 + rows) of a
// [row][k] operand tile, at k = len: one(r) each, 1 to add the bias, 0 for a
// row whose products must vanish. One lane per row; the warp that wrote the
// rows' other columns calls it.
template <typename T, typename At, typename One>
__device__ __forceinline__ void warp_bias_columns(T* dst, At at, int row0, int rows, int len, One one) {
  __syncwarp();
  for (int r = row0 + static_cast<int>(threadIdx.x % 32); r < row0 + rows; r += 32) {
    const T v = from_float<T>(one(r));
#pragma unroll
    for (int k = 0; k < kBiasCols; ++k) dst[at(r, len + k)] = v;
  }
  __syncwarp();
}

}  // namespace trimul
