// The parameters as the stages read them, in one launch (pack_kernel):
// pack_params gathers every parameter into one fp32 workspace (PackedLayout),
// converting dtype and strides and filling in the defaults of missing ones, a
// run of blocks per entry so every entry's loads are in flight at once (one
// after the other, 16 entries took ~12 us on the H200); pack_operands and
// out_fold make the zero-padded weight copies of the tensor-core stages in
// their operand type (OperandLayout) and their folded sums, from the same
// sources side by side (as three launches, each waiting for the last, they took
// ~7.7 us of the GPU and three launches' host time at N = 256).
#include <algorithm>

#include "common.cuh"
#include "mma.cuh"

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

OperandLayout operand_layout(int64_t P, int64_t H, int64_t elem_bytes, bool in_blocked, bool gate_folded) {
  OperandLayout l{};
  l.in_blocked = in_blocked;
  l.gate_folded = gate_folded;
  l.kin = round16(P + kBiasCols);
  l.kp = round16(P);
  l.kh = round16(H);
  l.pad = kOperandRowPadBytes / elem_bytes;
  l.in_rows = ceil_div(4 * H, kOperandRowTile) * kOperandRowTile;
  l.out_rows = ceil_div(P, kOperandRowTile) * kOperandRowTile;
  l.w_in = 0;
  l.w_out = l.w_in + l.in_rows * (l.kin + l.pad);
  l.w_gate = l.w_out + l.out_rows * (l.kh + l.pad);
  l.out_fold = l.w_gate + l.out_rows * (l.kp + l.pad);
  l.total = l.out_fold + kOutFolds * l.kp * static_cast<int64_t>(sizeof(float)) / elem_bytes;
  return l;
}

// k_paired_position permutes a row's columns (the resident input stage's widths and a few others).
constexpr bool k_paired_is_permutation(int64_t kin) {
  bool seen[256] = {};
  for (int64_t c = 0; c < kin; ++c) {
    const int64_t k = k_paired_position(c, kin);
    if (k < 0 || k >= kin || seen[k]) return false;
    seen[k] = true;
  }
  return true;
}
static_assert(k_paired_is_permutation(16) && k_paired_is_permutation(32) && k_paired_is_permutation(48) &&
                  k_paired_is_permutation(128) && k_paired_is_permutation(144) && k_paired_is_permutation(256),
              "k_paired_position must permute the columns");

// The leading part of an fp32 value in operand type T: T's rounding, or tf32's
// for float operands (which the products read as tf32).
template <typename T>
__device__ __forceinline__ float leading_part(float v) {
  return to_float(from_float<T>(v));
}
template <>
__device__ __forceinline__ float leading_part<float>(float v) {
  return round_tf32(v);
}

// Element (r, c) of a pack entry's source as fp32, or its fill where the parameter is missing:
// the value pack_params stores for it.
__device__ __forceinline__ float entry_value(const PackEntry& d, int r, int c) {
  return d.ptr ? load_any(d.ptr, d.dtype, r * d.stride_r + c * d.stride_c) : d.fill;
}

// A value of the stored matrices as the operand tiles hold it.
template <typename T>
__device__ __forceinline__ T stored(float v, const OperandLayout& ol) {
  return from_float<T>(std::is_same<T, float>::value && ol.tf32_rounded ? round_tf32(v) : v);
}

// Elements (r, c) of the stored w_out and w_gate before their rounding (the operand copies and
// the folds' row sums both take them from here): at half scale, w_out times the output
// LayerNorm's scale, w_gate times the input one's where the gate is folded. (e: the pack's
// entries in trimul.forward's order.)
__device__ __forceinline__ float w_out_value(const PackEntry* e, int r, int c) {
  return kOperandScale * entry_value(e[kParamWOut], r, c) * entry_value(e[kParamLnOutW], 0, c);
}
__device__ __forceinline__ float w_gate_value(const PackEntry* e, const OperandLayout& ol, int r, int c) {
  const float v = kOperandScale * entry_value(e[kParamWGate], r, c);
  return ol.gate_folded ? v * entry_value(e[kParamLnInW], 0, c) : v;
}

