// out_stage_back: the output stage's backward in one kernel (trimul.h), 16-bit
// operands (bf16, fp16) on tensor cores, fp32 accumulation and elementwise math.
//
// Persistent blocks, one per SM, each holding the weights Wo' = Wo gamma and
// Wg for its whole life and running kGroups tile groups of 4 warps that walk
// their own 32-position tiles (positions j of one line (b, i)), each group with
// its own tiles and named barrier: one group's memory waits run under the
// others' products. Four groups on sm_90 with x in the operand type (226 KB of
// shared memory, laid out for P = H = 128 whatever the call's), two elsewhere.
// In a group a row group of 16 positions has two warps, each taking half of a
// product's 64 columns. (At P = H = 128 with x in the operand type on a 9.0
// device with sm_90a code, out_stage_back_resident.cu runs instead.) Per tile:
//  1. By cp.async: the c tile as the contraction left it, h-major (ct[h][j]);
//     the x tile into the gate-input tile us (or, x of another type, into a
//     raw tile that the dy and dgp tiles take later).
//  2. us becomes the gate input u (LayerNorm(x), or x rounded); c's LayerNorm
//     statistics per position (as ln_out_proj_gate_mma.cu); chat = (c - mean)
//     rstd and u leave for the weight gradients' products.
//  3. Output channels 64 at a time: y = rstd (c . W'^T - mean s) + t (s the row
//     sums of W'; as the forward) and g = u . Wg^T + bg (from x: plus x's mean
//     times g_round, Wg's rounding; trimul.h) per warp in registers,
//     with the output gradient G read at the same elements: dy = G sigmoid(g),
//     dgp = dy y (1 - sigmoid(g)) into the dy and dgp tiles.
//  4. dh = dy . W' (the gradient of LayerNorm's output times gamma, every hidden
//     unit of the warp's rows in registers) and dx = dgp . Wg (written out per
//     64 channels), both from the same resident weights read k-major; then
//     LayerNorm's gradient, dc = rstd (dh - mean(dh) - chat mean(dh chat)), into
//     ct in place, which leaves as the rows of c it came from.
// Column sums (sum dy, sum dgp; the LayerNorm affine's gradients come from
// dy^T chat and sum dy on the host): a thread's two rows, then the warp's eight
// lanes of a column by a reduce-scatter of shuffles, into a per-warp row of
// shared memory; the group adds its row groups in order into its running sums
// after each of its tiles (tiles in a fixed order), and writes them as its row
// of `partial`; column_sums adds the rows in order: bitwise repeatable on a
// given GPU.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "range.cuh"

