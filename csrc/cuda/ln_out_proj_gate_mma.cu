// ln_out_proj_gate on tensor cores: 16-bit operands (bf16, fp16), or fp32 ones
// read as tf32 (precision tf32) or as tf32 pairs (3xTF32, ieee). Computes what
// ln_out_proj_gate.cu computes:
//
//   out[b, i, j, :] = (LayerNorm(c[b, i, j, :]) . Wo^T + bo) * sigmoid(u . Wg^T + bg)
//
// with W' = Wo * gamma and t = Wo . beta + bo (OperandLayout::out_fold). For
// 16-bit operands c's LayerNorm comes after the product, LN(c) . Wo^T + bo =
// rstd (c . W'^T - mean s) + t; for fp32 ones the tile is normalized in place
// first (no cancellation between c . W'^T and mean s), LN(c) . Wo^T + bo =
// ((c - mean) rstd) . W'^T + t. The gate's LayerNorm of x (gate from the
// normalized input: w_gate folded the same way) likewise: after the product
// when x has the 16-bit operand type, else x is normalized (without the
// affine) as it is rounded to the operand type.
//
// Block: 128 positions j of one (b, i), 8 warps of 16 positions.
//  1. By cp.async: the c tile as it lies in memory, h-major (ct[h][j], the
//     triangle GEMM wrote it in the operand type), and the x tile (into the
//     operand tile us when x has the operand type, else into a raw tile).
//  2. c's LayerNorm statistics over h (a warp per 8 pairs of positions, its
//     lanes over 4 parts of h, summed by shuffles: warp_pair_column_stats), kept per position (fp32: applied to the tile, and the
//     kept statistics set to mean 0, rstd 1); x's over p when the gate reads
//     the normalized input (two lanes per position; x in another type than the
//     operands, or fp32 operands: us becomes (x - mean) rstd, kept statistics
//     mean 0, rstd 1).
//  3. Output channels go in chunks of 64: the chunk's Wo and Wg rows are
//     staged (the first chunk's with the tiles of step 1), each warp forms
//     its 16 x 64 pieces of c . W'^T (A fragments of the h-major ct through
//     ldmatrix.trans) and of g, and a thread combines
//     them in registers (weights at half scale: y and the gate's input from
//     the statistics and the folds in two FMAs each, one tanh, one FMA; fp32:
//     an accurate sigmoid) and stores them.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "range.cuh"

