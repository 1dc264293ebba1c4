// The exponents of precision tf32 on the fp16 stages (trimul.h: RangeScales), as the kernels
// that apply or undo them read them from the device.
#pragma once

#include "../trimul.h"

namespace trimul {

constexpr int kRangeMaxLog2 = 60;       // |exponent| of the stored weights' scales
constexpr int kRangeMaxEpsLog2 = 120;  // c's LayerNorm eps at most eps 2^120 (finite in fp32)

// The least e with v <= 2^e for the bits of a positive finite float v; 0 for anything else.
__device__ __forceinline__ int ceil_log2_bits(uint32_t bits) {
  const float v = __uint_as_float(bits);
  if (!(v > 0.f) || !isfinite(v)) return 0;
  int e;
  const float f = frexpf(v, &e);  // v = f 2^e, f in [0.5, 1)
  return f == 0.5f ? e - 1 : e;
}
__device__ __forceinline__ int range_proj_log2(const RangeScales& s) {
  return max(-kRangeMaxLog2, min(kRangeMaxLog2, s.ab_log2 - ceil_log2_bits(s.proj_bound)));
}
__device__ __forceinline__ int range_out_log2(const RangeScales& s) {
  return max(-kRangeMaxLog2, min(kRangeMaxLog2, kRangeOutLog2 - ceil_log2_bits(s.out_bound)));
}
// (only ever down, and 0 unless the gates' bound passes 2^kRangeGateLog2: the input stage's common
// epilogue has no unscaling in it. A gate weight below fp16's normal range is stored to within
// 2^-24 absolute, which moves its gate's argument by no more than that times |xhat|.)
__device__ __forceinline__ int range_gate_log2(const RangeScales& s) {
  return max(-kRangeMaxLog2, min(0, kRangeGateLog2 - ceil_log2_bits(s.gate_bound)));
}
// what a gate's product is multiplied by before its tanh (its weights stored times 2^gate_log2)
__device__ __forceinline__ float range_gate_unscale(const RangeScales& s) { return ldexpf(1.f, -range_gate_log2(s)); }
// the mask's values as the input stage multiplies them: times 2^-e, max |mask| 2^-e <= 1
__device__ __forceinline__ float range_mask_scale(const RangeScales& s) {
  return ldexpf(1.f, -ceil_log2_bits(s.mask_amax));
}
// a and b come out times 2^d, d = proj_log2 - e (the mask's values times 2^-e)
__device__ __forceinline__ int range_ab_scale_log2(const RangeScales& s) {
  return range_proj_log2(s) - ceil_log2_bits(s.mask_amax);
}
// c's exponent: 2 d
__device__ __forceinline__ int range_c_log2(const RangeScales& s) { return 2 * range_ab_scale_log2(s); }
// dc's exponent in the backward (GradScale): its largest magnitude to at most 2^kRangeGradLog2,
// within what keeps 2^grad_log2 and the unscaling 2^-(grad_log2 + d) normal fp32 numbers
__device__ __forceinline__ int range_grad_log2(const GradScale& g, const RangeScales& s) {
  constexpr int kNormalLog2 = 126;
  const int d = range_ab_scale_log2(s);
  const int lo = max(-kNormalLog2, -kNormalLog2 - d), hi = min(kNormalLog2, kNormalLog2 - d);
  return max(lo, min(hi, kRangeGradLog2 - ceil_log2_bits(g.amax)));
}
// c's LayerNorm eps: c's variance arrives times 2^(4 d)
__device__ __forceinline__ float range_c_eps(float eps, const RangeScales& s) {
  return ldexpf(eps, min(2 * range_c_log2(s), kRangeMaxEpsLog2));
}

// c's headroom at fp16 operands (trimul.h, kHeadroomMaxLog2): a and b are stored times 2^-t
__device__ __forceinline__ int range_headroom_log2(const RangeScales& s) {
  const int t = ceil_log2_bits(s.proj_bound) + ceil_log2_bits(s.mask_amax) - s.ab_log2;
  return max(0, min(kHeadroomMaxLog2, t));
}
// 2^-e for e in [0, 126] (a normal float: its exponent bits alone)
__device__ __forceinline__ float pow2_neg(int e) { return __int_as_float((127 - e) << 23); }
// What the projections are multiplied by under c's headroom: 2^-t
__device__ __forceinline__ float range_headroom_scale(const RangeScales& s) {
  return pow2_neg(range_headroom_log2(s));
}
// The same where the headroom is optional (nullptr: none, a factor of 1)
__device__ __forceinline__ float headroom_scale(const RangeScales* headroom) {
  return headroom != nullptr ? range_headroom_scale(*headroom) : 1.f;
}
// c's LayerNorm eps as the output stage takes it (Problem::headroom): c's variance arrives times
// 2^-4t under the headroom
__device__ __forceinline__ float headroom_c_eps(float eps, const RangeScales* headroom) {
  return headroom != nullptr ? eps * pow2_neg(4 * range_headroom_log2(*headroom)) : eps;
}

}  // namespace trimul
