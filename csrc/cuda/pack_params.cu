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
#include "range.cuh"

namespace trimul {

constexpr size_t kFoldSmemLimit = 48 * 1024;  // out_fold's staging: dynamic shared memory without an opt-in

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
  l.w_in_plain = -1;
  l.total = l.out_fold + kOutFolds * l.kp * static_cast<int64_t>(sizeof(float)) / elem_bytes;
  return l;
}

void pair_in_layout(OperandLayout& l, bool plain_copy) {
  l.in_k_paired = true;
  l.in_folded = true;
  if (plain_copy) {  // (total is 16-byte aligned: so is out_fold, and kp is a multiple of 16)
    l.w_in_plain = l.total;
    l.total += l.in_rows * (l.kin + l.pad);
  }
}

// Whether f maps [0, n) onto itself one to one (n <= kMaxPermuted).
constexpr int64_t kMaxPermuted = 256;
template <typename F>
constexpr bool permutes(int64_t n, F f) {
  bool seen[kMaxPermuted] = {};
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = f(i);
    if (k < 0 || k >= n || seen[k]) return false;
    seen[k] = true;
  }
  return true;
}
// k_paired_position permutes a row's columns (the resident input stage's widths and a few
// others), staged_in_row a chunk's rows.
constexpr bool k_paired_is_permutation(int64_t kin) {
  return permutes(kin, [kin](int64_t c) { return k_paired_position(c, kin); });
}
static_assert(k_paired_is_permutation(16) && k_paired_is_permutation(32) && k_paired_is_permutation(48) &&
                  k_paired_is_permutation(128) && k_paired_is_permutation(144) && k_paired_is_permutation(256),
              "k_paired_position must permute the columns");
static_assert(permutes(kOperandRowTile, [](int64_t r) { return staged_in_row(r); }),
              "staged_in_row must permute a chunk's rows");

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

// A value of the stored matrices as the operand tiles hold it.
template <typename T>
__device__ __forceinline__ T stored(float v, const OperandLayout& ol) {
  return from_float<T>(std::is_same<T, float>::value && ol.tf32_rounded ? round_tf32(v) : v);
}

// Whether pack entry k (trimul.forward's order) is a projection's weight or bias.
__device__ __forceinline__ bool projection_entry(int k) {
  const int q = k - kParamWIn;
  return q == 0 || q == 1 || q == 4 || q == 5;
}
// The stored weights' scales for precision tf32 on the fp16 stages (OperandLayout::range):
// w_in's projection rows (r % 4 = 0, 2: proj_a, proj_b), its gate rows (1, 3) and w_gate, and
// w_out, by their exponents (range.cuh); else the projection rows' headroom factor.
__device__ __forceinline__ float w_in_row_scale(const OperandLayout& ol, const RangeScales* headroom, int r) {
  if (ol.range == nullptr) return r % 2 == 0 ? headroom_scale(headroom) : 1.f;
  return ldexpf(1.f, r % 2 == 0 ? range_proj_log2(*ol.range) : range_gate_log2(*ol.range));
}
__device__ __forceinline__ float w_out_scale(const OperandLayout& ol) {
  return ol.range != nullptr ? ldexpf(1.f, range_out_log2(*ol.range)) : 1.f;
}
__device__ __forceinline__ float w_gate_scale(const OperandLayout& ol) {
  return ol.range != nullptr ? ldexpf(1.f, range_gate_log2(*ol.range)) : 1.f;
}
// The stored w_out and w_gate's elements before their rounding, from the source values (the
// operand copies and the folds' row sums both take them from here, so the sums are those of the
// copies): at half scale, w_out times the output LayerNorm's scale, w_gate times the input one's
// where the gate is folded (`gamma` is read only then), each times its range scale.
__device__ __forceinline__ float w_out_value(float wo, float gamma, const OperandLayout& ol) {
  return kOperandScale * w_out_scale(ol) * wo * gamma;
}
__device__ __forceinline__ float w_gate_value(float wg, float gamma, const OperandLayout& ol) {
  const float v = kOperandScale * w_gate_scale(ol) * wg;
  return ol.gate_folded ? v * gamma : v;
}

