// triangle_gemm: the O(N^3) contraction, a batched tensor-core GEMM.
//
//   c[bh][i][j] = sum_k a[bh][i][k] * b[bh][j][k]      bh over (batch, h)
//
// Both operands have k contiguous ("TN"), the layout tensor cores read best;
// ln_proj_gate writes them that way for either direction. All three extents
// are Npad (a multiple of kSpatialAlign; padding is zero), so every access is
// 16-byte aligned. CUTLASS 2.x sm80 kernels (mma.sync):
//   tf32          fp32 operands rounded to tf32, fp32 c
//   ieee          3xTF32 (big + small split of each operand): fp32 accuracy
//   bf16, fp16    16-bit operands and c, fp32 accumulation, in the three forms of
//                 GemmForm (the forward's product and the backward's two gradients)
// The binding takes these for fp32 products where torch's matmul would not run them as
// TF32, and for 16-bit ones where the planes are small (trimul.cpp: own_contraction):
// cuBLAS, through torch's bmm, is the faster kernel at large N.
#include <algorithm>

#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>
#include <cutlass/half.h>
#include <cutlass/gemm/device/gemm_batched.h>

#include "../trimul.h"

namespace trimul {
namespace {

constexpr int kStages = 4;
template <typename T>
using Epilogue = cutlass::epilogue::thread::LinearCombination<T, 128 / cutlass::sizeof_bits<T>::value, float, float>;
using Swizzle = cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;

template <typename MathOp, typename BlockShape, typename WarpShape>
using Gemm32 = cutlass::gemm::device::GemmBatched<
    float, RowMajor, float, ColumnMajor, float, RowMajor, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    BlockShape, WarpShape, cutlass::gemm::GemmShape<16, 8, 8>, Epilogue<float>, Swizzle, kStages, 4, 4, MathOp>;
using GemmTf32 = Gemm32<cutlass::arch::OpMultiplyAdd, cutlass::gemm::GemmShape<128, 128, 16>,
                        cutlass::gemm::GemmShape<64, 64, 16>>;
// 3xTF32 holds each fragment twice: with 64 x 32 warp tiles in 128 x 128 blocks ptxas
// spills it on sm_80 / sm_86 / sm_89 (255 registers); 128 x 64 blocks of the same warp
// tiles stay in registers on every architecture built.
using Gemm3xTf32 = Gemm32<cutlass::arch::OpMultiplyAddFastF32, cutlass::gemm::GemmShape<128, 64, 16>,
                          cutlass::gemm::GemmShape<64, 32, 16>>;

// 16-bit operands: 128 x 128 blocks of 64 x 64 warp tiles, 32-deep k steps, four stages (64 KB).
template <typename T, typename LayoutA, typename LayoutB>
using Gemm16 = cutlass::gemm::device::GemmBatched<
    T, LayoutA, T, LayoutB, T, RowMajor, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    cutlass::gemm::GemmShape<128, 128, 32>, cutlass::gemm::GemmShape<64, 64, 32>, cutlass::gemm::GemmShape<16, 8, 16>,
    Epilogue<T>, Swizzle, kStages, 8, 8, cutlass::arch::OpMultiplyAdd>;

// GemmBatched puts the batch on grid.z.
constexpr int64_t kMaxBatchPerLaunch = 65535;

template <typename Gemm>
cudaError_t run(const TriangleGemmParams& p, cudaStream_t stream) {
  using A = typename Gemm::ElementA;
  using B = typename Gemm::ElementB;
  using C = typename Gemm::ElementC;
  const int n = static_cast<int>(p.Npad);
  const int64_t plane = p.Npad * p.Npad;
  for (int64_t b0 = 0; b0 < p.batch; b0 += kMaxBatchPerLaunch) {
    const int count = static_cast<int>(std::min(p.batch - b0, kMaxBatchPerLaunch));
    const A* a = static_cast<const A*>(p.a) + b0 * plane;
    const B* b = static_cast<const B*>(p.b) + b0 * plane;
    C* c = static_cast<C*>(p.c) + b0 * plane;
    typename Gemm::Arguments args({n, n, n}, {a, n}, plane, {b, n}, plane, {c, n}, plane, {c, n}, plane,
                                  {1.f, 0.f}, count);
    Gemm gemm;
    cutlass::Status status = gemm.can_implement(args);
    if (status == cutlass::Status::kSuccess) status = gemm(args, nullptr, stream);
    if (status != cutlass::Status::kSuccess) {
      const cudaError_t e = cudaGetLastError();
      return e != cudaSuccess ? e : cudaErrorInvalidValue;
    }
  }
  return cudaGetLastError();
}

// c = a b^T, a b or a^T b: b is column-major as the product's right operand (its rows
// contiguous along k) for ab_t, row-major for the other two; a column-major for at_b.
template <typename T>
cudaError_t run_16bit(const TriangleGemmParams& p, cudaStream_t stream) {
  switch (p.form) {
    case GemmForm::ab_t: return run<Gemm16<T, RowMajor, ColumnMajor>>(p, stream);
    case GemmForm::a_b: return run<Gemm16<T, RowMajor, RowMajor>>(p, stream);
    case GemmForm::at_b: return run<Gemm16<T, ColumnMajor, RowMajor>>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_triangle_gemm(const TriangleGemmParams& p, cudaStream_t stream) {
  switch (p.precision) {
    case Precision::tf32: return p.form == GemmForm::ab_t ? run<GemmTf32>(p, stream) : cudaErrorInvalidValue;
    case Precision::ieee: return p.form == GemmForm::ab_t ? run<Gemm3xTf32>(p, stream) : cudaErrorInvalidValue;
    case Precision::bf16: return run_16bit<cutlass::bfloat16_t>(p, stream);
    case Precision::fp16: return run_16bit<cutlass::half_t>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace trimul
