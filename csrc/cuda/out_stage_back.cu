// out_stage_back: the output stage's backward in one kernel (trimul.h), 16-bit
// operands (bf16, fp16) on tensor cores, fp32 accumulation and elementwise math.
//
// Block: 64 positions j of one line (b, i), 8 warps: a row group of 16
// positions has two, each taking half of a stage's 64 columns in the products;
// two blocks per SM on sm_90 (~112 KB of shared memory each at P = H = 128).
//  1. By cp.async: the c tile as the contraction left it, h-major (ct[h][j]);
//     the x tile into the gate-input tile us (or, x of another type, into a
//     raw tile that the dy and dgp tiles take later).
//  2. us becomes the gate input u (LayerNorm(x), or x rounded); c's LayerNorm
//     statistics per position (as ln_out_proj_gate_mma.cu); chat = (c - mean)
//     rstd and u leave for the weight gradients' products.
//  3. Output channels 64 at a time: y = rstd (c . W'^T - mean s) + t (W' = Wo
//     gamma, s its row sums; as the forward) and g = u . Wg^T + bg per warp in
//     registers, with the output gradient G read at the same elements:
//     dy = G sigmoid(g), dgp = dy y (1 - sigmoid(g)) into the dy and dgp tiles.
//  4. dcn = dy . Wo (every hidden unit of the warp's rows in registers) and
//     dx = dgp . Wg (written out per 64 channels); then LayerNorm's gradient,
//     dc = rstd (dcn gamma - mean(dcn gamma) - chat mean(dcn gamma chat)),
//     into ct in place, which leaves as the rows of c it came from.
// The weights pass through two 64-row buffers, a stage at a time, each stage's
// copy in flight under the previous stage's epilogue (the first under step 2).
// Column sums (sum dcn chat, sum dcn, sum dy, sum dgp): a thread's two rows,
// then the warp's eight lanes of a column by a reduce-scatter of shuffles, into
// a per-warp row of shared memory; the block adds its warps in order into its
// row of `partial`, and column_sums adds the blocks' rows in order: bitwise
// repeatable on a given GPU.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace trimul {
namespace {

constexpr int kRows = 64;                  // positions per block
constexpr int kRowGroups = kRows / 16;     // the warps' 16-row slices of the tile
constexpr int kColSplit = 2;               // warps per row group, each on a part of a stage's columns
constexpr int kWarps = kRowGroups * kColSplit;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kCols = 64;                  // weight rows (output channels, hidden units) per stage
constexpr int kWarpCols = kCols / kColSplit;
constexpr int kNTiles = kWarpCols / 8;     // a warp's 8-column mma tiles per stage
constexpr int kMaxChunks = static_cast<int>(kOutBackMaxWidth) / kCols;  // dcn's chunks, all in registers
constexpr int kLdc = kRows + 8;            // ct row stride: 144 bytes, ldmatrix rows in distinct banks
constexpr int kPairsPerWarp = kRows / 2 / kWarps;  // c's statistics: warp_pair_column_stats
static_assert(kLdc % 64 == 8, "c's statistics: each warp load in distinct banks");
constexpr int kPad = 8;                    // elements of row padding (16 bytes)
static_assert(kOutBackMaxWidth % kCols == 0, "width limit in whole chunks");

struct Smem {
  int kh, kp, ldh, ldp, cols;
  size_t ct, us, dy, dg, wa, wb, wsum, cstat, bytes;
  __host__ __device__ static Smem make(int64_t P, int64_t H) {
    Smem s{};
    s.kh = static_cast<int>(H), s.kp = static_cast<int>(P);
    s.ldh = s.kh + kPad, s.ldp = s.kp + kPad;
    s.cols = 2 * s.kh + 2 * s.kp;
    const size_t tile = 2 * kRows * s.ldp, wtile = 2 * kCols * (s.ldh > s.ldp ? s.ldh : s.ldp);
    s.ct = 0;
    s.us = s.ct + 2 * s.kh * kLdc;
    s.dy = s.us + tile;  // dy, dg: a raw x tile before (x in another type than the operands)
    s.dg = s.dy + tile;
    s.wa = s.dg + tile;
    s.wb = s.wa + wtile;
    s.wsum = s.wb + wtile;
    s.cstat = s.wsum + sizeof(float) * kRowGroups * s.cols;
    s.bytes = s.cstat + sizeof(float2) * kRows;
    return s;
  }
};

// Column sums of a warp's fragments, reduce-scattered: v[2 nt + e] holds a lane's
// value for column 8 nt + 2 t + e of its kNTiles 8-column tiles; the eight lanes
// of a column (same t) exchange halves three times (7 shuffles for 8 values, in
// a fixed order), after which lane (g, t) holds in v[0] the sum for the entry
// 4 (g & 1) + 2 (g >> 1 & 1) + (g >> 2) of v: nt = own_entry / 2, e = own_entry % 2.
template <int kHalf>
__device__ __forceinline__ void fold_half(float (&v)[2 * kNTiles], int mask) {
  const bool upper = threadIdx.x & mask;
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float send = upper ? v[i] : v[i + kHalf], keep = upper ? v[i + kHalf] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, mask);
  }
}
__device__ __forceinline__ void column_sums_scatter(float (&v)[2 * kNTiles]) {
  static_assert(kNTiles == 4, "three halvings of 8 values over the eight lanes of a column");
  fold_half<4>(v, 4);
  fold_half<2>(v, 8);
  fold_half<1>(v, 16);
}
__device__ __forceinline__ int own_entry(int g) { return 4 * (g & 1) + 2 * (g >> 1 & 1) + (g >> 2); }