namespace trimul {
namespace {

constexpr int kRows = static_cast<int>(kOutBackTileRows);  // positions per tile
constexpr int kRowGroups = kRows / 16;     // the warps' 16-row slices of the tile
constexpr int kColSplit = 2;               // warps per row group, each on a part of a product's columns
constexpr int kWarps = kRowGroups * kColSplit;
constexpr int kGroupThreads = kWarps * 32;  // a tile group
constexpr int kCols = 64;                  // output columns (channels, hidden units) per product
constexpr int kWarpCols = kCols / kColSplit;
constexpr int kNTiles = kWarpCols / 8;     // a warp's 8-column mma tiles per product
constexpr int kLdc = kRows + 8;            // ct row stride: 80 bytes, ldmatrix rows in distinct banks
constexpr int kPairsPerWarp = kRows / 2 / kWarps;  // c's statistics: warp_pair_column_stats
static_assert(kLdc % 16 == 8, "c's statistics: each warp load in distinct banks");
constexpr int kPad = 8;                    // elements of row padding (16 bytes)
constexpr int kWideGroups = 4;             // tile groups a block: 512 threads, sm_90 alone holds them in 128 registers
constexpr int kNarrowGroups = 2;           // 256 threads, every architecture
static_assert(kOutBackMaxWidth % kCols == 0, "width limit in whole chunks");

__host__ __device__ constexpr int round_up_cols(int n) { return (n + kCols - 1) / kCols * kCols; }

// Shared memory, laid out for the widest P and H whatever the call's (strides and
// offsets are constants): the weights W' and Wg, [kMaxW][kLd] each (rows and
// columns zero up to whole 64-column products, so that no product reads past
// them), the per-channel vectors (Vec; zero past P), then each group's tiles.
constexpr int kMaxW = static_cast<int>(kOutBackMaxWidth);
constexpr int kLd = kMaxW + kPad;          // the weights' and the position-major tiles' row stride
// The per-channel vectors each tile reads, resident in shared memory: rows of kMaxW floats.
struct Vec {
  enum { ln_in_w, ln_in_b, s_out, t_out, b_gate, g_round, kCount };
};
namespace smem_at {
constexpr size_t kWo = 0;
constexpr size_t kWg = kWo + 2 * kMaxW * kLd;
constexpr size_t kVec = kWg + 2 * kMaxW * kLd;  // float [Vec::kCount][kMaxW]
constexpr size_t kGroup0 = kVec + sizeof(float) * Vec::kCount * kMaxW;
constexpr size_t kTile = 2 * kRows * kLd;   // us, dy, dg: [kRows][kLd]
constexpr size_t kCt = 0;                   // within a group: ct [kMaxW][kLdc]
constexpr size_t kUs = kCt + 2 * kMaxW * kLdc;
constexpr size_t kDy = kUs + kTile;         // dy, dg: a raw x tile before (x in another type than the operands)
constexpr size_t kDg = kDy + kTile;
constexpr size_t kWsum = kDg + kTile;       // float [kRowGroups][2 kMaxW]
constexpr size_t kColsum = kWsum + sizeof(float) * kRowGroups * 2 * kMaxW;  // float [2 kMaxW]
constexpr size_t kCstat = kColsum + sizeof(float) * 2 * kMaxW;            // float2 [kRows]
constexpr size_t kXmean = kCstat + sizeof(float2) * kRows;              // float [kRows]: x's means (gate from x)
constexpr size_t kTileIndex = kXmean + sizeof(float) * kRows;           // int: the group's next tile
constexpr size_t kGroupBytes = kTileIndex + 16;
constexpr size_t bytes(int groups) { return kGroup0 + groups * kGroupBytes; }
static_assert(sizeof(float) * kRows * kMaxW <= 2 * kTile, "a raw fp32 x tile fits in dy and dg");
static_assert(bytes(kWideGroups) <= 227 * 1024, "the wide form fits an sm_90 block's shared memory");
}  // namespace smem_at

// The thread's tile group.
__device__ __forceinline__ int group_of_thread() { return static_cast<int>(threadIdx.x) / kGroupThreads; }

// The tile group's barrier (named barrier 1 + group; 0 is __syncthreads').
__device__ __forceinline__ void group_sync(int group) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(group + 1), "n"(kGroupThreads) : "memory");
}

// v summed over the four lanes of a row of the fragment layout (same g).
__device__ __forceinline__ float row_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// A group's copy: tile rows r < count (16-byte pieces of `cols` elements, ld apart) to dst rows r.
// A thread keeps one piece q of its rows (one division a call, not one a piece).
template <typename T>
__device__ __forceinline__ void store_rows(T* dst, int64_t dst_ld, const T* tile, int ld, int count, int cols,
                                           int tid) {
  constexpr int kV = 16 / sizeof(T);
  const int per_row = cols / kV, step = kGroupThreads / per_row;  // cols <= kMaxW: per_row <= kGroupThreads
  if (tid >= step * per_row) return;
  const int q = tid % per_row;
  for (int r = tid / per_row; r < count; r += step)
    *reinterpret_cast<uint4*>(dst + r * dst_ld + q * kV) = *reinterpret_cast<const uint4*>(tile + r * ld + q * kV);
}

