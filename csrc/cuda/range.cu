// Precision tf32 on the fp16 stages (trimul.h: RangeScales). Two small kernels ahead of the
// 16-bit pipeline: the bounds of the projections and of the output from the parameters
// (range_bounds), and x normalized into fp16 with the mask's largest magnitude
// (range_normalize); for the tf32 backward, the largest magnitude of dc (GradScale); and at fp16
// operands, c's headroom from the projections' bound and the mask (range_headroom). The stages
// read the exponents through range.cuh.
#include <algorithm>

#include "common.cuh"
#include "range.cuh"

namespace trimul {
namespace {

constexpr int kWarps = kThreads / 32;  // (common.cuh's block size)
constexpr int kMaxRowValues = 128;  // range_normalize: P <= 128, 4 values a lane

// The block's largest of v (v >= 0 or NaN-free: the callers pass finite magnitudes), then one
// atomicMax of its bits (non-negative floats order as their bits).
__device__ void block_max_into(float v, uint32_t* dst) {
  __shared__ float warp_max[kWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = 0.f;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, warp_max[w]);
    if (m > 0.f) atomicMax(dst, __float_as_uint(m));
  }
}

// A magnitude bound as range_bounds takes it: non-finite values (inf or NaN parameters, whose
// results are not finite either) count as 0, so they do not move the exponents.
__device__ __forceinline__ float finite_or_zero(float v) { return isfinite(v) ? v : 0.f; }

// A warp's bound of |W_r . (v * gamma + beta) + bias| over every v with |v| <= sqrt(len):
// sqrt(len) |W_r * gamma| + |W_r . beta + bias| (Cauchy-Schwarz), non-finite as 0; without the
// affine (gamma, beta nullptr) that of |W_r . v + bias|.
__device__ float row_bound(const PackEntry& w, int r, const PackEntry* gamma, const PackEntry* beta, float bias,
                           int len) {
  const int lane = threadIdx.x % 32;
  float sq = 0.f, shift = 0.f;
  for (int c = lane; c < len; c += 32) {
    const float wv = entry_value(w, r, c);
    const float wg = gamma != nullptr ? wv * entry_value(*gamma, 0, c) : wv;
    sq += wg * wg;
    if (beta != nullptr) shift += wv * entry_value(*beta, 0, c);
  }
  sq = warp_sum(sq);
  shift = warp_sum(shift) + bias;
  return finite_or_zero(sqrtf(static_cast<float>(len)) * sqrtf(sq) + fabsf(shift));
}

// Row `row` of the input stage's four matrices: rows [0, 2H) are the projections' (proj_a's h,
// then proj_b's), rows [2H, 4H) the input gates' (gate_a's, then gate_b's); a warp's bound of its
// value (row_bound with the input LayerNorm's affine).
__device__ float in_row_bound(const PackEntry* e, int row, int H, int P) {
  // quarter 0..3: proj_a, proj_b, gate_a, gate_b, whose entries (trimul.forward's order, each
  // weight followed by its bias) are kParamWIn + 0, 4, 2, 6
  const int h = row % H, quarter = row / H, src = kParamWIn + 4 * (quarter % 2) + 2 * (quarter / 2);
  return row_bound(e[src], h, &e[kParamLnInW], &e[kParamLnInB], entry_value(e[src + 1], h, 0), P);
}

// Block k takes kWarps rows, a warp each: rows [0, 4H) in_row_bound's, rows [4H, 4H + P) w_gate's
// (the output gate's, reading xhat as the input stage does), rows [4H + P, 4H + 2P) w_out's.
__global__ void range_bounds_kernel(const PackParams p, int P, int H, int ab_log2, bool has_mask, bool gate_folded,
                                    RangeScales* scales) {
  const PackEntry* e = p.entry;
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    scales->ab_log2 = ab_log2;
    if (!has_mask) atomicMax(&scales->mask_amax, __float_as_uint(1.f));
  }
  float proj = 0.f, gate = 0.f, out = 0.f;
  if (row < 4 * H) {
    (row < 2 * H ? proj : gate) = in_row_bound(e, row, H, P);
  } else if (row < 4 * H + P) {
    // (the gate from x: its stored weights' bound, as if x were xhat, without the affine)
    const int j = row - 4 * H;
    gate = row_bound(e[kParamWGate], j, gate_folded ? &e[kParamLnInW] : nullptr,
                     gate_folded ? &e[kParamLnInB] : nullptr, entry_value(e[kParamBGate], 0, j), P);
  } else if (row < 4 * H + 2 * P) {
    const int j = row - 4 * H - P;
    out = row_bound(e[kParamWOut], j, &e[kParamLnOutW], &e[kParamLnOutB], entry_value(e[kParamBOut], 0, j), H);
  }
  block_max_into(proj, &scales->proj_bound);
  __syncthreads();
  block_max_into(gate, &scales->gate_bound);
  __syncthreads();
  block_max_into(out, &scales->out_bound);
}