// sigmoid(v) = (1 + tanh(v / 2)) / 2: one MUFU operation (tanh.approx, relative error
// about 2^-11, below the 16-bit operands' rounding).
__device__ __forceinline__ float sigmoid_tanh(float v) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * v));
  return fmaf(0.5f, t, 0.5f);
}

// v summed over the four lanes of a row of the fragment layout (same g).
__device__ __forceinline__ float row_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Block-wide: tile rows r < count (16-byte pieces of `cols` elements, ld apart) to dst rows r.
template <typename T>
__device__ __forceinline__ void store_rows(T* dst, int64_t dst_ld, const T* tile, int ld, int count, int cols) {
  constexpr int kV = 16 / sizeof(T);
  const int per_row = cols / kV;
  for (int e = threadIdx.x; e < count * per_row; e += kBlockThreads) {
    const int r = e / per_row, q = e % per_row;
    *reinterpret_cast<uint4*>(dst + r * dst_ld + q * kV) = *reinterpret_cast<const uint4*>(tile + r * ld + q * kV);
  }
}

// Two blocks per SM on sm_90 (the shared memory holds two), which caps the
// registers at 128 a thread: enough for x in the operand type. Elsewhere, and
// for x of another type (its raw tile and conversions), the kernel needs more
// (sm_100: ~130 for the former) and runs one block per SM.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
template <typename Tab, typename Tx>
constexpr int kBlocksPerSm = std::is_same<Tx, Tab>::value ? 2 : 1;
#else
template <typename Tab, typename Tx>
constexpr int kBlocksPerSm = 1;
#endif