namespace trimul {
namespace {

constexpr int kRows = 128;
constexpr int kWarps = kRows / 16;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kCols = 64;  // output channels per chunk
static_assert(kOperandRowTile % kCols == 0, "chunks tile the padded weight rows");
constexpr int kNTiles = kCols / 8;
// ct row stride in elements: 272 bytes for 16-bit operands (ldmatrix rows in
// distinct banks), 544 for float (the scalar fragment loads of warp_mma:
// kLdc % 32 == 8).
constexpr int kLdc = kRows + 8;
constexpr int kPairsPerWarp = kRows / 2 / kWarps;  // LayerNorm of c: warp_pair_column_stats
static_assert(kLdc % 64 == 8, "c's statistics: each warp load in distinct banks");

struct Smem {
  int ldh, kh, ldp, kp;
  size_t ct, us, raw, wo, wg, cstat, xstat, bytes;
  __host__ __device__ static Smem make(int64_t P, int64_t H, int op_bytes, int64_t raw_x_bytes) {
    Smem s{};
    const int pad = static_cast<int>(kOperandRowPadBytes) / op_bytes;
    s.kh = static_cast<int>(round16(H));
    s.ldh = s.kh + pad;
    s.kp = static_cast<int>(round16(P));
    s.ldp = s.kp + pad;
    s.ct = 0;
    s.us = s.ct + op_bytes * s.kh * kLdc;
    s.raw = s.us + op_bytes * kRows * s.ldp;
    s.wo = (s.raw + raw_x_bytes * kRows * P + 15) / 16 * 16;
    s.wg = s.wo + op_bytes * kCols * s.ldh;
    s.cstat = s.wg + op_bytes * kCols * s.ldp;
    s.xstat = s.cstat + sizeof(float2) * kRows;
    s.bytes = s.xstat + sizeof(float2) * kRows;
    return s;
  }
};

// kSplit: float operands as tf32 pairs (3xTF32); float operands without it are tf32, stored
// rounded (the pack's w_out and w_gate: OperandLayout::tf32_rounded; ct and us here).
template <typename Tx, typename Tab, bool kSplit>
__global__ void __launch_bounds__(kBlockThreads, kStageBlocksPerSm<Tab>)
    ln_out_proj_gate_mma_kernel(const LnOutProjGateParams p, int64_t b_first) {
  constexpr bool kInPlace = std::is_same<Tx, Tab>::value;
  constexpr bool kNormalizeC = std::is_same<Tab, float>::value;
  // x's LayerNorm after the gate's product: x is the operand tile as it is (16-bit)
  constexpr bool kFoldX = kInPlace && !kNormalizeC;
  constexpr bool kTf32Rounded = std::is_same<Tab, float>::value && !kSplit;
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem L = Smem::make(p.P, p.H, sizeof(Tab), kInPlace ? 0 : sizeof(Tx));
  Tab* ct = reinterpret_cast<Tab*>(smem + L.ct);
  Tab* us = reinterpret_cast<Tab*>(smem + L.us);
  Tx* raw = kInPlace ? reinterpret_cast<Tx*>(us) : reinterpret_cast<Tx*>(smem + L.raw);
  const int ld_raw = kInPlace ? L.ldp : static_cast<int>(p.P);
  Tab* wo = reinterpret_cast<Tab*>(smem + L.wo);
  Tab* wg = reinterpret_cast<Tab*>(smem + L.wg);
  float2* cstat = reinterpret_cast<float2*>(smem + L.cstat);  // [kRows]: (mean, rstd) of c
  float2* xstat = reinterpret_cast<float2*>(smem + L.xstat);  // [kRows]: (mean, rstd) of x, or (0, 1)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j_tiles = ceil_div(p.N, kRows);
  const int64_t i = blockIdx.x / j_tiles, j0 = (blockIdx.x % j_tiles) * kRows;
  const int64_t b = b_first + blockIdx.y;

  // 1. c tile rows h (the row's Npad - j0 >= 8 columns past j0 that exist) and x tile.
  const Tab* c = static_cast<const Tab*>(p.c) + (b * p.H * p.Npad + i) * p.Npad + j0;
  const int c_cols = static_cast<int>(std::min<int64_t>(kRows, p.Npad - j0));
  copy_rows(ct, kLdc, L.kh, c_cols, kRows, StridedRows<Tab>{c, p.Npad * p.Npad, static_cast<int>(p.H)}, SameRow{},
            true);
  const Tx* x = static_cast<const Tx*>(p.x);
  const StridedRows<Tx> x_rows{x + b * p.x_stride_b + i * p.x_stride_i + j0 * p.x_stride_j, p.x_stride_j,
                               static_cast<int>(std::min<int64_t>(p.N - j0, kRows))};
  // x is the gate's operand as it is when it has the operand type and is not normalized before
  // the product (2b writes the padding of us otherwise)
  const bool x_is_us = kFoldX || (kInPlace && !p.gate_from_normalized);
  copy_rows(raw, ld_raw, kRows, static_cast<int>(p.P), x_is_us ? L.kp : static_cast<int>(p.P), x_rows, SameRow{},
            p.x_rows_vec16);
  // the first chunk's weights (step 3) come with the tiles
  const Tab* w_out = static_cast<const Tab*>(p.operands) + p.op_layout.w_out;
  const Tab* w_gate = static_cast<const Tab*>(p.operands) + p.op_layout.w_gate;
  auto copy_weights = [&](int p0) {
    copy_linear<kBlockThreads>(wo, w_out + p0 * L.ldh, static_cast<int>(kCols * sizeof(Tab)) * L.ldh);
    copy_linear<kBlockThreads>(wg, w_gate + p0 * L.ldp, static_cast<int>(kCols * sizeof(Tab)) * L.ldp);
  };
  copy_weights(0);
  cp_async_wait_all();
  __syncthreads();

  // 2a. LayerNorm statistics of c over h (warp_pair_column_stats); (mean, rstd) per position
  // into cstat.
  {
    using V2 = Vec2<Tab>;
    using Lane = ColumnStatsLane<kPairsPerWarp>;
    const int warp = static_cast<int>(threadIdx.x) / 32;
    const int pair = Lane::pair(warp), part = Lane::part(), H = static_cast<int>(p.H);
    float2 mu, rs;
    warp_pair_column_stats<kPairsPerWarp>(ct, kLdc, H, headroom_c_eps(p.eps, p.headroom), warp, mu, rs);
    auto* col = reinterpret_cast<typename V2::type*>(ct) + pair;  // (h, 2 pair) at col[h * kLdc / 2]
    if constexpr (kNormalizeC) {
      constexpr int kParts = 32 / kPairsPerWarp;
      for (int h = part; h < H; h += kParts) {
        const float2 v = V2::unpack(col[h * (kLdc / 2)]);
        float2 o = make_float2((v.x - mu.x) * rs.x, (v.y - mu.y) * rs.y);
        if constexpr (kTf32Rounded) o = make_float2(round_tf32(o.x), round_tf32(o.y));
        col[h * (kLdc / 2)] = V2::pack(o.x, o.y);
      }
    }
    if (part == 0) {
      cstat[2 * pair] = kNormalizeC ? make_float2(0.f, 1.f) : make_float2(mu.x, rs.x);
      cstat[2 * pair + 1] = kNormalizeC ? make_float2(0.f, 1.f) : make_float2(mu.y, rs.y);
    }
  }

  // 2b. The gate's operand: x, with its statistics (or x normalized, or x rounded to the operand
  // type, with statistics mean 0, rstd 1; at tf32 x as it is is rounded in place).
  if (!x_is_us || kTf32Rounded)
    warp_layer_norm_rows<false, kTf32Rounded>(raw, ld_raw, us, L.ldp, warp * 16, 16, static_cast<int>(p.P), L.kp,
                                              static_cast<const float*>(nullptr), static_cast<const float*>(nullptr),
                                              p.eps, p.gate_from_normalized, [&](int rr) { return j0 + rr < p.N; });
  if (kFoldX && p.gate_from_normalized) {  // two lanes of a warp per position (paired_row_stats)
    const int r = warp * 16 + (lane & 7) + 8 * (lane >> 4);
    const float2 st = paired_row_stats(us + r * L.ldp, static_cast<int>(p.P), p.eps);
    if ((lane & 8) == 0) xstat[r] = st;
  } else if (threadIdx.x < kRows) {
    xstat[threadIdx.x] = make_float2(0.f, 1.f);
  }

  // 3. Output channels, 64 at a time.
  const int g = lane / 4, t = lane % 4;
  // s, t of w_out, then of w_gate (OperandLayout::out_fold)
  const float* fold_s = reinterpret_cast<const float*>(static_cast<const Tab*>(p.operands) + p.op_layout.out_fold);
  const float* fold_t = fold_s + p.op_layout.kp;
  const float* gate_s = fold_t + p.op_layout.kp;
  const float* gate_t = gate_s + p.op_layout.kp;

  Tx* out = static_cast<Tx*>(p.out) + ((b * p.N + i) * p.N + j0) * p.P;
  // the epilogue's bounds in 32 bits: output channels, and the tile's rows that exist
  const int P = static_cast<int>(p.P), valid = static_cast<int>(std::min<int64_t>(kRows, p.N - j0));
  for (int p0 = 0; p0 < P; p0 += kCols) {
    if (p0 > 0) {
      __syncthreads();  // the previous chunk's weights consumed
      copy_weights(p0);
      cp_async_wait_all();
    }
    __syncthreads();  // this chunk's weights ready; the statistics written
    float2 stat[2], xst[2];  // (mean, rstd) of c and of x at this thread's two rows
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      stat[half] = cstat[warp * 16 + g + 8 * half];
      xst[half] = xstat[warp * 16 + g + 8 * half];
    }
    float y[1][kNTiles][4] = {}, gt[1][kNTiles][4] = {};
    constexpr bool kR = kTf32Rounded;
    warp_mma<Tab, 1, kNTiles, true, kSplit, false, kR, kR>(y, ct, kLdc, wo, L.ldh, warp * 16, L.kh);
    warp_mma<Tab, 1, kNTiles, false, kSplit, false, kR, kR>(gt, us, L.ldp, wg, L.ldp, warp * 16, L.kp);
    const bool pairs = P % 2 == 0;  // two adjacent channels per store
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int ch = p0 + nt * 8 + 2 * t;
      if (ch >= P) continue;
      const bool second = ch + 1 < P;
      // ch is even and each vector kp >= ch + 2 entries long, 16-byte aligned: one 8-byte load per
      // pair (past P the second value is not stored)
      const float2 so = load2(fold_s + ch), to = load2(fold_t + ch), sg = load2(gate_s + ch), tg = load2(gate_t + ch);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + g + 8 * half;
        if (row >= valid) continue;
        const float mu = stat[half].x, rs = stat[half].y, xm = xst[half].x, xr = xst[half].y;
        const float y0 = fmaf(rs, fmaf(-mu, so.x, y[0][nt][2 * half]), to.x);
        const float y1 = fmaf(rs, fmaf(-mu, so.y, y[0][nt][2 * half + 1]), to.y);
        const float g0 = fmaf(xr, fmaf(-xm, sg.x, gt[0][nt][2 * half]), tg.x);
        const float g1 = fmaf(xr, fmaf(-xm, sg.y, gt[0][nt][2 * half + 1]), tg.y);
        const float v0 = gated_half_scale_for<Tab>(y0, g0);
        const float v1 = gated_half_scale_for<Tab>(y1, g1);
        Tx* o = out + row * P + ch;
        if (pairs) {
          store2(o, v0, v1);
        } else {
          o[0] = from_float<Tx>(v0);
          if (second) o[1] = from_float<Tx>(v1);
        }
      }
    }
  }
}