template <typename Tab, typename Tx, int kGroups>
__device__ __forceinline__ void out_stage_back_tiles(const OutStageBackParams& p) {
  constexpr bool kInPlace = std::is_same<Tx, Tab>::value;
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = static_cast<int>(threadIdx.x) / kGroupThreads, tid = static_cast<int>(threadIdx.x) % kGroupThreads;
  Tab* wo = reinterpret_cast<Tab*>(smem + smem_at::kWo);  // [kMaxW][kLd]: W' (rows p, columns h)
  Tab* wg = reinterpret_cast<Tab*>(smem + smem_at::kWg);  // [kMaxW][kLd]: Wg (rows p, columns q)
  // [2 kMaxW]: the group's column sums (dy | dgp) over its tiles so far
  float* const colsum =
      reinterpret_cast<float*>(smem + smem_at::kGroup0 + group * smem_at::kGroupBytes + smem_at::kColsum);

  {  // The weights and vectors, once; the group's column sums start at zero.
    const int H = static_cast<int>(p.H), P = static_cast<int>(p.P), me = static_cast<int>(threadIdx.x);
    copy_rows(wo, kLd, round_up_cols(P), H, round_up_cols(H), StridedRows<Tab>{static_cast<const Tab*>(p.wo_g), H, P},
              SameRow{}, true, me, static_cast<int>(blockDim.x));
    copy_rows(wg, kLd, round_up_cols(P), P, round_up_cols(P), StridedRows<Tab>{static_cast<const Tab*>(p.wg), P, P},
              SameRow{}, true, me, static_cast<int>(blockDim.x));
    const float* const from[Vec::kCount] = {p.ln_in_w, p.ln_in_b, p.s_out, p.t_out, p.b_gate, p.g_round};
    float* const vec = reinterpret_cast<float*>(smem + smem_at::kVec);
#pragma unroll
    for (int v = 0; v < Vec::kCount; ++v)  // unrolled: `from` stays in registers
      for (int ch = me; ch < kMaxW; ch += static_cast<int>(blockDim.x)) vec[v * kMaxW + ch] = ch < P ? from[v][ch] : 0.f;
  }
  for (int col = tid; col < 2 * kMaxW; col += kGroupThreads) colsum[col] = 0.f;
  // The group's tiles: group g of block k takes tiles g gridDim + k + i kGroups gridDim, the next
  // one's index kept in shared memory (a register held across the loop would be one too many).
  int* const tile_slot = reinterpret_cast<int*>(smem + smem_at::kGroup0 + group * smem_at::kGroupBytes +
                                                smem_at::kTileIndex);
  if (tid == 0) *tile_slot = group * static_cast<int>(gridDim.x) + static_cast<int>(blockIdx.x);
  cp_async_wait_all();
  __syncthreads();

  for (;;) {
    // per-tile values (opaque_zero: the per-thread indices derived from it are recomputed each
    // tile, a few instructions, rather than held, with every address built from them, across the loop)
    const int zero = opaque_zero(), me = static_cast<int>(threadIdx.x) % kGroupThreads + zero;
    const int H = static_cast<int>(p.H) + zero, P = static_cast<int>(p.P) + zero, N = static_cast<int>(p.N) + zero;
    __builtin_assume(P >= 16 && H >= 16);  // multiples of 16 (trimul.h): every loop over them runs
    unsigned char* gs =
        smem + smem_at::kGroup0 + (static_cast<int>(threadIdx.x) / kGroupThreads + zero) * smem_at::kGroupBytes;
    const int tile = *reinterpret_cast<volatile int*>(gs + smem_at::kTileIndex);
    if (tile >= static_cast<int>(p.lines) * ((N + kRows - 1) / kRows)) break;
    const int p_chunks = (P + kCols - 1) / kCols, j_tiles = (N + kRows - 1) / kRows;
    // the group's tiles
    Tab* ct = reinterpret_cast<Tab*>(gs + smem_at::kCt);
    Tab* us = reinterpret_cast<Tab*>(gs + smem_at::kUs);
    Tab* dyt = reinterpret_cast<Tab*>(gs + smem_at::kDy);
    Tab* dgt = reinterpret_cast<Tab*>(gs + smem_at::kDg);
    Tx* raw = kInPlace ? reinterpret_cast<Tx*>(us) : reinterpret_cast<Tx*>(gs + smem_at::kDy);
    constexpr int ld_raw = kInPlace ? kLd : kMaxW;
    // [kRowGroups][2 kMaxW]: dy | dgp (the two warps of a row group write disjoint columns)
    float* wsum = reinterpret_cast<float*>(gs + smem_at::kWsum);
    float* tile_colsum = reinterpret_cast<float*>(gs + smem_at::kColsum);
    float2* row_part = reinterpret_cast<float2*>(gs + smem_at::kUs);  // [kColSplit][kRows], after u's last use
    float2* cstat = reinterpret_cast<float2*>(gs + smem_at::kCstat);  // [kRows]: (mean, rstd) of c
    float* xmean = reinterpret_cast<float*>(gs + smem_at::kXmean);     // [kRows]: x's (the gate from x)
    const int warp = me / 32, lane = me % 32, g = lane / 4, t = lane % 4;
    const int rg = warp % kRowGroups, cs = warp / kRowGroups;  // row group, column part
    const int row0 = rg * 16, col_off = cs * kWarpCols;       // the warp's rows; its columns in a product
    const int local_line = tile / j_tiles, j0 = (tile - local_line * j_tiles) * kRows;
    const int line = static_cast<int>(p.line0) + local_line;  // b N + i
    const int b = line / N, i = line - b * N;
    const int valid = min(kRows, N - j0);
    const int64_t pos = static_cast<int64_t>(line) * N + j0;              // the tile's first position in x, G, dx
    const int64_t out_row = static_cast<int64_t>(local_line) * N + j0;    // ... in chat, u, dy, dgp

    // 1. The c tile (rows h; the Npad - j0 >= 8 columns past j0 that exist) and the x tile.
    const int64_t c_stride = p.Npad * p.Npad;
    Tab* c = static_cast<Tab*>(p.c) + (static_cast<int64_t>(b) * H * p.Npad + i) * p.Npad + j0;
    const int c_cols = static_cast<int>(min(static_cast<int64_t>(kRows), p.Npad - j0));
    copy_rows(ct, kLdc, H, c_cols, kRows, StridedRows<Tab>{c, c_stride, H}, SameRow{}, true, me, kGroupThreads);
    copy_rows(raw, ld_raw, kRows, P, P, StridedRows<Tx>{static_cast<const Tx*>(p.x) + pos * P, P, valid}, SameRow{},
              true, me, kGroupThreads);
    cp_async_wait_all();
    group_sync(group_of_thread());

    // 2a. The gate input: LayerNorm(x), or x rounded to the operand type and its means; rows past N
    // zero.
    constexpr int kLnRows = kRows / kWarps;
    const float* const vec = reinterpret_cast<const float*>(smem + smem_at::kVec);
    warp_layer_norm_rows(raw, ld_raw, us, kLd, warp * kLnRows, kLnRows, P, P, vec + Vec::ln_in_w * kMaxW,
                         vec + Vec::ln_in_b * kMaxW, p.eps,
                         p.gate_from_normalized, [&](int r) { return r < valid; },
                         p.gate_from_normalized ? nullptr : xmean);
    // 2b. c's statistics over h, (mean, rstd) per position into cstat.
    {
      using Lane = ColumnStatsLane<kPairsPerWarp>;
      float2 mu, rs;
      warp_pair_column_stats<kPairsPerWarp>(ct, kLdc, H, headroom_c_eps(p.eps, p.headroom), warp, mu, rs);
      if (Lane::part() == 0) {
        cstat[2 * Lane::pair(warp)] = make_float2(mu.x, rs.x);
        cstat[2 * Lane::pair(warp) + 1] = make_float2(mu.y, rs.y);
      }
    }
    group_sync(group_of_thread());
    // 2c. chat (position-major, from the h-major tile: a thread per 8 h of a position, the same
    // position r = me % kRows in every step) and u leave.
    {
      static_assert(kGroupThreads % kRows == 0, "a thread's position the same in every step");
      Tab* chat = static_cast<Tab*>(p.chat) + out_row * H;
      const int r = me % kRows;
      if (r < valid) {
        const float2 st = cstat[r];
        for (int h0 = 8 * (me / kRows); h0 < H; h0 += 8 * (kGroupThreads / kRows)) {
          float v[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) v[k] = (to_float(ct[(h0 + k) * kLdc + r]) - st.x) * st.y;
          store8(chat + r * H + h0, v);
        }
      }
      store_rows(static_cast<Tab*>(p.u) + out_row * P, P, us, kLd, valid, P, me);
    }

    // 3. dy and dgp, 64 output channels at a time.
    const Tx* G = static_cast<const Tx*>(p.grad) + pos * P;
    // (mean, rstd) of c at this thread's two rows, read again in each step (not held across them)
    auto row_stats = [&](float2 (&st)[2]) {
#pragma unroll
      for (int half = 0; half < 2; ++half) st[half] = cstat[row0 + g + 8 * half];
    };
#pragma unroll 1
    for (int k = 0; k < p_chunks; ++k) {
      const int p0 = k * kCols + col_off;  // the warp's first channel
      float2 stat[2];
      row_stats(stat);
      float y[1][kNTiles][4] = {}, gt[1][kNTiles][4] = {};
      warp_mma<Tab, 1, kNTiles, true>(y, ct, kLdc, wo + p0 * kLd, kLd, row0, H);
      warp_mma<Tab, 1, kNTiles, false>(gt, us, kLd, wg + p0 * kLd, kLd, row0, P);
      // the output gradient at this thread's elements, as stored
      using G2 = typename Vec2<Tx>::type;
      G2 gin[kNTiles][2];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = row0 + g + 8 * half, ch = p0 + nt * 8 + 2 * t;
          gin[nt][half] = row < valid && ch < P ? *reinterpret_cast<const G2*>(G + row * P + ch) : Vec2<Tx>::pack(0.f, 0.f);
        }
      float sum_dy[2 * kNTiles], sum_dg[2 * kNTiles];
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int ch = p0 + nt * 8 + 2 * t;
        const bool in = ch < P;  // P % 16 == 0: ch + 1 < P with ch
        const float2 sv = load2(vec + Vec::s_out * kMaxW + ch);  // zero past P
        const float2 tv = load2(vec + Vec::t_out * kMaxW + ch);
        const float2 bv = load2(vec + Vec::b_gate * kMaxW + ch);
        const float2 gr = load2(vec + Vec::g_round * kMaxW + ch);
        sum_dy[2 * nt] = sum_dy[2 * nt + 1] = sum_dg[2 * nt] = sum_dg[2 * nt + 1] = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = row0 + g + 8 * half;
          const float mu = stat[half].x, rs = stat[half].y;
          // x's mean at the row (read where used: held across the products, it spilled in the wide form):
          // the gate from x adds mean(x) g_round
          const float mx = p.gate_from_normalized ? 0.f : xmean[row];
          const float yv0 = fmaf(rs, fmaf(-mu, sv.x, y[0][nt][2 * half]), tv.x);
          const float yv1 = fmaf(rs, fmaf(-mu, sv.y, y[0][nt][2 * half + 1]), tv.y);
          const SigmoidPair s0 = sigmoid_pair(gt[0][nt][2 * half] + fmaf(mx, gr.x, bv.x));
          const SigmoidPair s1 = sigmoid_pair(gt[0][nt][2 * half + 1] + fmaf(mx, gr.y, bv.y));
          const float2 gv = Vec2<Tx>::unpack(gin[nt][half]);
          const float dy0 = gv.x * s0.s, dy1 = gv.y * s1.s;
          const float dg0 = dy0 * yv0 * s0.one_minus_s, dg1 = dy1 * yv1 * s1.one_minus_s;
          sum_dy[2 * nt] += dy0, sum_dy[2 * nt + 1] += dy1, sum_dg[2 * nt] += dg0, sum_dg[2 * nt + 1] += dg1;
          if (in) {
            store2(dyt + row * kLd + ch, dy0, dy1);
            store2(dgt + row * kLd + ch, dg0, dg1);
          }
        }
      }
      // v[2 nt + e]: column 8 nt + 2 t + e of the warp's kNTiles 8-column tiles; lane (g, t) keeps
      // the sum of entry scatter_first<8>(g)
      column_sums_scatter(sum_dy);
      column_sums_scatter(sum_dg);
      const int own = scatter_first<2 * kNTiles>((lane + opaque_zero()) / 4);
      const int ch = k * kCols + col_off + (own / 2) * 8 + 2 * t + own % 2;
      if (ch < P) wsum[rg * 2 * kMaxW + ch] = sum_dy[0], wsum[rg * 2 * kMaxW + kMaxW + ch] = sum_dg[0];
    }
    group_sync(group_of_thread());  // dy and dgp complete; us free

    // 4. dx = dgp . Wg and dh = dy . W', 64 columns at a time, both from the resident weights read
    // k-major; dx leaves as it comes, dh stays in registers.
    Tx* dx = static_cast<Tx*>(p.dx) + pos * P;
    for (int c0 = 0; c0 < P; c0 += kCols) {
      float dxg[1][kNTiles][4] = {};
      warp_mma<Tab, 1, kNTiles, false, false, true>(dxg, dgt, kLd, wg + c0 + col_off, kLd, row0, P);
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
    // LayerNorm's gradient, rows g and g + 8 of the row group: dh for every hidden unit of the
    // warp's rows in registers; the row sums of dh and dh chat over them, then with the other warp
    // of the row group's; then dc.
    constexpr int kMaxChunks = kMaxW / kCols;
    float dh[kMaxChunks][1][kNTiles][4] = {};  // hidden units 64 q + col_off + 8 nt + 2 t + {0, 1}
#pragma unroll
    for (int q = 0; q < kMaxChunks; ++q)
      if (q * kCols < H)
        warp_mma<Tab, 1, kNTiles, false, false, true>(dh[q], dyt, kLd, wo + q * kCols + col_off, kLd, row0, P);
    float2 part_sum[2] = {}, stat[2];
    row_stats(stat);
#pragma unroll
    for (int q = 0; q < kMaxChunks; ++q)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int h0 = q * kCols + col_off + nt * 8 + 2 * t;
        if (h0 >= H) continue;  // H % 16 == 0: h0 + 1 < H with h0
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1, row = row0 + g + 8 * half;
          const float xh = (to_float(ct[(h0 + (e & 1)) * kLdc + row]) - stat[half].x) * stat[half].y;
          const float d = dh[q][0][nt][e];
          part_sum[half].x += d, part_sum[half].y += d * xh;
        }
      }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      part_sum[half] = make_float2(row_sum(part_sum[half].x), row_sum(part_sum[half].y));
      if (t == 0) row_part[cs * kRows + row0 + g + 8 * half] = part_sum[half];
    }
    group_sync(group_of_thread());
    float mean1[2], mean2[2];
    row_stats(stat);
    const float inv_h = 1.f / static_cast<float>(H);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + g + 8 * half;
      float2 total = row_part[row];  // the row group's warps in order