template <typename Tab, typename Tx>
__global__ void __launch_bounds__(kBlockThreads, (kBlocksPerSm<Tab, Tx>)) out_stage_back_kernel(const OutStageBackParams p) {
  constexpr bool kInPlace = std::is_same<Tx, Tab>::value;
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem L = Smem::make(p.P, p.H);
  Tab* ct = reinterpret_cast<Tab*>(smem + L.ct);
  Tab* us = reinterpret_cast<Tab*>(smem + L.us);
  Tab* dyt = reinterpret_cast<Tab*>(smem + L.dy);
  Tab* dgt = reinterpret_cast<Tab*>(smem + L.dg);
  Tab* wa = reinterpret_cast<Tab*>(smem + L.wa);
  Tab* wb = reinterpret_cast<Tab*>(smem + L.wb);
  Tx* raw = kInPlace ? reinterpret_cast<Tx*>(us) : reinterpret_cast<Tx*>(smem + L.dy);
  const int ld_raw = kInPlace ? L.ldp : L.kp;
  // [kRowGroups][cols]: dcn chat | dcn | dy | dgp (the two warps of a row group write disjoint columns)
  float* wsum = reinterpret_cast<float*>(smem + L.wsum);
  float2* row_part = reinterpret_cast<float2*>(smem + L.us);  // [kColSplit][kRows], after u's last use
  float2* cstat = reinterpret_cast<float2*>(smem + L.cstat);  // [kRows]: (mean, rstd) of c

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int rg = warp % kRowGroups, cs = warp / kRowGroups;  // row group, column part
  const int row0 = rg * 16, col_off = cs * kWarpCols;       // the warp's rows; its columns in a stage
  const int H = L.kh, P = L.kp;
  const int64_t j_tiles = ceil_div(p.N, kRows);
  const int64_t local_line = blockIdx.x / j_tiles, line = p.line0 + local_line;
  const int64_t j0 = (blockIdx.x % j_tiles) * kRows;
  const int64_t b = line / p.N, i = line % p.N;
  const int valid = static_cast<int>(std::min<int64_t>(kRows, p.N - j0));
  const int64_t pos = line * p.N + j0;                 // the tile's first position in x, G, dx
  const int64_t out_row = local_line * p.N + j0;       // ... in chat, u, dy, dgp

  // The weights, a stage at a time in wa and wb: stage k < p_stages holds output
  // channels [64 k, 64 k + 64) of Wo gamma and Wg (steps 3), stage p_stages + q
  // hidden units [64 q, 64 q + 64) of Wo^T and channels of Wg^T (step 4). Stage
  // k + 1 is copied while stage k's epilogue runs.
  const int p_stages = (P + kCols - 1) / kCols, stages = p_stages + (std::max(H, P) + kCols - 1) / kCols;
  auto stage = [&](int k) {
    if (k < p_stages) {
      const int p0 = k * kCols;
      copy_rows(wa, L.ldh, kCols, H, L.kh, StridedRows<Tab>{static_cast<const Tab*>(p.wo_g) + p0 * H, H, P - p0},
                SameRow{}, true);
      copy_rows(wb, L.ldp, kCols, P, L.kp, StridedRows<Tab>{static_cast<const Tab*>(p.wg) + p0 * P, P, P - p0},
                SameRow{}, true);
    } else if (k < stages) {
      const int c0 = (k - p_stages) * kCols;
      if (c0 < H)
        copy_rows(wa, L.ldp, kCols, P, L.kp, StridedRows<Tab>{static_cast<const Tab*>(p.wo_t) + c0 * P, P, H - c0},
                  SameRow{}, true);
      if (c0 < P)
        copy_rows(wb, L.ldp, kCols, P, L.kp, StridedRows<Tab>{static_cast<const Tab*>(p.wg_t) + c0 * P, P, P - c0},
                  SameRow{}, true);
    }
  };
  // 1. The c tile (rows h; the Npad - j0 >= 8 columns past j0 that exist) and the x tile.
  Tab* c = static_cast<Tab*>(p.c) + (b * p.H * p.Npad + i) * p.Npad + j0;
  const int64_t c_stride = p.Npad * p.Npad;
  const int c_cols = static_cast<int>(std::min<int64_t>(kRows, p.Npad - j0));
  copy_rows(ct, kLdc, H, c_cols, kRows, StridedRows<Tab>{c, c_stride, H}, SameRow{}, true);
  copy_rows(raw, ld_raw, kRows, P, P, StridedRows<Tx>{static_cast<const Tx*>(p.x) + pos * P, P, valid}, SameRow{}, true);
  cp_async_wait_all();
  __syncthreads();
  stage(0);  // lands under step 2

  // 2a. The gate input: LayerNorm(x), or x rounded to the operand type; rows past N zero.
  constexpr int kLnRows = kRows / kWarps;
  warp_layer_norm_rows(raw, ld_raw, us, L.ldp, warp * kLnRows, kLnRows, P, L.kp, p.ln_in_w, p.ln_in_b, p.eps,
                       p.gate_from_normalized, [&](int r) { return r < valid; });
  // 2b. c's statistics over h, (mean, rstd) per position into cstat.
  {
    using Lane = ColumnStatsLane<kPairsPerWarp>;
    float2 mu, rs;
    warp_pair_column_stats<kPairsPerWarp>(ct, kLdc, H, p.eps, mu, rs);
    if (Lane::part() == 0) {
      cstat[2 * Lane::pair()] = make_float2(mu.x, rs.x);
      cstat[2 * Lane::pair() + 1] = make_float2(mu.y, rs.y);
    }
  }
  __syncthreads();
  // 2c. chat (position-major, from the h-major tile: a thread per 8 h of a position) and u leave.
  {
    Tab* chat = static_cast<Tab*>(p.chat) + out_row * H;
    for (int e = threadIdx.x; e < valid * (H / 8); e += kBlockThreads) {
      const int r = e % valid, h0 = 8 * (e / valid);
      const float2 st = cstat[r];
      float v[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = (to_float(ct[(h0 + k) * kLdc + r]) - st.x) * st.y;
      store8(chat + r * H + h0, v);
    }
    store_rows(static_cast<Tab*>(p.u) + out_row * P, P, us, L.ldp, valid, P);
  }

  // 3. dy and dgp, 64 output channels at a time; then 4. dcn = dy . Wo and dx = dgp . Wg
  // (stages 0 .. p_stages - 1 and the rest of `stage` below).
  const Tx* G = static_cast<const Tx*>(p.grad) + pos * P;
  const int own = own_entry(g), own_col = col_off + (own / 2) * 8 + 2 * t + own % 2;
  float2 stat[2];  // (mean, rstd) of c at this thread's two rows
#pragma unroll
  for (int half = 0; half < 2; ++half) stat[half] = cstat[row0 + g + 8 * half];
  for (int k = 0; k < p_stages; ++k) {
    const int p0 = k * kCols + col_off;  // the warp's first channel
    // the output gradient at this thread's elements, in flight under the products (as stored)
    using G2 = typename Vec2<Tx>::type;
    G2 gin[kNTiles][2];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + g + 8 * half, ch = p0 + nt * 8 + 2 * t;
        gin[nt][half] = row < valid && ch < P ? *reinterpret_cast<const G2*>(G + row * P + ch) : Vec2<Tx>::pack(0.f, 0.f);
      }
    cp_async_wait_all();
    __syncthreads();  // stage k's weights ready
    float y[1][kNTiles][4] = {}, gt[1][kNTiles][4] = {};
    warp_mma<Tab, 1, kNTiles, true>(y, ct, kLdc, wa + col_off * L.ldh, L.ldh, row0, L.kh);
    warp_mma<Tab, 1, kNTiles, false>(gt, us, L.ldp, wb + col_off * L.ldp, L.ldp, row0, L.kp);
    __syncthreads();  // stage k's weights consumed
    stage(k + 1);
    float sum_dy[2 * kNTiles], sum_dg[2 * kNTiles];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int ch = p0 + nt * 8 + 2 * t;
      const bool in = ch < P;  // P % 16 == 0: ch + 1 < P with ch
      const float2 sv = in ? load2(p.s_out + ch) : make_float2(0.f, 0.f);
      const float2 tv = in ? load2(p.t_out + ch) : make_float2(0.f, 0.f);
      const float2 bv = in ? load2(p.b_gate + ch) : make_float2(0.f, 0.f);
      sum_dy[2 * nt] = sum_dy[2 * nt + 1] = sum_dg[2 * nt] = sum_dg[2 * nt + 1] = 0.f;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + g + 8 * half;
        const float mu = stat[half].x, rs = stat[half].y;
        const float yv0 = fmaf(rs, fmaf(-mu, sv.x, y[0][nt][2 * half]), tv.x);
        const float yv1 = fmaf(rs, fmaf(-mu, sv.y, y[0][nt][2 * half + 1]), tv.y);
        const float s0 = sigmoid_tanh(gt[0][nt][2 * half] + bv.x), s1 = sigmoid_tanh(gt[0][nt][2 * half + 1] + bv.y);
        const float2 gv = Vec2<Tx>::unpack(gin[nt][half]);
        const float dy0 = gv.x * s0, dy1 = gv.y * s1;
        const float dg0 = dy0 * yv0 * (1.f - s0), dg1 = dy1 * yv1 * (1.f - s1);
        sum_dy[2 * nt] += dy0, sum_dy[2 * nt + 1] += dy1, sum_dg[2 * nt] += dg0, sum_dg[2 * nt + 1] += dg1;
        if (in) {
          store2(dyt + row * L.ldp + ch, dy0, dy1);
          store2(dgt + row * L.ldp + ch, dg0, dg1);
        }
      }
    }
    column_sums_scatter(sum_dy);
    column_sums_scatter(sum_dg);
    const int ch = k * kCols + own_col;
    if (ch < P) wsum[rg * L.cols + 2 * H + ch] = sum_dy[0], wsum[rg * L.cols + 2 * H + P + ch] = sum_dg[0];
  }

  Tx* dx = static_cast<Tx*>(p.dx) + pos * P;
  float dcn[kMaxChunks][1][kNTiles][4] = {};  // hidden units 64 q + col_off + 8 nt + 2 t + {0, 1}