// The mask's loads a thread keeps in flight together (range_headroom): a row's elements j,
// j + kThreads, ... issued before the first is compared.
constexpr int kMaskLoadsInFlight = 4;

// c's headroom (RangeHeadroomParams): blocks [0, proj_blocks) bound the projection rows (a warp
// each, in_row_bound's rows [0, 2H)), the others take rows (b, i) of the mask in a grid stride,
// their threads over j, kMaskLoadsInFlight loads at a time.
__global__ void range_headroom_kernel(const RangeHeadroomParams p, int proj_blocks, int ab_log2) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    p.scales->ab_log2 = ab_log2;
    if (p.mask == nullptr) atomicMax(&p.scales->mask_amax, __float_as_uint(1.f));
  }
  const int block = static_cast<int>(blockIdx.x);
  if (block < proj_blocks) {
    const int row = block * kWarps + static_cast<int>(threadIdx.x) / 32, H = static_cast<int>(p.H);
    block_max_into(row < 2 * H ? in_row_bound(p.pack.entry, row, H, static_cast<int>(p.P)) : 0.f,
                   &p.scales->proj_bound);
    return;
  }
  float m = 0.f;
  const int64_t rows = p.B * p.N, stride = static_cast<int64_t>(gridDim.x) - proj_blocks;
  for (int64_t r = block - proj_blocks; r < rows; r += stride) {
    const int64_t b = r / p.N, i = r - b * p.N, at = b * p.mask_stride_b + i * p.mask_stride_i;
    for (int64_t j0 = threadIdx.x; j0 < p.N; j0 += kMaskLoadsInFlight * kThreads) {
      float v[kMaskLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kMaskLoadsInFlight; ++u) {
        const int64_t j = j0 + u * kThreads;
        v[u] = j < p.N ? load_any(p.mask, p.mask_dtype, at + j * p.mask_stride_j) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < kMaskLoadsInFlight; ++u) m = fmaxf(m, finite_or_zero(fabsf(v[u])));
    }
  }
  block_max_into(m, &p.scales->mask_amax);
}

// 2^-t as an fp32 value, once range_headroom_kernel's atomics are done (the launch after it)
__global__ void range_headroom_scale_kernel(const RangeScales* scales, float* scale) {
  *scale = range_headroom_scale(*scales);
}

// A warp per kRows positions at a time (their loads in flight together), lane l holding columns
// 4 l .. 4 l + 3 of each (P % 4 == 0, P <= 128, rows 16-byte aligned); grid-stride.
constexpr int kRows = 4;
// kStats: x's statistics into p.x_stats too (the gate from x), the second times the gate's
// unscaling 2^-gate_log2.
template <bool kStats>
__global__ void range_normalize_kernel(const RangeNormalizeParams p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t positions = p.B * p.N * p.N;
  const int P = static_cast<int>(p.P);
  const bool lane_in = 4 * lane < P;
  const float inv_p = 1.f / static_cast<float>(P);
  // (range_bounds ran first: the gate's scale is known)
  const float gate_unscale = kStats ? range_gate_unscale(*p.scales) : 1.f;
  float mask_max = 0.f;
  for (int64_t pos0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kRows; pos0 < positions;
       pos0 += static_cast<int64_t>(gridDim.x) * kWarps * kRows) {
    float4 v[kRows];
    float m[kRows];
    // (b, i, j) of pos0 by two divisions, then stepped (64-bit divisions per position were most of
    // the kernel's instructions)
    const int64_t row0 = pos0 / p.N;
    int64_t j = pos0 - row0 * p.N, b = row0 / p.N, i = row0 - b * p.N;
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t pos = pos0 + u;
      if (u > 0 && ++j == p.N) {
        j = 0;
        if (++i == p.N) i = 0, ++b;
      }
      const bool in = pos < positions;
      const float* row = p.x + b * p.x_stride_b + i * p.x_stride_i + j * p.x_stride_j;
      v[u] = in && lane_in ? *reinterpret_cast<const float4*>(row + 4 * lane) : make_float4(0.f, 0.f, 0.f, 0.f);
      m[u] = in && p.mask != nullptr && lane == u
                 ? load_any(p.mask, p.mask_dtype, b * p.mask_stride_b + i * p.mask_stride_i + j * p.mask_stride_j)
                 : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kRows; ++u) {
      const int64_t pos = pos0 + u;
      const float mean = warp_sum((v[u].x + v[u].y) + (v[u].z + v[u].w)) * inv_p;
      const float d0 = v[u].x - mean, d1 = v[u].y - mean, d2 = v[u].z - mean, d3 = v[u].w - mean;
      const float sq = lane_in ? (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3) : 0.f;
      const float rs = rsqrtf(warp_sum(sq) * inv_p + p.eps);
      if (kStats && pos < positions && lane == 0)
        *reinterpret_cast<float2*>(p.x_stats + 2 * pos) = make_float2(-mean * rs, gate_unscale / rs);
      if (pos < positions && lane_in) {
        const __half2 lo = __floats2half2_rn(d0 * rs, d1 * rs), hi = __floats2half2_rn(d2 * rs, d3 * rs);
        uint2 packed;
        packed.x = *reinterpret_cast<const uint32_t*>(&lo);
        packed.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(static_cast<__half*>(p.xhat) + pos * P + 4 * lane) = packed;
      }
      const float a = fabsf(m[u]);
      if (isfinite(a)) mask_max = fmaxf(mask_max, a);
    }
  }
  if (p.mask != nullptr) block_max_into(mask_max, &p.scales->mask_amax);
}