// The three parts of a pack launch, each a run of blocks (PackLaunch):
//  - pack_params: each entry a run of blocks by its size, which write its share of the fp32 pack;
//  - pack_operands: row r of a stored matrix (OperandLayout) is kOperandScale * W[r][0 .. cols)
//    (times the output LayerNorm's gamma for w_out, and the input LayerNorm's for w_gate when
//    gate_folded), for w_in followed by kOperandScale * bias[r] as hi, lo (hi the leading part);
//    zeros after (padding included). Element e of the padded-row layout lands at blocked(e) for
//    w_in when in_blocked;
//  - out_fold: warp j sums row j of the stored w_out and w_gate, and forms Wo[j] . beta_out +
//    bo[j] and (gate_folded) Wg[j] . beta_in + bg[j] (lanes over the row; a thread per row, 128
//    steps in a row, took ~13 us on the H200).
// The last two read the parameters from their sources (PackParams' entries, in trimul.forward's
// order) as the first stores them, so the three run side by side in one launch. Index math in 32
// bits (launch_pack checks the sizes): its 64-bit divisions were most of the kernel's instructions.
template <typename T>
__global__ void pack_kernel(const PackParams p, const PackLaunch run) {
  const int block = static_cast<int>(blockIdx.x);
  if (block < run.entry_start[p.count]) {
    int k = 0;
    while (block >= run.entry_start[k + 1]) ++k;
    const PackEntry& d = p.entry[k];
    const int blocks = run.entry_start[k + 1] - run.entry_start[k];
    const int cols = static_cast<int>(d.cols), n = static_cast<int>(d.rows) * cols;
    for (int i = (block - run.entry_start[k]) * kThreads + threadIdx.x; i < n; i += blocks * kThreads) {
      const int r = d.rows == 1 ? 0 : i / cols, c = d.rows == 1 ? i : i % cols;
      p.dst[d.offset + r * d.dst_row_stride + c] = entry_value(d, r, c);
    }
    return;
  }
  const OperandLayout& ol = run.ol;
  const int P = static_cast<int>(run.P), H = static_cast<int>(run.H);
  T* const dst = static_cast<T*>(run.operands);
  const PackEntry* const e = p.entry;
  const int op_block = block - run.entry_start[p.count];
  if (op_block < run.operand_blocks) {
    const int end = static_cast<int>(ol.out_fold), kin = static_cast<int>(ol.kin);
    const int w_out_at = static_cast<int>(ol.w_out), w_gate_at = static_cast<int>(ol.w_gate);
    for (int i = op_block * kThreads + threadIdx.x; i < end; i += run.operand_blocks * kThreads) {
      // which matrix: w_in (rows 4h + q: proj_a, gate_a, proj_b, gate_b), w_out or w_gate
      int base = static_cast<int>(ol.w_in), ld = kin, rows = 4 * H, cols = P;
      if (i >= w_gate_at) {
        base = w_gate_at, ld = static_cast<int>(ol.kp), rows = P, cols = P;
      } else if (i >= w_out_at) {
        base = w_out_at, ld = static_cast<int>(ol.kh), rows = P, cols = H;
      }
      const int pad = static_cast<int>(ol.pad);
      ld += pad;
      const int r = (i - base) / ld, c = (i - base) % ld;
      float v = 0.f;
      if (r < rows && c < cols) {
        if (base == ol.w_in) {
          v = kOperandScale * entry_value(e[kParamWIn + 2 * (r % 4)], r / 4, c);
        } else if (base == ol.w_out) {
          v = w_out_value(e, r, c);
        } else {
          v = w_gate_value(e, ol, r, c);
        }
      } else if (base == ol.w_in && r < rows && c < cols + kBiasCols) {
        const float full = kOperandScale * entry_value(e[kParamWIn + 2 * (r % 4) + 1], r / 4, 0);
        const float hi = leading_part<T>(full);
        v = c == cols ? hi : full - hi;
      }
      int at = i;
      if (base == ol.w_in && ol.in_blocked) {  // the chunk's core matrices, then its padding
        const int chunk = r / kOperandRowTile, rr = r % kOperandRowTile;
        const int chunk_start = base + chunk * static_cast<int>(kOperandRowTile) * ld;
        const int k = ol.in_k_paired && c < kin ? static_cast<int>(k_paired_position(c, kin)) : c;
        at = c < kin ? chunk_start + CoreBlockedAt<T>{kin / CoreBlockedAt<T>::kV}(rr, k)
                     : chunk_start + static_cast<int>(kOperandRowTile) * kin + rr * pad + (c - kin);
      }
      dst[at] = stored<T>(v, ol);
    }
    return;
  }
  const int j = ((op_block - run.operand_blocks) * kThreads + static_cast<int>(threadIdx.x)) / 32;
  const int lane = threadIdx.x % 32;
  if (j >= P) return;  // whole warps: kThreads is a multiple of 32
  float s = 0.f, t = 0.f;
  for (int h = lane; h < H; h += 32) {
    s += to_float(stored<T>(w_out_value(e, j, h), ol));
    t += entry_value(e[kParamWOut], j, h) * entry_value(e[kParamLnOutB], 0, h);
  }
  float sg = 0.f, tg = 0.f;
  for (int k = lane; k < P; k += 32) {
    sg += to_float(stored<T>(w_gate_value(e, ol, j, k), ol));
    if (ol.gate_folded) tg += entry_value(e[kParamWGate], j, k) * entry_value(e[kParamLnInB], 0, k);
  }
  s = warp_sum(s);
  t = warp_sum(t);
  sg = warp_sum(sg);
  tg = warp_sum(tg);
  if (lane == 0) {
    float* fold = reinterpret_cast<float*>(dst + ol.out_fold);
    fold[j] = s;
    fold[ol.kp + j] = kOperandScale * (t + entry_value(e[kParamBOut], 0, j));
    fold[2 * ol.kp + j] = sg;
    fold[3 * ol.kp + j] = kOperandScale * (tg + entry_value(e[kParamBGate], 0, j));
  }
}