#pragma unroll
  for (int q = 0; q < kMaxChunks; ++q) {
    const int c0 = q * kCols;
    if (c0 >= H && c0 >= P) break;
    cp_async_wait_all();
    __syncthreads();  // this stage's weights ready; dy and dgp complete
    if (c0 < H) warp_mma<Tab, 1, kNTiles, false>(dcn[q], dyt, L.ldp, wa + col_off * L.ldp, L.ldp, row0, L.kp);
    float dxg[1][kNTiles][4] = {};
    if (c0 < P) warp_mma<Tab, 1, kNTiles, false>(dxg, dgt, L.ldp, wb + col_off * L.ldp, L.ldp, row0, L.kp);
    __syncthreads();  // this stage's weights consumed
    stage(p_stages + q + 1);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int ch = c0 + col_off + nt * 8 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + g + 8 * half;
        if (ch < P && row < valid) store2(dx + row * P + ch, dxg[0][nt][2 * half], dxg[0][nt][2 * half + 1]);
      }
    }
  }

  // LayerNorm's gradient, rows g and g + 8 of the row group: the row sums of dcn gamma and
  // dcn gamma chat, over the warp's hidden units, then with the other warp of the row group's.
  float2 part_sum[2] = {};
#pragma unroll
  for (int q = 0; q < kMaxChunks; ++q)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int h0 = q * kCols + col_off + nt * 8 + 2 * t;
      if (h0 >= H) continue;  // H % 16 == 0: h0 + 1 < H with h0
      const float2 gw = load2(p.ln_out_w + h0);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int half = e >> 1, row = row0 + g + 8 * half;
        const float xh = (to_float(ct[(h0 + (e & 1)) * kLdc + row]) - stat[half].x) * stat[half].y;
        const float dh = dcn[q][0][nt][e] * (e & 1 ? gw.y : gw.x);
        part_sum[half].x += dh, part_sum[half].y += dh * xh;
      }
    }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    part_sum[half] = make_float2(row_sum(part_sum[half].x), row_sum(part_sum[half].y));
    if (t == 0) row_part[cs * kRows + row0 + g + 8 * half] = part_sum[half];
  }
  __syncthreads();
  float mean1[2], mean2[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + 8 * half;
    float2 total = row_part[row];  // the row group's warps in order
#pragma unroll
    for (int c = 1; c < kColSplit; ++c) total.x += row_part[c * kRows + row].x, total.y += row_part[c * kRows + row].y;
    mean1[half] = total.x / static_cast<float>(H);
    mean2[half] = total.y / static_cast<float>(H);
  }
  // dc into ct in place (a thread rewrites only the elements it read); the column sums of dcn chat, dcn