// Where w_in's element (r, c) of the padded-row layout is stored (w_in at `base`): the chunk's
// core matrices, then its padding, when in_blocked (columns in k_paired_position's order with
// in_k_paired, rows in staged_in_row's for the folded w_in); rows ld = kin + pad apart otherwise.
template <typename T>
__device__ __forceinline__ int w_in_at(const OperandLayout& ol, int base, int r, int c) {
  const int kin = static_cast<int>(ol.kin), pad = static_cast<int>(ol.pad);
  if (!ol.in_blocked) return base + r * (kin + pad) + c;
  const int chunk = r / kOperandRowTile;
  const int rr = static_cast<int>(ol.in_folded && base == ol.w_in ? staged_in_row(r % kOperandRowTile)
                                                                  : r % kOperandRowTile);
  const int chunk_start = base + chunk * static_cast<int>(kOperandRowTile) * (kin + pad);
  const int k = ol.in_k_paired && c < kin ? static_cast<int>(k_paired_position(c, kin)) : c;
  return c < kin ? chunk_start + CoreBlockedAt<T>{kin / CoreBlockedAt<T>::kV}(rr, k)
                 : chunk_start + static_cast<int>(kOperandRowTile) * kin + rr * pad + (c - kin);
}

// w_in's row r is row r / 4 of proj_a, gate_a, proj_b or gate_b (r % 4, trimul.forward's order:
// each weight followed by its bias among the entries).
__device__ __forceinline__ float w_in_weight(const PackEntry* e, int r, int c) {
  return entry_value(e[kParamWIn + 2 * (r % 4)], r / 4, c);
}
__device__ __forceinline__ float w_in_bias(const PackEntry* e, int r) {
  return entry_value(e[kParamWIn + 2 * (r % 4) + 1], r / 4, 0);
}

// w_in's bias columns hold kOperandScale * bias[r] as hi, lo: the leading part and the rest.
template <typename T>
__device__ __forceinline__ void store_in_bias(const OperandLayout& ol, T* dst, int base, int r, int cols, float full) {
  const float hi = leading_part<T>(full);
  dst[w_in_at<T>(ol, base, r, cols)] = stored<T>(hi, ol);
  dst[w_in_at<T>(ol, base, r, cols + 1)] = stored<T>(full - hi, ol);
}

// in_fold: block k takes w_in rows kInFoldRows k .. + kInFoldRows - 1 (a warp each) and stores
// their folded bias columns, kOperandScale (b[r] + W[r] . beta_in), staging the rows and beta_in
// in shared memory first (one load a thread and round, as out_fold).
constexpr int kInFoldRows = kThreads / 32;
template <typename T>
__device__ void in_fold(const PackEntry* e, const OperandLayout& ol, const RangeScales* headroom, int P, int H,
                        int block, T* dst) {
  extern __shared__ float staged[];
  const int r0 = block * kInFoldRows, n = (kInFoldRows + 1) * P;
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int rr = i / P, c = i % P, r = r0 + rr;
    staged[i] = rr == kInFoldRows ? entry_value(e[kParamLnInB], 0, c)
                : r < 4 * H       ? w_in_weight(e, r, c)
                                  : 0.f;
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = r0 + warp;
  if (r >= 4 * H) return;
  const float *w = staged + warp * P, *beta = staged + kInFoldRows * P;
  float dot = 0.f;
  for (int c = lane; c < P; c += 32) dot += w[c] * beta[c];
  dot = warp_sum(dot);
  if (lane == 0)
    store_in_bias<T>(ol, dst, static_cast<int>(ol.w_in), r, P,
                     kOperandScale * w_in_row_scale(ol, headroom, r) * (w_in_bias(e, r) + dot));
}

// The three parts of a pack launch, each a run of blocks (PackLaunch), the one with the longest
// chains first:
//  - out_fold: block j sums row j of the stored w_out and w_gate, and forms Wo[j] . beta_out +
//    bo[j] and (gate_folded) Wg[j] . beta_in + bg[j]. The block first stages the row's sources
//    in shared memory (FoldSources), one load a thread and round, every load of a round in
//    flight at once; then warp 0 sums them, lanes over the row (h = lane, lane + 32, ...), and
//    shuffle sums. (Loaded by that warp as it summed, each lane's loads of Wo, gamma and beta
//    waited one after another, ~24 memory round trips a row at P = H = 128: most of the
//    launch's ~12 us on the H200.)
//  - in_fold (in_folded): w_in's folded bias columns;
//  - pack_operands: row r of a stored matrix (OperandLayout) is kOperandScale * W[r][0 .. cols)
//    (times the output LayerNorm's gamma for w_out, and the input LayerNorm's for w_gate when
//    gate_folded, for w_in when in_folded), for w_in followed by kOperandScale * bias[r] as hi,
//    lo (hi the leading part; in_fold's where folded); zeros after (padding included); with
//    ol.range, w_in's rows (with their bias columns), w_out (and its t) and w_gate times their
//    scales (w_in_row_scale, w_out_scale, w_gate_scale); with p.headroom, w_in's projection rows
//    (with their bias columns) times 2^-t. Element e of the padded-row layout lands at w_in_at(e)
//    for w_in (and w_in_plain, the unfolded copy);
//  - pack_params: each entry a run of blocks by its size, which write its share of the fp32 pack
//    (the projections' weights and biases times 2^-t with p.headroom).
// The first two read the parameters from their sources (PackParams' entries, in trimul.forward's
// order) as the last stores them, so the three run side by side in one launch. Index math in 32
// bits (launch_pack checks the sizes): its 64-bit divisions were most of the kernel's instructions.