#pragma unroll
      for (int c = 1; c < kColSplit; ++c) total.x += row_part[c * kRows + row].x, total.y += row_part[c * kRows + row].y;
      mean1[half] = total.x * inv_h;
      mean2[half] = total.y * inv_h;
    }
    // dc into ct in place (a thread rewrites only the elements it read)
#pragma unroll
    for (int q = 0; q < kMaxChunks; ++q)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt) {
        const int h0 = q * kCols + col_off + nt * 8 + 2 * t;
        if (h0 >= H) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1, row = row0 + g + 8 * half;
          Tab& cell = ct[(h0 + (e & 1)) * kLdc + row];
          const float xh = (to_float(cell) - stat[half].x) * stat[half].y;
          cell = from_float<Tab>(stat[half].y * (dh[q][0][nt][e] - mean1[half] - xh * mean2[half]));
        }
      }
    group_sync(group_of_thread());

    // dc back into c's rows (positions past N untouched: the contraction's zeros stay); dy and dgp leave;
    // the tile's column sums join the group's, its row groups in order.
    {
      constexpr int kV = 8, kPieces = kRows / kV;  // 16-byte pieces of a row of ct
      for (int e = me; e < H * kPieces; e += kGroupThreads) {
        const int h = e / kPieces, r0 = kV * (e % kPieces);
        if (r0 >= valid) continue;
        Tab* dst = c + h * c_stride + r0;
        const Tab* src = ct + h * kLdc + r0;
        if (r0 + kV <= valid)
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
        else
          for (int r = 0; r < valid - r0; ++r) dst[r] = src[r];
      }
      store_rows(static_cast<Tab*>(p.dy) + out_row * P, P, dyt, kLd, valid, P, me);
      store_rows(static_cast<Tab*>(p.dgp) + out_row * P, P, dgt, kLd, valid, P, me);
      for (int col = me; col < 2 * kMaxW; col += kGroupThreads) {
        float s = tile_colsum[col];
#pragma unroll
        for (int w = 0; w < kRowGroups; ++w) s += wsum[w * 2 * kMaxW + col];
        tile_colsum[col] = s;
      }
      if (me == 0)
        *reinterpret_cast<volatile int*>(gs + smem_at::kTileIndex) = tile + static_cast<int>(gridDim.x) * kGroups;
    }
    group_sync(group_of_thread());  // the tiles free for the next tile's copies; its index set
  }
  const int P = static_cast<int>(p.P), me = static_cast<int>(threadIdx.x);
  float* const sums = reinterpret_cast<float*>(smem + smem_at::kGroup0 + (me / kGroupThreads) * smem_at::kGroupBytes +
                                               smem_at::kColsum);
  float* partial = p.partial + static_cast<int64_t>(blockIdx.x * kGroups + me / kGroupThreads) * 2 * P;
  for (int col = me % kGroupThreads; col < 2 * P; col += kGroupThreads)
    partial[col] = sums[col < P ? col : col - P + kMaxW];
}