#pragma unroll
  for (int q = 0; q < kMaxChunks; ++q) {
    if (q * kCols >= H) break;
    float sum_gx[2 * kNTiles], sum_g[2 * kNTiles];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int h0 = q * kCols + col_off + nt * 8 + 2 * t;
      const bool in = h0 < H;
      const float2 gw = in ? load2(p.ln_out_w + h0) : make_float2(0.f, 0.f);
      sum_gx[2 * nt] = sum_gx[2 * nt + 1] = sum_g[2 * nt] = sum_g[2 * nt + 1] = 0.f;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!in) continue;
        const int half = e >> 1, row = row0 + g + 8 * half;
        Tab& cell = ct[(h0 + (e & 1)) * kLdc + row];
        const float xh = (to_float(cell) - stat[half].x) * stat[half].y;
        const float d = dcn[q][0][nt][e], dh = d * (e & 1 ? gw.y : gw.x);
        cell = from_float<Tab>(stat[half].y * (dh - mean1[half] - xh * mean2[half]));
        sum_gx[2 * nt + (e & 1)] += d * xh, sum_g[2 * nt + (e & 1)] += d;
      }
    }
    column_sums_scatter(sum_gx);
    column_sums_scatter(sum_g);
    const int h = q * kCols + own_col;
    if (h < H) wsum[rg * L.cols + h] = sum_gx[0], wsum[rg * L.cols + H + h] = sum_g[0];
  }
  __syncthreads();

  // dc back into c's rows (positions past N untouched: the contraction's zeros stay); dy and dgp leave.
  {
    constexpr int kV = 8;  // 16 bytes
    const int groups = (valid + kV - 1) / kV;
    for (int e = threadIdx.x; e < H * groups; e += kBlockThreads) {
      const int h = e / groups, r0 = kV * (e % groups);
      Tab* dst = c + h * c_stride + r0;
      const Tab* src = ct + h * kLdc + r0;
      if (r0 + kV <= valid)
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
      else
        for (int r = 0; r < valid - r0; ++r) dst[r] = src[r];
    }
    store_rows(static_cast<Tab*>(p.dy) + out_row * P, P, dyt, L.ldp, valid, P);
    store_rows(static_cast<Tab*>(p.dgp) + out_row * P, P, dgt, L.ldp, valid, P);
    // the block's column sums: its row groups in order
    for (int col = threadIdx.x; col < L.cols; col += kBlockThreads) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kRowGroups; ++w) s += wsum[w * L.cols + col];
      p.partial[static_cast<int64_t>(blockIdx.x) * L.cols + col] = s;
    }
  }
}