// out_fold's staging in shared memory (floats): Wo[j][:H], gamma_out, beta_out, Wg[j][:P],
// gamma_in, beta_in.
struct FoldSources {
  int H, P;
  __host__ __device__ int count() const { return 3 * H + 3 * P; }
  __device__ float load(const PackEntry* e, int j, int i) const {
    if (i < 3 * H) {
      const int h = i % H, v = i / H;
      return v == 0 ? entry_value(e[kParamWOut], j, h) : entry_value(e[v == 1 ? kParamLnOutW : kParamLnOutB], 0, h);
    }
    i -= 3 * H;
    const int k = i % P, v = i / P;
    return v == 0 ? entry_value(e[kParamWGate], j, k) : entry_value(e[v == 1 ? kParamLnInW : kParamLnInB], 0, k);
  }
};

template <typename T>
__device__ void out_fold(const PackEntry* e, const OperandLayout& ol, const FoldSources src, int j, T* dst) {
  extern __shared__ float staged[];
  for (int i = threadIdx.x; i < src.count(); i += kThreads) staged[i] = src.load(e, j, i);
  __syncthreads();
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x, H = src.H, P = src.P;
  const float *wo = staged, *gamma_out = wo + H, *beta_out = gamma_out + H;
  const float *wg = beta_out + H, *gamma_in = wg + P, *beta_in = gamma_in + P;
  float s = 0.f, t = 0.f;
  for (int h = lane; h < H; h += 32) {
    s += to_float(stored<T>(w_out_value(wo[h], gamma_out[h], ol), ol));
    t += wo[h] * beta_out[h];
  }
  float sg = 0.f, tg = 0.f;
  for (int k = lane; k < P; k += 32) {
    sg += to_float(stored<T>(w_gate_value(wg[k], gamma_in[k], ol), ol));
    if (ol.gate_folded) tg += wg[k] * beta_in[k];
  }
  s = warp_sum(s);
  t = warp_sum(t);
  sg = warp_sum(sg);
  tg = warp_sum(tg);
  if (lane == 0) {
    float* fold = reinterpret_cast<float*>(dst + ol.out_fold);
    fold[j] = s;
    fold[ol.kp + j] = kOperandScale * w_out_scale(ol) * (t + entry_value(e[kParamBOut], 0, j));
    fold[2 * ol.kp + j] = sg;
    fold[3 * ol.kp + j] = kOperandScale * (tg + entry_value(e[kParamBGate], 0, j));
  }
}