// Four groups of 4 warps (512 threads: at most 128 registers a thread, which
// holds x in the operand type without spilling on sm_90 alone), or two.
template <typename Tab, typename Tx, int kGroups>
__global__ void __launch_bounds__(kGroupThreads * kGroups, 1) out_stage_back_kernel(const OutStageBackParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  if constexpr (kGroups == kWideGroups)
    __trap();  // out_stage_back_launch plans the wide form on compute capability 9.0 only
  else
#endif
    out_stage_back_tiles<Tab, Tx, kGroups>(p);
}

template <typename Tab, typename Tx, int kGroups>
cudaError_t launch_typed(const OutStageBackParams& p, const OutBackLaunch& run, cudaStream_t stream) {
  const size_t smem = smem_at::bytes(kGroups);
  const cudaError_t e = allow_dynamic_smem(reinterpret_cast<const void*>(out_stage_back_kernel<Tab, Tx, kGroups>), smem);
  if (e != cudaSuccess) return e;
  out_stage_back_kernel<Tab, Tx, kGroups>
      <<<static_cast<unsigned>(run.blocks), kGroupThreads * kGroups, smem, stream>>>(p);
  return cudaGetLastError();
}

// The wide form for x in the operand type where launch planned it, else the narrow one.
template <typename Tab, typename Tx>
cudaError_t launch_groups(const OutStageBackParams& p, const OutBackLaunch& run, cudaStream_t stream) {
  if constexpr (std::is_same<Tab, Tx>::value)
    if (run.groups == kWideGroups) return launch_typed<Tab, Tx, kWideGroups>(p, run, stream);
  return launch_typed<Tab, Tx, kNarrowGroups>(p, run, stream);
}