template <typename Tab, typename Tx>
cudaError_t launch_typed(const OutStageBackParams& p, int64_t blocks, cudaStream_t stream) {
  const size_t smem = Smem::make(p.P, p.H).bytes;
  const cudaError_t e =
      cudaFuncSetAttribute(out_stage_back_kernel<Tab, Tx>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  out_stage_back_kernel<Tab, Tx><<<static_cast<unsigned>(blocks), kBlockThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename Tab>
cudaError_t launch_for_x(const OutStageBackParams& p, int64_t blocks, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_typed<Tab, __nv_bfloat16>(p, blocks, stream);
    case DType::f16: return launch_typed<Tab, __half>(p, blocks, stream);
    default: return launch_typed<Tab, float>(p, blocks, stream);
  }
}

}  // namespace

size_t out_stage_back_smem(int64_t P, int64_t H) { return Smem::make(P, H).bytes; }

int64_t out_stage_back_blocks(const OutStageBackParams& p) { return p.lines * ceil_div(p.N, kRows); }

cudaError_t launch_out_stage_back(const OutStageBackParams& p, cudaStream_t stream) {
  const int64_t blocks = out_stage_back_blocks(p), cols = 2 * p.H + 2 * p.P;
  if (blocks == 0) return cudaMemsetAsync(p.sums, 0, sizeof(float) * cols, stream);
  const cudaError_t e = p.op_dtype == DType::f16 ? launch_for_x<__half>(p, blocks, stream)
                                                 : launch_for_x<__nv_bfloat16>(p, blocks, stream);
  if (e != cudaSuccess) return e;
  return launch_column_sums(p.partial, blocks, cols, p.sums, stream);
}

}  // namespace trimul