cudaError_t launch_pack(const PackParams& p, const OperandLayout* ol, int64_t P, int64_t H, void* operands,
                        DType dtype, cudaStream_t stream) {
  PackLaunch run{};
  constexpr int64_t kMaxIndex = int64_t{1} << 30;  // the kernel's 32-bit index math
  for (int e = 0; e < p.count; ++e) {
    const int64_t n = p.entry[e].rows * p.entry[e].cols;
    if (n >= kMaxIndex || p.entry[e].offset + n >= kMaxIndex) return cudaErrorInvalidValue;
    run.entry_start[e + 1] = run.entry_start[e] + static_cast<int>(std::clamp<int64_t>(ceil_div(n, kThreads), 1, 1024));
  }
  if (ol != nullptr && ol->total >= kMaxIndex) return cudaErrorInvalidValue;
  if (ol != nullptr) {
    run.ol = *ol;
    run.P = P, run.H = H;
    run.operands = operands;
    run.operand_blocks = static_cast<int>(std::min<int64_t>(ceil_div(ol->out_fold, kThreads), 1024));
    run.fold_blocks = static_cast<int>(ceil_div(P * 32, kThreads));
  }
  const int blocks = run.entry_start[p.count] + run.operand_blocks + run.fold_blocks;
  if (blocks == 0) return cudaSuccess;
  switch (ol == nullptr ? DType::f32 : dtype) {
    case DType::f16: pack_kernel<__half><<<blocks, kThreads, 0, stream>>>(p, run); break;
    case DType::bf16: pack_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(p, run); break;
    default: pack_kernel<float><<<blocks, kThreads, 0, stream>>>(p, run); break;
  }
  return cudaGetLastError();
}

}  // namespace trimul