// The largest finite |value| of src (count4 float4s) into g->amax; grid-stride, 16-byte loads.
__global__ void range_grad_amax_kernel(const float4* src, int64_t count4, GradScale* g) {
  float m = 0.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < count4;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float4 v = src[i];
    m = fmaxf(m, fmaxf(fmaxf(finite_or_zero(fabsf(v.x)), finite_or_zero(fabsf(v.y))),
                       fmaxf(finite_or_zero(fabsf(v.z)), finite_or_zero(fabsf(v.w)))));
  }
  block_max_into(m, &g->amax);
}

}  // namespace

cudaError_t launch_range_grad_amax(const float* src, int64_t count, GradScale* g, int sm_count, cudaStream_t stream) {
  if (count % 4 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  const int64_t blocks = std::clamp<int64_t>(ceil_div(count / 4, kThreads), 1, int64_t{sm_count} * 8);
  range_grad_amax_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const float4*>(src), count / 4, g);
  return cudaGetLastError();
}

cudaError_t launch_range_scales(const PackParams& p, int64_t N, int64_t P, int64_t H, RangeScales* out,
                                bool has_mask, bool gate_folded, cudaStream_t stream) {
  const int64_t blocks = ceil_div(4 * H + 2 * P, kWarps);
  range_bounds_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      p, static_cast<int>(P), static_cast<int>(H), range_ab_log2(N), has_mask, gate_folded, out);
  return cudaGetLastError();
}

cudaError_t launch_range_headroom(const RangeHeadroomParams& p, int sm_count, cudaStream_t stream) {
  // a block per row of the mask, up to kMaskBlocksPerSm an SM (one atomicMax a block)
  constexpr int64_t kMaskBlocksPerSm = 4;  // (58 registers a thread: four blocks of 256 resident)
  const int64_t proj_blocks = ceil_div(2 * p.H, kWarps);
  const int64_t mask_blocks =
      p.mask == nullptr ? 0 : std::clamp<int64_t>(p.B * p.N, 1, int64_t{sm_count} * kMaskBlocksPerSm);
  range_headroom_kernel<<<static_cast<unsigned>(proj_blocks + mask_blocks), kThreads, 0, stream>>>(
      p, static_cast<int>(proj_blocks), range_ab_log2(p.N));
  if (p.scale != nullptr) range_headroom_scale_kernel<<<1, 1, 0, stream>>>(p.scales, p.scale);
  return cudaGetLastError();
}

cudaError_t launch_range_normalize(const RangeNormalizeParams& p, int sm_count, cudaStream_t stream) {
  if (p.P % 4 != 0 || p.P > kMaxRowValues) return cudaErrorInvalidValue;
  const int64_t positions = p.B * p.N * p.N;
  const int64_t blocks = std::clamp<int64_t>(ceil_div(positions, kWarps * kRows), 1, int64_t{sm_count} * 8);
  if (p.x_stats != nullptr)
    range_normalize_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  else
    range_normalize_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace trimul
