// Host side of tma.cuh: tensor maps encoded by the driver's cuTensorMapEncodeTiled, reached
// through the runtime's entry-point query (no link to the driver library).
#include <cudaTypedefs.h>

#include "tma.cuh"

namespace trimul {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

cudaError_t encode_map_16bit(CUtensorMap* map, const void* base, bool bf16, const int64_t (&dims)[4],
                             const int64_t (&strides)[3], const uint32_t (&box)[4]) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr) return cudaErrorNotSupported;
  constexpr int kElementBytes = 2;
  cuuint64_t global_dims[4], global_strides[3];
  cuuint32_t box_dims[4], element_strides[4] = {1, 1, 1, 1};
  for (int d = 0; d < 4; ++d) global_dims[d] = static_cast<cuuint64_t>(dims[d]), box_dims[d] = box[d];
  for (int d = 0; d < 3; ++d) global_strides[d] = static_cast<cuuint64_t>(strides[d]) * kElementBytes;
  const CUresult r = encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
                            const_cast<void*>(base), global_dims, global_strides, box_dims, element_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace trimul
