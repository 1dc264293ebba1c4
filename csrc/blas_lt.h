// The 16-bit forward's contraction through cuBLASLt, with the kernel picked by timing
// (csrc/blas_lt.cpp). Torch-free; the binding (csrc/trimul.cpp) falls back to torch's bmm
// wherever this declines.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

namespace trimul {

// c[p] = a[p] b[p]^T for `batch` row-major Npad x Npad planes, contiguous one after another;
// a, b and c in bf16 (fp16 where `fp16`), products accumulated in fp32.
struct LtContraction {
  const void* a;
  const void* b;
  int64_t batch;
  int64_t Npad;
  bool fp16;
  int device;  // the current device
  cudaStream_t stream;
};

// Runs the contraction on the cuBLASLt kernel picked for its (device, batch, Npad, type) into the
// buffer `output` returns (called once, only where the contraction or its pick runs here) and
// returns true; returns false, having launched nothing, where the caller must run it its other way
// (`other`: torch's bmm): that way timed fastest, cuBLASLt not loadable, `TRIMUL_BLASLT=0` in the
// environment, no candidate without workspace and split k, a failed call, or a stream under
// capture before its size was picked. The pick happens at the first call of a size outside
// capture: `other` and cuBLASLt's candidates (up to kLtCandidates of its heuristic's list) timed
// on the call's operands, a candidate kept where it beats `other` by kLtPickMargin. That first
// call synchronizes its stream.
bool lt_contraction(const LtContraction& g, const std::function<void*()>& output, const std::function<void()>& other);

// Whether cuBLASLt was found and is not turned off by `TRIMUL_BLASLT=0`.
bool lt_available();

// A size's pick: `rank` the kept candidate's place in cuBLASLt's heuristic list (0 its first), -1
// where the other way was fastest or nothing was timed; `candidates` the number timed besides it.
struct LtPick {
  bool picked = false;
  int rank = -1;
  int candidates = 0;
};
LtPick lt_pick(int device, int64_t batch, int64_t Npad, bool fp16);

}  // namespace trimul