template <typename Tab>
cudaError_t launch_for_x(const OutStageBackParams& p, const OutBackLaunch& run, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_groups<Tab, __nv_bfloat16>(p, run, stream);
    case DType::f16: return launch_groups<Tab, __half>(p, run, stream);
    default: return launch_groups<Tab, float>(p, run, stream);
  }
}

}  // namespace

size_t out_stage_back_smem() { return smem_at::bytes(kNarrowGroups); }

OutBackLaunch out_stage_back_launch(const OutStageBackParams& p) {
  if (out_stage_back_resident_takes(p)) return out_stage_back_resident_launch(p);
  OutBackLaunch run{};
  // the wide form for x in the operand type on sm_90 (the kernel's form for it), where the shared memory holds it
  const bool in_place = p.x_dtype == p.op_dtype;
  const bool wide = in_place && p.cc == 90 && smem_at::bytes(kWideGroups) <= static_cast<size_t>(p.smem_optin);
  run.groups = wide ? kWideGroups : kNarrowGroups;
  const int64_t tiles = p.lines * ceil_div(p.N, static_cast<int64_t>(kRows));
  run.blocks = std::min<int64_t>(p.sms, ceil_div(tiles, static_cast<int64_t>(run.groups)));
  return run;
}

cudaError_t launch_out_stage_back(const OutStageBackParams& p, const OutBackLaunch& run, cudaStream_t stream) {
  const int64_t rows = run.blocks * run.groups, cols = 2 * p.P;
  if (run.blocks == 0) return cudaMemsetAsync(p.sums, 0, sizeof(float) * cols, stream);
  const cudaError_t e = run.resident               ? launch_out_stage_back_resident(p, run.blocks, stream)
                        : p.op_dtype == DType::f16 ? launch_for_x<__half>(p, run, stream)
                                                   : launch_for_x<__nv_bfloat16>(p, run, stream);
  if (e != cudaSuccess) return e;
  return launch_column_sums(p.partial, rows, cols, p.sums, stream);
}

}  // namespace trimul
