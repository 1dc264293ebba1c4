// pack_params: gathers every parameter into one fp32 workspace (PackedLayout),
// converting dtype and strides and filling in the defaults of missing ones.
// One launch; blockIdx.y picks the entry, so every entry's loads are in flight
// at once (one after the other, 16 entries took ~12 us on the H200).
// pack_operands: the zero-padded weight copies of the tensor-core stages in
// their operand type (OperandLayout), made from the fp32 pack.
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

__global__ void pack_params_kernel(const PackParams p) {
  const PackEntry& d = p.entry[blockIdx.y];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n = d.rows * d.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const int64_t r = i / d.cols, c = i % d.cols;
    const float v = d.ptr ? load_any(d.ptr, d.dtype, r * d.stride_r + c * d.stride_c) : d.fill;
    p.dst[d.offset + r * d.dst_row_stride + c] = v;
  }
}

cudaError_t launch_pack_params(const PackParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  int64_t largest = 1;
  for (int e = 0; e < p.count; ++e) largest = std::max(largest, p.entry[e].rows * p.entry[e].cols);
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(largest, kThreads), 1024));
  pack_params_kernel<<<dim3(blocks, p.count), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
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
  return __uint_as_float(tf32_rna(__float_as_uint(v)));
}

// Row r of a stored matrix (OperandLayout): kOperandScale * W[r][0 .. cols)
// (times the output LayerNorm's gamma for w_out, and the input LayerNorm's for
// w_gate when gate_folded), for w_in followed by
// kOperandScale * bias[r] as hi, lo (hi the leading part); zeros after
// (padding included). Element e of the padded-row layout lands at blocked(e)
// for w_in when in_blocked.
template <typename T>
__global__ void pack_operands_kernel(const float* packed, const PackedLayout pl, const OperandLayout ol, int64_t P,
                                     int64_t H, T* dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < ol.out_fold; e += stride) {
    // which matrix, and its (rows, cols) in the fp32 pack
    int64_t base = ol.w_in, ld = ol.kin, src = pl.w_in, rows = 4 * H, cols = P;
    if (e >= ol.w_gate) {
      base = ol.w_gate, ld = ol.kp, src = pl.w_gate, rows = P, cols = P;
    } else if (e >= ol.w_out) {
      base = ol.w_out, ld = ol.kh, src = pl.w_out, rows = P, cols = H;
    }
    ld += ol.pad;
    const int64_t r = (e - base) / ld, c = (e - base) % ld;
    float v = 0.f;
    if (r < rows && c < cols) {
      v = kOperandScale * packed[src + r * cols + c];
      if (base == ol.w_out) v *= packed[pl.ln_out_w + c];
      if (base == ol.w_gate && ol.gate_folded) v *= packed[pl.ln_in_w + c];
    } else if (base == ol.w_in && r < rows && c < cols + kBiasCols) {
      const float full = kOperandScale * packed[pl.b_in + r];
      const float hi = leading_part<T>(full);
      v = c == cols ? hi : full - hi;
    }
    int64_t at = e;
    if (base == ol.w_in && ol.in_blocked) {  // the chunk's core matrices, then its padding
      const int64_t chunk = r / kOperandRowTile, rr = r % kOperandRowTile;
      const int64_t chunk_start = base + chunk * kOperandRowTile * ld;
      const int64_t k = ol.in_k_paired && c < ol.kin ? k_paired_position(c, ol.kin) : c;
      at = c < ol.kin ? chunk_start + CoreBlockedAt<T>{static_cast<int>(ol.kin / CoreBlockedAt<T>::kV)}(
                                          static_cast<int>(rr), static_cast<int>(k))
                      : chunk_start + kOperandRowTile * ol.kin + rr * ol.pad + (c - ol.kin);
    }
    dst[at] = from_float<T>(std::is_same<T, float>::value && ol.tf32_rounded ? round_tf32(v) : v);
  }
}

// out_fold (OperandLayout): warp j sums row j of the stored w_out and w_gate,
// and forms Wo[j] . beta_out + bo[j] and (gate_folded) Wg[j] . beta_in + bg[j]
// (lanes over the row; a thread per row, 128 steps in a row, took ~13 us on the
// H200).
template <typename T>
__global__ void fold_out_kernel(const float* packed, const PackedLayout pl, const OperandLayout ol, int64_t P,
                                int64_t H, T* dst) {
  const int64_t j = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (j >= P) return;  // whole warps: blockDim.x is a multiple of 32
  const T* w = dst + ol.w_out + j * (ol.kh + ol.pad);
  const float* wo = packed + pl.w_out + j * H;
  float s = 0.f, t = 0.f;
  for (int64_t h = lane; h < H; h += 32) {
    s += to_float(w[h]);
    t += wo[h] * packed[pl.ln_out_b + h];
  }
  const T* v = dst + ol.w_gate + j * (ol.kp + ol.pad);
  const float* wg = packed + pl.w_gate + j * P;
  float sg = 0.f, tg = 0.f;
  for (int64_t k = lane; k < P; k += 32) {
    sg += to_float(v[k]);
    if (ol.gate_folded) tg += wg[k] * packed[pl.ln_in_b + k];
  }
  s = warp_sum(s);
  t = warp_sum(t);
  sg = warp_sum(sg);
  tg = warp_sum(tg);
  if (lane == 0) {
    float* fold = reinterpret_cast<float*>(dst + ol.out_fold);
    fold[j] = s;
    fold[ol.kp + j] = kOperandScale * (t + packed[pl.b_out + j]);
    fold[2 * ol.kp + j] = sg;
    fold[3 * ol.kp + j] = kOperandScale * (tg + packed[pl.b_gate + j]);
  }
}

cudaError_t launch_pack_operands(const float* packed, const PackedLayout& layout, const OperandLayout& ol, int64_t P,
                                 int64_t H, void* dst, DType dtype, cudaStream_t stream) {
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(ol.total, kThreads), 1024));
  const int fold_blocks = static_cast<int>(ceil_div(P * 32, kThreads));
  auto launch = [&](auto* d) {
    pack_operands_kernel<<<blocks, kThreads, 0, stream>>>(packed, layout, ol, P, H, d);
    fold_out_kernel<<<fold_blocks, kThreads, 0, stream>>>(packed, layout, ol, P, H, d);
  };
  switch (dtype) {
    case DType::f16: launch(static_cast<__half*>(dst)); break;
    case DType::bf16: launch(static_cast<__nv_bfloat16*>(dst)); break;
    default: launch(static_cast<float*>(dst)); break;
  }
  return cudaGetLastError();
}

}  // namespace trimul