template <typename T>
__global__ void pack_kernel(const PackParams p, const PackLaunch run) {
  const OperandLayout& ol = run.ol;
  const int P = static_cast<int>(run.P), H = static_cast<int>(run.H);
  T* const dst = static_cast<T*>(run.operands);
  const PackEntry* const e = p.entry;
  const int block = static_cast<int>(blockIdx.x);
  if (block < run.fold_blocks) {
    out_fold<T>(e, ol, FoldSources{H, P}, block, dst);
    return;
  }
  if (block < run.fold_blocks + run.in_fold_blocks) {
    in_fold<T>(e, ol, p.headroom, P, H, block - run.fold_blocks, dst);
    return;
  }
  const int op_block = block - run.fold_blocks - run.in_fold_blocks;
  if (op_block < run.operand_blocks) {
    // the layout up to out_fold, then the unfolded copy of w_in where there is one
    const int main_end = static_cast<int>(ol.out_fold), kin = static_cast<int>(ol.kin);
    const int end = main_end + (ol.w_in_plain >= 0 ? static_cast<int>(ol.in_rows * (ol.kin + ol.pad)) : 0);
    const int w_out_at = static_cast<int>(ol.w_out), w_gate_at = static_cast<int>(ol.w_gate);
    for (int i = op_block * kThreads + threadIdx.x; i < end; i += run.operand_blocks * kThreads) {
      // which matrix: w_in (rows 4h + q: proj_a, gate_a, proj_b, gate_b), w_out, w_gate or w_in's
      // unfolded copy; j: the element's offset in the padded-row form of the layout
      const bool plain = i >= main_end;
      const int j = plain ? static_cast<int>(ol.w_in_plain) + i - main_end : i;
      int base = plain ? static_cast<int>(ol.w_in_plain) : static_cast<int>(ol.w_in), ld = kin, rows = 4 * H,
          cols = P;
      if (!plain && j >= w_gate_at) {
        base = w_gate_at, ld = static_cast<int>(ol.kp), rows = P, cols = P;
      } else if (!plain && j >= w_out_at) {
        base = w_out_at, ld = static_cast<int>(ol.kh), rows = P, cols = H;
      }
      const bool is_w_in = base == ol.w_in || plain, folded = ol.in_folded && !plain;
      ld += static_cast<int>(ol.pad);
      const int r = (j - base) / ld, c = (j - base) % ld;
      float v = 0.f;
      if (r < rows && c < cols) {
        if (is_w_in) {
          v = kOperandScale * w_in_row_scale(ol, p.headroom, r) * w_in_weight(e, r, c);
          if (folded) v *= entry_value(e[kParamLnInW], 0, c);
        } else if (base == ol.w_out) {
          v = w_out_value(entry_value(e[kParamWOut], r, c), entry_value(e[kParamLnOutW], 0, c), ol);
        } else {
          const float gamma = ol.gate_folded ? entry_value(e[kParamLnInW], 0, c) : 0.f;
          v = w_gate_value(entry_value(e[kParamWGate], r, c), gamma, ol);
        }
      } else if (is_w_in && r < rows && c < cols + kBiasCols) {
        if (folded) continue;  // (in_fold's)
        if (c == cols)
          store_in_bias<T>(ol, dst, base, r, cols, kOperandScale * w_in_row_scale(ol, p.headroom, r) * w_in_bias(e, r));
        continue;
      }
      dst[is_w_in ? w_in_at<T>(ol, base, r, c) : j] = stored<T>(v, ol);
    }
    return;
  }
  const int entry_block = op_block - run.operand_blocks;
  int k = 0;
  while (entry_block >= run.entry_start[k + 1]) ++k;
  const PackEntry& d = p.entry[k];
  const int blocks = run.entry_start[k + 1] - run.entry_start[k];
  const int cols = static_cast<int>(d.cols), n = static_cast<int>(d.rows) * cols;
  const float scale = projection_entry(k) ? headroom_scale(p.headroom) : 1.f;
  for (int i = (entry_block - run.entry_start[k]) * kThreads + threadIdx.x; i < n; i += blocks * kThreads) {
    const int r = d.rows == 1 ? 0 : i / cols, c = d.rows == 1 ? i : i % cols;
    p.dst[d.offset + r * d.dst_row_stride + c] = scale * entry_value(d, r, c);
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
    const int64_t plain = ol->w_in_plain >= 0 ? ol->in_rows * (ol->kin + ol->pad) : 0;
    run.operand_blocks = static_cast<int>(std::min<int64_t>(ceil_div(ol->out_fold + plain, kThreads), 1024));
    run.fold_blocks = static_cast<int>(P);
    run.in_fold_blocks = ol->in_folded ? static_cast<int>(ceil_div(4 * H, kInFoldRows)) : 0;
  }
  const int blocks = run.entry_start[p.count] + run.operand_blocks + run.fold_blocks + run.in_fold_blocks;
  if (blocks == 0) return cudaSuccess;
  // the larger staging of out_fold's and in_fold's
  const size_t smem =
      ol != nullptr ? sizeof(float) * std::max<int64_t>(FoldSources{static_cast<int>(H), static_cast<int>(P)}.count(),
                                                        ol->in_folded ? (kInFoldRows + 1) * P : 0)
                    : 0;
  if (smem > kFoldSmemLimit) return cudaErrorInvalidValue;
  switch (ol == nullptr ? DType::f32 : dtype) {
    case DType::f16: pack_kernel<__half><<<blocks, kThreads, smem, stream>>>(p, run); break;
    case DType::bf16: pack_kernel<__nv_bfloat16><<<blocks, kThreads, smem, stream>>>(p, run); break;
    default: pack_kernel<float><<<blocks, kThreads, smem, stream>>>(p, run); break;
  }
  return cudaGetLastError();
}

}  // namespace trimul
