// pack_params: gathers every parameter into one fp32 workspace (PackedLayout),
// converting dtype and strides and filling in the defaults of missing ones.
// One launch; a grid-stride loop walks all entries.
#include "common.cuh"

namespace trimul {

PackedLayout packed_layout(int64_t P, int64_t H) {
  PackedLayout l{};
  int64_t at = 0;
  auto take = [&](int64_t n) { const int64_t o = at; at += n; return o; };
  l.ln_in_w = take(P);
  l.ln_in_b = take(P);
  l.w_in = take(4 * H * P);
  l.b_in = take(4 * H);
  l.ln_out_w = take(H);
  l.ln_out_b = take(H);
  l.w_out = take(P * H);
  l.b_out = take(P);
  l.w_gate = take(P * P);
  l.b_gate = take(P);
  l.total = at;
  return l;
}

__global__ void pack_params_kernel(const PackParams p) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int e = 0; e < p.count; ++e) {
    const PackEntry& d = p.entry[e];
    const int64_t n = d.rows * d.cols;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
      const int64_t r = i / d.cols, c = i % d.cols;
      const float v = d.ptr ? load_any(d.ptr, d.dtype, r * d.stride_r + c * d.stride_c) : d.fill;
      p.dst[d.offset + r * d.dst_row_stride + c] = v;
    }
  }
}

cudaError_t launch_pack_params(const PackParams& p, cudaStream_t stream) {
  int64_t largest = 1;
  for (int e = 0; e < p.count; ++e) largest = std::max(largest, p.entry[e].rows * p.entry[e].cols);
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(largest, kThreads), 1024));
  pack_params_kernel<<<blocks, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace trimul