template <typename Tx, typename Tab, bool kSplit>
cudaError_t launch_typed(const LnOutProjGateParams& p, cudaStream_t stream) {
  const size_t smem = Smem::make(p.P, p.H, sizeof(Tab), std::is_same<Tx, Tab>::value ? 0 : sizeof(Tx)).bytes;
  return launch_grid_rows(ln_out_proj_gate_mma_kernel<Tx, Tab, kSplit>, ceil_div(p.N, kRows) * p.N, p.B,
                          kBlockThreads, smem, p, stream);
}

template <typename Tab, bool kSplit = false>
cudaError_t launch_for_ab(const LnOutProjGateParams& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_typed<__nv_bfloat16, Tab, kSplit>(p, stream);
    case DType::f16: return launch_typed<__half, Tab, kSplit>(p, stream);
    default: return launch_typed<float, Tab, kSplit>(p, stream);
  }
}

}  // namespace

size_t ln_out_proj_gate_mma_smem(int64_t P, int64_t H, int64_t operand_bytes, int64_t raw_x_bytes) {
  return Smem::make(P, H, static_cast<int>(operand_bytes), raw_x_bytes).bytes;
}

cudaError_t launch_ln_out_proj_gate_mma(const LnOutProjGateParams& p, cudaStream_t stream) {
  if (ln_out_proj_gate_resident_takes(p)) return launch_ln_out_proj_gate_resident(p, stream);
  switch (p.c_dtype) {
    case DType::f16: return launch_for_ab<__half>(p, stream);
    case DType::bf16: return launch_for_ab<__nv_bfloat16>(p, stream);
    default:
      if (p.precision == Precision::ieee) return launch_for_ab<float, true>(p, stream);
      return p.op_layout.tf32_rounded ? launch_for_ab<float>(p, stream) : cudaErrorInvalidValue;
  }
}

}  // namespace trimul
