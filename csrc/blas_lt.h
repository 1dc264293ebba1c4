// The 16-bit contraction and its two gradients through cuBLASLt, with the kernel picked by timing
// (csrc/blas_lt.cpp). Torch-free; the binding (csrc/trimul.cpp) falls back to torch's bmm
// wherever this declines.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "trimul.h"  // GemmForm

namespace trimul {

// c[p] = a[p] b[p]^T (the forward's product), a[p] b[p] or a[p]^T b[p] (its gradients) for `batch`
// row-major Npad x Npad planes, contiguous one after another; a, b and c in bf16 (fp16 where
// `fp16`), products accumulated in fp32.
struct LtContraction {
  const void* a;
  const void* b;
  int64_t batch;
  int64_t Npad;
  bool fp16;
  GemmForm form;
  int device;  // the current device
  cudaStream_t stream;
};

// The caller's ways for the pick: `output` returns the buffer c is written to (called at most
// once, only where cuBLASLt's kernel or the pick runs); `other` runs the contraction its other way
// (torch's bmm) into a result of its own; `same` says whether output()'s contents have the bits of
// other's last result (it may synchronize).
struct LtWays {
  std::function<void*()> output;
  std::function<void()> other;
  std::function<bool()> same;
};

// Runs the contraction on the cuBLASLt kernel picked for its (device, batch, Npad, type, form) into
// ways.output() and returns true; returns false, having launched nothing, where the caller must run
// it its other way: that way timed fastest, no faster candidate gave its bits, cuBLASLt not
// loadable, `TRIMUL_BLASLT=0` in the environment, no candidate without workspace and split k, a
// failed call, or a stream under capture before its size was picked. The pick happens at the first
// call of a size outside capture: the other way and cuBLASLt's candidates (up to kLtCandidates of
// its heuristic's list) timed on the call's operands; of the candidates that beat the other way by
// kLtPickMargin, the fastest (the first in cuBLASLt's order among those within that margin of the
// fastest) whose result has the other way's bits on those operands is kept, so a size's results do
// not depend on which kernel a process picked. That first call synchronizes its stream; where it
// returns false, the other way's last result (made by `other` during the pick) is the product.
bool lt_contraction(const LtContraction& g, const LtWays& ways);

// Whether cuBLASLt was found and is not turned off by `TRIMUL_BLASLT=0`.
bool lt_available();

// A size's pick: `rank` the kept candidate's place in cuBLASLt's heuristic list (0 its first), -1
// where none was kept; `candidates` the number timed besides the other way; `differed` the number
// of candidates faster than it by the margin whose result did not have its bits, or whose call
// failed, when checked (not kept).
struct LtPick {
  bool picked = false;
  int rank = -1;
  int candidates = 0;
  int differed = 0;
};
LtPick lt_pick(int device, int64_t batch, int64_t Npad, bool fp16, GemmForm form);

}  // namespace trimul
