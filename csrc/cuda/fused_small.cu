// fused_small: the whole update in one launch, for problems so small that the
// four-stage pipeline would spend its time on launches (the seed's shape does
// ~1 us of arithmetic).
//
// One cooperative grid; grid-wide barriers separate the phases.
//   phase 1, items = (64 rows of x) x (a group of 64-column tiles of the virtual
//       input weight, one tile where the rows alone fill the grid):
//       LayerNorm, the four input projections, gating and mask -> a, b
//       (channel-first [B*H][N][N], contraction index contiguous, as
//       ln_proj_gate writes them), and the output gate sigmoid(u.Wg^T + bg)
//       -> g ([B][N][N][P], by output position)
//   then, where one round of 4 x 4 position items covers the problem and H is
//   one pass of hidden units (the seed's shape):
//   phase 2, items = (batch, 4 x 4 output positions):
//       c = the triangle product, LayerNorm over H, output projection, times g
//   else (three phases: phase 2's items would each stage their rows of a and b
//   for every hidden unit, B N^2 H / 2 floats a round through L2 in all, and
//   its time is that traffic):
//   phase 2, items = (batch, hidden unit): the plane c[b, h] = a[b, h] b[b, h]^T
//       -> c (channel-first [B*H][N][N]), a and b read once
//   phase 3, items = (batch, a run of positions): c's values of the run,
//       LayerNorm over H, output projection, times g
//
// The virtual input weight has 4H interleaved rows (4h + {proj_a, gate_a,
// proj_b, gate_b}, as PackedLayout) padded to a multiple of 64, then the P rows
// of the output gate, so a 64-column item is either a/b or gate. Parameters
// are read where the caller keeps them when they share one dtype (fp32 or x's)
// and have contiguous rows; the binding packs any other mix first. a, b, g live
// in a workspace that stays in L2 at these sizes.
//
// Every operand sits in shared memory row-major (the reduction index
// contiguous, rows zero-padded to a multiple of 4; phase 1's to 8). Phase 1's
// product runs on tensor cores as 3xTF32 (three tf32 mma.sync a term: fp32
// accuracy); phase 2's are register tiles of rows x 4 columns fed by float4
// reads along k, on CUDA cores. At these sizes the
// kernel is a chain of latencies (DRAM, L2, shared memory, barriers), not of
// FLOPs: each item issues all of its global loads at once, index math is 32-bit,
// and phase 2's items are small enough (16 positions) to occupy every SM; the
// first phase-2 item's parameters load before the grid barrier
// (benchmarks/NOTES.md, "Small problems").
#include <cooperative_groups.h>

#include <algorithm>
#include <type_traits>

#include "mma.cuh"  // cp.async helpers

namespace trimul {
namespace cg = cooperative_groups;

constexpr int kQuad = 4;  // a thread's columns; also the float4 width along k
// phase 1: the 64 x 64 tile on mma.sync, a warp's part 16 rows x 32 columns (four 8-column tiles)
constexpr int kMmaRows = 16, kMmaCols = 32, kMmaColTiles = kMmaCols / 8;
constexpr int kMmaRowWarps = kTileRows / kMmaRows;
static_assert(kMmaRowWarps * (kTileCols / kMmaCols) * 32 == kThreads, "phase-1 warp tiles");
// phase 2: 4 x 4 output positions per item; the projection's thread = a position x 4 columns
constexpr int kSideTile = 4;
constexpr int kPositions = kSideTile * kSideTile;
static_assert(kPositions * (kTileCols / kQuad) == kThreads, "phase-2 thread tile");
// the product's thread = (hidden unit, i) x 4 j, over every kKSplit-th group of 4 k
constexpr int kKSplit = 2;
constexpr int kHiddenPass = kThreads / (kSideTile * kKSplit);  // hidden units per pass
constexpr int64_t kPairBudget = 12 * 1024;  // floats of a/b staged per round in phase 2
// Three phases where the two-phase form's phase 2 takes more than one round of kRoundItems items, or
// more than one pass of hidden units per item.
constexpr int64_t kRoundItems = 128;
// Phase 3 (three phases): positions per item a multiple of kRunRows, about B N^2 / kRoundItems, at
// most kMaxRun; a run is projected kRunRows positions at a time (two a thread: kRunRows / 16).
constexpr int kRunRows = 32;
constexpr int64_t kMaxRun = 8 * kRunRows;
constexpr int kRunThreadRows = kRunRows / kPositions;  // a thread's positions of a projection pass

template <typename Tw>
__device__ __forceinline__ float read(const ParamRef& t, int64_t r, int64_t c = 0) {
  return t.ptr ? to_float(static_cast<const Tw*>(t.ptr)[r * t.ld + c]) : t.fill;
}

// read(t[q], r, c) with q known only at run time; selecting the fields (not
// indexing the array) keeps the kernel parameters out of local memory.
template <typename Tw>
__device__ __forceinline__ float read_of4(const ParamRef (&t)[4], int64_t q, int64_t r, int64_t c = 0) {
  ParamRef s;
  s.ptr = q == 0 ? t[0].ptr : q == 1 ? t[1].ptr : q == 2 ? t[2].ptr : t[3].ptr;
  s.ld = q == 0 ? t[0].ld : q == 1 ? t[1].ld : q == 2 ? t[2].ld : t[3].ld;
  s.fill = q == 0 ? t[0].fill : q == 1 ? t[1].fill : q == 2 ? t[2].fill : t[3].fill;
  return read<Tw>(s, r, c);
}

__host__ __device__ inline int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }
// Shared-memory rows holding `len` floats: a multiple of 4 floats whose quotient
// by 4 is odd, so float4 reads of 8 consecutive rows hit 8 distinct bank groups.
__host__ __device__ inline int64_t row_ld(int64_t len) { return 4 * (2 * ceil_div(len, 8) + 1); }
__host__ __device__ inline int64_t gate_column0(int64_t H) { return ceil_div(4 * H, kTileCols) * kTileCols; }

// Stages `rows` rows of `len` elements of T into shared memory as float:
// dst[r * ld + k] = row_ptrs[r][k] for k < len, zeros up to round4(len) and
// for null rows. A lane copies a piece of 4 elements; a row takes the smallest
// power of two of lanes that covers its pieces (at most 32), so a warp copies
// several short rows at once. fp32 pieces go by cp.async (one 16-byte copy where
// the row is 16-byte aligned and len % 4 == 0), in flight until the caller's
// cp_async_wait_all(); other types through registers. One out-of-line copy
// serves every call site of a type.
template <typename T>
__device__ __noinline__ void stage_rows(const void* const* row_ptrs, int rows, int len, float* dst, int ld) {
  const int pieces = (len + 3) / 4;
  int shift = 0;  // log2 of the lanes per row
  while ((1 << shift) < pieces && shift < 5) ++shift;
  const int lanes = 1 << shift, lane = threadIdx.x % 32, piece0 = lane & (lanes - 1);
  for (int r = ((threadIdx.x / 32) << (5 - shift)) + (lane >> shift); r < rows; r += kThreads >> shift) {
    const T* src = static_cast<const T*>(row_ptrs[r]);
    float* d = dst + r * ld;
    if constexpr (std::is_same_v<T, float>) {
      const bool whole = src && len % 4 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0;
      for (int k = 4 * piece0; k < len; k += 4 * lanes) {
        if (whole) {
          cp_async16(d + k, src + k);
          continue;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (src && k + e < len) cp_async4(d + k + e, src + k + e);
          else d[k + e] = 0.f;
        }
      }
    } else {
      for (int k = 4 * piece0; k < len; k += 4 * lanes) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = src && k + e < len ? to_float(src[k + e]) : 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) d[k + e] = v[e];
      }
    }
  }
}

// acc[u][v] += sum_{k < k_len} xr[(r0 + u * r_step) * x_ld + k] * wr[(c0 + v) * w_ld + k],
// k_len a multiple of 4, both operands read as float4 along k. The next float4s
// load while the current ones multiply, and each component's kR x 4 FMAs are
// independent of one another (the accumulator chains interleave).
template <int kR>
__device__ __forceinline__ void multiply_rows(const float* xr, int x_ld, const float* wr, int w_ld, int k_len, int r0,
                                              int r_step, int c0, float (&acc)[kR][kQuad]) {
  float4 xv[kR], wv[kQuad];
  const auto load = [&](int k) {
#pragma unroll
    for (int u = 0; u < kR; ++u) xv[u] = *reinterpret_cast<const float4*>(xr + (r0 + u * r_step) * x_ld + k);
#pragma unroll
    for (int v = 0; v < kQuad; ++v) wv[v] = *reinterpret_cast<const float4*>(wr + (c0 + v) * w_ld + k);
  };
  load(0);
#pragma unroll 1
  for (int k = 0; k < k_len; k += 4) {
    float x[kR][4], w[kQuad][4];
#pragma unroll
    for (int u = 0; u < kR; ++u) {
      x[u][0] = xv[u].x, x[u][1] = xv[u].y, x[u][2] = xv[u].z, x[u][3] = xv[u].w;
    }
#pragma unroll
    for (int v = 0; v < kQuad; ++v) {
      w[v][0] = wv[v].x, w[v][1] = wv[v].y, w[v][2] = wv[v].z, w[v][3] = wv[v].w;
    }
    if (k + 4 < k_len) load(k + 4);
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int u = 0; u < kR; ++u)
#pragma unroll
        for (int v = 0; v < kQuad; ++v) acc[u][v] = fmaf(x[u][e], w[v][e], acc[u][v]);
  }
}

// LayerNorm, in place, of rows 0 ... kRows - 1 of buf[r * ld + k], k < len, with
// weight affine[k] and bias affine[round4(len) + k]: kThreads / kRows threads per
// row, two passes. Everything moves as float4 (a row's padding up to round4(len)
// holds zeros and keeps them), kBatch float4s of a thread at a time, all loads of
// a batch before its arithmetic: at these sizes the LayerNorm is a chain of
// shared-memory latencies, and this keeps it short.
template <int kRows>
__device__ __forceinline__ void normalize_rows(float* buf, int ld, int len, const float* affine, float eps) {
  constexpr int kParts = kThreads / kRows, kBatch = 4, kStep = kQuad * kParts;
  static_assert(kParts <= 32 && (kParts & (kParts - 1)) == 0, "a row's threads share a warp");
  float* v = buf + (threadIdx.x / kParts) * ld;
  const float* bias = affine + round4(len);
  const int k0 = kQuad * (threadIdx.x % kParts);
  const auto at = [&](const float* base, int k) { return *reinterpret_cast<const float4*>(base + k); };
  // f(k, v[k ... k + 3]) for each of the thread's float4s, kBatch loads in flight at a time
  const auto each_float4 = [&](auto&& f) {
    for (int kb = k0; kb < len; kb += kBatch * kStep) {
      float4 q[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        q[u] = kb + u * kStep < len ? at(v, kb + u * kStep) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int u = 0; u < kBatch; ++u) f(kb + u * kStep, q[u]);
    }
  };
  float sum = 0.f;
  each_float4([&](int, const float4& q) { sum += (q.x + q.y) + (q.z + q.w); });
#pragma unroll
  for (int o = 1; o < kParts; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float mu = sum / static_cast<float>(len);
  float sq = 0.f;
  each_float4([&](int k, const float4& q) {  // padding and absent float4s contribute nothing
    const float d[kQuad] = {q.x - mu, q.y - mu, q.z - mu, q.w - mu};
#pragma unroll
    for (int e = 0; e < kQuad; ++e) sq = k + e < len ? fmaf(d[e], d[e], sq) : sq;
  });
#pragma unroll
  for (int o = 1; o < kParts; o <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  const float rs = rsqrtf(sq / static_cast<float>(len) + eps);
  for (int kb = k0; kb < len; kb += kBatch * kStep) {
    float4 q[kBatch], w[kBatch], c[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (kb + u * kStep < len) {
        q[u] = at(v, kb + u * kStep);
        w[u] = at(affine, kb + u * kStep);
        c[u] = at(bias, kb + u * kStep);
      }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int k = kb + u * kStep;
      if (k >= len) break;
      const float4 r = make_float4(k + 0 < len ? (q[u].x - mu) * rs * w[u].x + c[u].x : 0.f,
                                   k + 1 < len ? (q[u].y - mu) * rs * w[u].y + c[u].y : 0.f,
                                   k + 2 < len ? (q[u].z - mu) * rs * w[u].z + c[u].z : 0.f,
                                   k + 3 < len ? (q[u].w - mu) * rs * w[u].w + c[u].w : 0.f);
      *reinterpret_cast<float4*>(v + k) = r;
    }
  }
}

// What the kernel needs of the shape, computed once on the host. 32-bit: the
// dispatcher keeps the workspace (the largest index space here) below 2^31
// elements, and 64-bit divisions would cost the kernel microseconds.
//
// Dynamic shared memory, offsets in floats (each a multiple of 4: 16-byte
// aligned). Phase-1 and phase-2 regions overlap; the grid barrier separates them.
//   ptrs      row pointers for stage_rows (at 0): phase 1 the 64 rows of x and
//             64 weight rows for each of its two weight tiles; phase 2 the a and b
//             rows of a chunk (2 x hc x 4), then the 64 rows of Wo
//   phase 1   xr [64][ld_p]: the x tile, normalized in place; wr [2][64][ld_p]: two weight tiles
//   phase 2   pairs [2][hc * 4][ld_n]: a[b, h, i0 + s, :] at row (h - h0) * 4 + s, then b's;
//             wo [64][ld_h]: rows p0 ... p0 + 63 of Wo; cr [16][ld_h]: c, then LayerNorm(c)
//   affine    [2][round4(max(P, H))]: a LayerNorm weight, then its bias at round4(len)
//   tile      [3][64]: phase 1 the masks of its rows, then the biases of each weight tile's
//             columns; phases 2 and 3 the biases of Wo's rows staged
//   three phases:
//   phase 2   planes [2][round4(N)][ld_n]: a[b, h], then b[b, h], zero rows past N (row pointers: 2 round4(N))
//   phase 3   wo as phase 2's; runs [run][ld_h]: c of the item's positions, then LayerNorm(c)
//   workspace a, b [B*H][N][N], g [B][N][N][P], then (three phases) c [B*H][N][N]
struct Plan {
  int B, N, P, H, p8;  // p8: P rounded up to the mma's k step (8), the product's reduction length
  int col_tiles, inputs, side_tiles, outputs, gate0;  // phase-1 column tiles and items; phase-2 items
  int col_group, groups;  // phase 1: column tiles per item (a group), groups per row tile
  int ld_p, ld_n, ld_h, hc;
  int xr, wr, pairs, wo, cr, affine, tile;
  // three phases: phase-2 items (B H) and phase-3 items (B runs_per_b of `run` positions); c's
  // offset in the workspace; runs in shared memory (0: two phases)
  int three, run, runs_per_b, runs, c, runs_at;
};

__host__ __device__ inline bool three_phases(int64_t B, int64_t N, int64_t H) {
  const int64_t side = ceil_div(N, kSideTile);
  return H > kHiddenPass || B * side * side > kRoundItems;
}

// Fills *out (if given); returns the shared memory in floats.
int64_t plan_launch(int64_t B, int64_t N, int64_t P, int64_t H, Plan* out) {
  const int64_t ld_p = row_ld(P), ld_n = row_ld(N), ld_h = row_ld(H);
  const bool three = three_phases(B, N, H);
  const int64_t per_h = 2 * kSideTile * ld_n;
  const int64_t fit = kPairBudget / per_h / kHiddenPass * kHiddenPass;
  const int64_t all = ceil_div(H, kHiddenPass) * kHiddenPass;
  const int64_t hc = three ? 0 : fit < kHiddenPass ? kHiddenPass : (fit < all ? fit : all);
  const int64_t n_ptrs = std::max<int64_t>({kTileRows + 2 * kTileCols, 2 * kSideTile * hc + kTileCols, 2 * round4(N) * three});
  const int64_t base = round4(2 * n_ptrs);  // 8-byte pointers
  const int64_t wr = base + kTileRows * ld_p, end1 = wr + 2 * kTileCols * ld_p;
  const int64_t wo = base + hc * per_h, cr = wo + kTileCols * ld_h, end2 = cr + kPositions * ld_h;
  const int64_t run = std::min(kMaxRun, kRunRows * std::max<int64_t>(1, ceil_div(B * N * N, kRunRows * kRoundItems)));
  const int64_t end3 = three ? std::max(base + 2 * round4(N) * ld_n, cr + run * ld_h) : 0;
  const int64_t affine = std::max<int64_t>({end1, end2, end3}), tile = affine + 2 * round4(std::max(P, H));
  if (out) {
    const auto i = [](int64_t v) { return static_cast<int>(v); };
    const int64_t col_tiles = ceil_div(gate_column0(H) + P, kTileCols), side_tiles = ceil_div(N, kSideTile);
    const int64_t runs_per_b = ceil_div(N * N, run), row_tiles = ceil_div(B * N * N, kTileRows);
    // phase 1: a row tile's column tiles in groups of col_group, chosen for the shortest
    // estimated chain: rounds of items (kRoundItems a round) times (staging and LayerNorm, about
    // a tile's product and epilogue, plus the group's tiles)
    int64_t col_group = 1, best = -1;
    for (int64_t g = 1; g <= col_tiles; ++g) {
      const int64_t cost = ceil_div(row_tiles * ceil_div(col_tiles, g), kRoundItems) * (1 + g);
      if (best < 0 || cost < best) best = cost, col_group = g;
    }
    const int64_t groups = ceil_div(col_tiles, col_group);
    *out = Plan{i(B), i(N), i(P), i(H), i((P + 7) / 8 * 8),
                i(col_tiles), i(row_tiles * groups), i(side_tiles),
                i(three ? B * H : B * side_tiles * side_tiles), i(gate_column0(H)), i(col_group), i(groups),
                i(ld_p), i(ld_n), i(ld_h), i(hc),
                i(base), i(wr), i(base), i(wo), i(cr), i(affine), i(tile),
                three, i(run), i(runs_per_b), i(three ? B * runs_per_b : 0), i(B * N * N * (2 * H + P)), i(cr)};
  }
  return tile + kTileRows + 2 * kTileCols;
}

size_t fused_small_smem(int64_t B, int64_t N, int64_t P, int64_t H) {
  return plan_launch(B, N, P, H, nullptr) * sizeof(float);
}

int64_t fused_small_workspace(int64_t B, int64_t N, int64_t P, int64_t H) {
  return B * N * N * (2 * H + P + (three_phases(B, N, H) ? H : 0));
}

// A LayerNorm's weight and bias (len elements each) into affine[0 ...] and
// affine[round4(len) ...], as normalize_rows reads them; both loads of an
// element in flight before either store.
template <typename Tw>
__device__ __forceinline__ void load_affine(const ParamRef& weight, const ParamRef& bias, int len, float* affine) {
  for (int k = threadIdx.x; k < len; k += kThreads) {
    const float w = read<Tw>(weight, k), c = read<Tw>(bias, k);
    affine[k] = w;
    affine[round4(len) + k] = c;
  }
}

// ---- phase 1 -------------------------------------------------------------------
// 64 rows x a group of 64-column tiles [col_first, col_end): x, the first tile's weights, the
// LayerNorm affine and the rows' masks staged with every load in flight at once, LayerNorm once,
// then per tile the product from shared memory while the next tile's weights (two buffers, a
// row-pointer table and biases each) are in flight. Where the gate reads x itself, the group's
// gate tiles (the last columns) go first, before LayerNorm overwrites x.
template <typename Tx, typename Tw>
__device__ __forceinline__ void input_item(const FusedSmallParams& p, const Plan& L, float* sm, int row_tile,
                                           int col_first, int col_end) {
  const void** ptrs = reinterpret_cast<const void**>(sm);  // [0, 64): x rows, then 64 weight rows a buffer
  float* xr = sm + L.xr;
  float* affine = sm + L.affine;
  float* mask = sm + L.tile;  // [64], then the buffers' biases [2][64]
  const int t = threadIdx.x, N = L.N, NN = N * N, P = L.P, H = L.H, rows = L.B * NN;
  const int q0 = row_tile * kTileRows;
  const int gate_first = max(col_first, L.gate0 / kTileCols);  // the group's gate tiles: [gate_first, col_end)
  const int n_gate = max(0, col_end - gate_first), count = col_end - col_first;
  const bool raw_gate = !p.gate_from_normalized && n_gate > 0;  // gate tiles first, on x itself
  // the k-th tile in processing order, and whether it reads x normalized
  const auto tile_at = [&](int k) { return raw_gate ? (k < n_gate ? gate_first + k : col_first + k - n_gate) : col_first + k; };
  const auto normalized = [&](int col_tile) { return col_tile * kTileCols < L.gate0 || p.gate_from_normalized; };

  // thread t < 64: row t of the tile (x[b, r, c]); column t of a weight tile (a row of one of the
  // caller's matrices) and its bias
  const int q = q0 + t, b = q / NN, rem = q - b * NN, r = rem / N, c = rem - r * N;
  const bool owner = t < kTileRows, row_ok = owner && q < rows;
  const auto weight_row = [&](int col_tile) -> const Tw* {
    const int vc = col_tile * kTileCols + t, q4 = vc % 4, hv = vc / 4;
    if (vc < 4 * H) {
      const void* base = q4 == 0 ? p.w_in[0].ptr : q4 == 1 ? p.w_in[1].ptr : q4 == 2 ? p.w_in[2].ptr : p.w_in[3].ptr;
      const int64_t ld = q4 == 0 ? p.w_in[0].ld : q4 == 1 ? p.w_in[1].ld : q4 == 2 ? p.w_in[2].ld : p.w_in[3].ld;
      return static_cast<const Tw*>(base) + hv * ld;
    }
    if (vc >= L.gate0 && vc - L.gate0 < P) return static_cast<const Tw*>(p.w_gate.ptr) + (vc - L.gate0) * p.w_gate.ld;
    return nullptr;
  };
  const auto bias_of = [&](int col_tile) {
    const int vc = col_tile * kTileCols + t;
    return vc < 4 * H                        ? read_of4<Tw>(p.b_in, vc % 4, vc / 4)
           : vc >= L.gate0 && vc - L.gate0 < P ? read<Tw>(p.b_gate, vc - L.gate0)
                                               : 0.f;
  };
  // tile k's weights into buffer k % 2 (its row pointers set here, the copies issued after the
  // barrier that frees that buffer), as one cp.async group; returns the thread's column bias, which
  // the caller stores into the buffer's biases once its other loads are issued (a store right
  // here would hold them back until the bias arrives)
  float* const biases = mask + kTileRows;
  const auto stage_weights = [&](int k) {
    const int buffer = k % 2, col_tile = tile_at(k);
    float bias_t = 0.f;
    if (owner) {
      ptrs[kTileRows + buffer * kTileCols + t] = weight_row(col_tile);
      bias_t = bias_of(col_tile);
    }
    __syncthreads();
    stage_rows<Tw>(ptrs + kTileRows + buffer * kTileCols, kTileCols, P, sm + L.wr + buffer * kTileCols * L.ld_p, L.ld_p);
    cp_async_commit();
    return bias_t;
  };

  __syncthreads();  // the previous item is done with the shared memory
  if (owner)
    ptrs[t] = row_ok ? static_cast<const Tx*>(p.x) + b * p.x_stride_b + r * p.x_stride_r + c * p.x_stride_c : nullptr;
  // every load of the item's start in flight at once: the copies first, then the small reads into
  // registers, stored to shared memory only after all are issued (the compiler keeps global reads
  // and shared stores in program order, so a store between two reads would make the second wait
  // for the first)
  const float bias0 = stage_weights(0);
  stage_rows<Tx>(ptrs, kTileRows, P, xr, L.ld_p);
  const float m = row_ok && p.mask ? load_any(p.mask, p.mask_dtype, b * p.mask_stride_b + r * p.mask_stride_r + c * p.mask_stride_c)
                                   : 1.f;
  const bool any_normalized = normalized(tile_at(count - 1));  // (in processing order, normalized tiles come last)
  if (any_normalized) load_affine<Tw>(p.ln_in_w, p.ln_in_b, P, affine);
  if (owner) {
    mask[t] = m;
    biases[t] = bias0;
  }
  // the product reads k up to p8: zeros past round4(P), where staging and LayerNorm stop
  if (L.p8 != round4(P))
    for (int e = t; e < 3 * kTileRows; e += kThreads)
      *reinterpret_cast<float4*>(xr + e * L.ld_p + round4(P)) = make_float4(0.f, 0.f, 0.f, 0.f);
  cp_async_commit();

  // The product on tensor cores, three tf32 products a term (3xTF32: fp32 accuracy): warp w takes
  // rows 16 (w % 4) ... + 15 and columns 32 (w / 4) ... + 31 of the tile. Its accumulator (nt, e)
  // is row row0 + g + 8 (e / 2), column cb + 8 nt + 2 t + e % 2; where the columns are a/b's, the
  // two of a thread are (proj_a, gate_a) of hidden unit (cb + 8 nt + 2 t) / 4 for t even, (proj_b,
  // gate_b) for t odd.
  const int warp = t / 32, lane = t % 32, g = lane / 4, tq = lane % 4;
  const int row0 = kMmaRows * (warp % kMmaRowWarps), cb = kMmaCols * (warp / kMmaRowWarps);
  float* a_out = p.workspace;
  float* b_out = a_out + L.B * H * NN;
  float* g_out = b_out + L.B * H * NN;
  bool is_normalized = false;
  for (int k = 0; k < count; ++k) {
    const int col_tile = tile_at(k), col0 = col_tile * kTileCols, buffer = k % 2;
    const bool gate_tile = col0 >= L.gate0;
    float next_bias = 0.f;
    if (k + 1 < count) {
      next_bias = stage_weights(k + 1);
      cp_async_wait<1>();  // all but tile k + 1's weights
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (normalized(col_tile) && !is_normalized) {
      normalize_rows<kTileRows>(xr, L.ld_p, P, affine, p.eps);
      is_normalized = true;
      __syncthreads();
    }
    const float* wr = sm + L.wr + buffer * kTileCols * L.ld_p;
    const float* bias = biases + buffer * kTileCols;
    float acc[1][kMmaColTiles][4] = {};
    warp_mma<float, 1, kMmaColTiles, false, true>(acc, xr, L.ld_p, wr + cb * L.ld_p, L.ld_p, row0, L.p8);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + g + 8 * half, qu = q0 + row;
      if (qu >= rows) break;
      const int bu = qu / NN, remu = qu - bu * NN, ru = remu / N, cu = remu - ru * N;
      float* gate_row = g_out + (bu * NN + (p.incoming ? cu * N + ru : remu)) * P;
#pragma unroll
      for (int nt = 0; nt < kMmaColTiles; ++nt) {
        const int cl = cb + 8 * nt + 2 * tq;  // the thread's first column in the tile
        const float v0 = acc[0][nt][2 * half], v1 = acc[0][nt][2 * half + 1];
        if (!gate_tile) {
          const int h = (col0 + cl) / 4;
          if (h < H)
            (tq % 2 ? b_out : a_out)[((bu * H + h) * N + ru) * N + cu] =
                (v0 + bias[cl]) * sigmoidf(v1 + bias[cl + 1]) * mask[row];
        } else {
          const int pc = col0 - L.gate0 + cl;
          if (pc < P) gate_row[pc] = sigmoidf(v0 + bias[cl]);
          if (pc + 1 < P) gate_row[pc + 1] = sigmoidf(v1 + bias[cl + 1]);
        }
      }
    }
    // tile k + 1's biases (its buffer's were last read by tile k - 1's epilogue, before the
    // barrier in stage_weights; tile k + 1's epilogue reads them after the next one)
    if (owner && k + 1 < count) biases[(1 - buffer) * kTileCols + t] = next_bias;
  }
}

// ---- phase 2 -------------------------------------------------------------------
// One round of cp.async copies: for h0 >= 0, a[b, h, i0 + s, :] and
// b[b, h, j0 + s, :] (s < 4) of hidden units h0 ... h0 + hc - 1; for p0 >= 0,
// rows p0 ... p0 + 63 of Wo and their biases. The caller waits.
template <typename Tw>
__device__ __forceinline__ void stage_round(const FusedSmallParams& p, const Plan& L, float* sm, int b, int i0,
                                            int j0, int h0, int p0) {
  const void** ptrs = reinterpret_cast<const void**>(sm);
  const int chunk_rows = L.hc * kSideTile, t = threadIdx.x, N = L.N;
  __syncthreads();  // the table and the tiles are free
  if (h0 >= 0)
    for (int e = t; e < 2 * chunk_rows; e += kThreads) {
      const int which = e >= chunk_rows, r = e - which * chunk_rows;
      const int h = h0 + r / kSideTile, side = (which ? j0 : i0) + r % kSideTile;
      const float* src = p.workspace + (which * L.B + b) * L.H * N * N;
      ptrs[e] = h < L.H && side < N ? src + (h * N + side) * N : nullptr;
    }
  if (p0 >= 0 && t < kTileCols)
    ptrs[2 * chunk_rows + t] = p0 + t < L.P ? static_cast<const Tw*>(p.w_out.ptr) + (p0 + t) * p.w_out.ld : nullptr;
  __syncthreads();
  if (h0 >= 0) stage_rows<float>(ptrs, 2 * chunk_rows, N, sm + L.pairs, L.ld_n);
  if (p0 >= 0) {
    stage_rows<Tw>(ptrs + 2 * chunk_rows, kTileCols, L.H, sm + L.wo, L.ld_h);
    const float bias_t = t < kTileCols && p0 + t < L.P ? read<Tw>(p.b_out, p0 + t) : 0.f;
    if (t < kTileCols) sm[L.tile + t] = bias_t;
  }
}

// The output LayerNorm's affine into shared memory.
template <typename Tw>
__device__ __forceinline__ void load_output_affine(const FusedSmallParams& p, const Plan& L, float* sm) {
  load_affine<Tw>(p.ln_out_w, p.ln_out_b, L.H, sm + L.affine);
}

// params_staged: Wo's first 64 rows, their biases and the output affine are
// already in flight (issued before the grid barrier).
template <typename Tx, typename Tw>
__device__ __forceinline__ void output_item(const FusedSmallParams& p, const Plan& L, float* sm, int item,
                                            bool params_staged) {
  const float* ar = sm + L.pairs;
  const float* br = ar + L.hc * kSideTile * L.ld_n;
  float* affine = sm + L.affine;
  float* bias = sm + L.tile;
  float* cr = sm + L.cr;
  const int t = threadIdx.x, N = L.N, P = L.P, H = L.H, ld_n = L.ld_n, ld_h = L.ld_h;
  const int tiles2 = L.side_tiles * L.side_tiles, b = item / tiles2, rem = item - b * tiles2;
  const int i0 = rem / L.side_tiles * kSideTile, j0 = (rem - rem / L.side_tiles * L.side_tiles) * kSideTile;
  // the projection's thread: position pos of the tile, columns cl ... cl + 3 of a column tile
  const int pos = t % kPositions, cl = kQuad * (t / kPositions);
  const int i = i0 + pos / kSideTile, j = j0 + pos % kSideTile;
  const bool inside = i < N && j < N;
  const int o = ((b * N + i) * N + j) * P;
  const float* g = p.workspace + 2 * L.B * H * N * N + o;

  // the item's first round of loads, all in flight at once: a and b (and Wo and
  // the affine unless staged), then the gates of the first column tile (registers)
  stage_round<Tw>(p, L, sm, b, i0, j0, 0, params_staged ? -1 : 0);
  if (!params_staged) load_output_affine<Tw>(p, L, sm);
  float gate[kQuad];
#pragma unroll
  for (int v = 0; v < kQuad; ++v) gate[v] = inside && cl + v < P ? g[cl + v] : 0.f;

  // c[4 ii + jj][h] = sum_k a[h][ii][k] b[h][jj][k]: thread = (h, ii) x 4 jj over alternate groups of 4 k
  const int hl = t / (kSideTile * kKSplit), ii = t / kKSplit % kSideTile, half = t % kKSplit;
  const int n4 = static_cast<int>(round4(N));
  for (int h0 = 0; h0 < H; h0 += L.hc) {
    if (h0 > 0) stage_round<Tw>(p, L, sm, b, i0, j0, h0, -1);
    cp_async_wait_all();
    __syncthreads();
    for (int pass = 0; pass < L.hc && h0 + pass < H; pass += kHiddenPass) {
      const int hh = pass + hl;
      const float* ap = ar + (hh * kSideTile + ii) * ld_n;
      const float* bp = br + hh * kSideTile * ld_n;
      float acc[kSideTile] = {};
#pragma unroll 2
      for (int k = kQuad * half; k < n4; k += kQuad * kKSplit) {
        const float4 av = *reinterpret_cast<const float4*>(ap + k);
#pragma unroll
        for (int jj = 0; jj < kSideTile; ++jj) {
          const float4 bv = *reinterpret_cast<const float4*>(bp + jj * ld_n + k);
          acc[jj] = fmaf(av.x, bv.x, acc[jj]);
          acc[jj] = fmaf(av.y, bv.y, acc[jj]);
          acc[jj] = fmaf(av.z, bv.z, acc[jj]);
          acc[jj] = fmaf(av.w, bv.w, acc[jj]);
        }
      }
      static_assert(kKSplit == 2, "one exchange combines the two halves");
#pragma unroll
      for (int jj = 0; jj < kSideTile; ++jj) acc[jj] += __shfl_xor_sync(0xffffffffu, acc[jj], 1);
      if (half == 0 && h0 + hh < H)
#pragma unroll
        for (int jj = 0; jj < kSideTile; ++jj) cr[(ii * kSideTile + jj) * ld_h + h0 + hh] = acc[jj];
    }
  }
  if (t < kPositions)
    for (int k = H; k < round4(H); ++k) cr[t * ld_h + k] = 0.f;  // LayerNorm and projection read float4s
  __syncthreads();

  normalize_rows<kPositions>(cr, ld_h, H, affine, p.eps);

  Tx* out = static_cast<Tx*>(p.out) + o;
  for (int p0 = 0; p0 < P; p0 += kTileCols) {
    if (p0 > 0) {
      stage_round<Tw>(p, L, sm, b, i0, j0, -1, p0);
#pragma unroll
      for (int v = 0; v < kQuad; ++v) gate[v] = inside && p0 + cl + v < P ? g[p0 + cl + v] : 0.f;
    }
    cp_async_wait_all();
    __syncthreads();  // LayerNorm written / weights staged
    float y[1][kQuad] = {};
    multiply_rows<1>(cr, ld_h, sm + L.wo, ld_h, static_cast<int>(round4(H)), pos, 0, cl, y);
    if (inside)
#pragma unroll
      for (int v = 0; v < kQuad; ++v)
        if (p0 + cl + v < P) out[p0 + cl + v] = from_float<Tx>((y[0][v] + bias[cl + v]) * gate[v]);
  }
}

// ---- three phases: phase 2 -----------------------------------------------------------
// The plane c[b, h][i][j] = sum_k a[b, h][i][k] b[b, h][j][k]: both planes staged once, a thread
// computing 4 rows i = ib + nb u (u < 4; ib over the warp's lanes: distinct banks) x 4 columns
// j = 4 jb ... + 3 (shared by the warp's lanes: broadcast) at a time.
__device__ __forceinline__ void contraction_item(const FusedSmallParams& p, const Plan& L, float* sm, int item) {
  const void** ptrs = reinterpret_cast<const void**>(sm);
  const int t = threadIdx.x, N = L.N, NN = N * N, n4 = static_cast<int>(round4(N));
  float* ar = sm + L.pairs;
  float* br = ar + n4 * L.ld_n;
  const float* a_plane = p.workspace + static_cast<int64_t>(item) * NN;  // item = b H + h
  const float* b_plane = a_plane + L.B * L.H * NN;
  __syncthreads();  // the previous item is done with the shared memory
  // rows past N (up to round4(N)) staged as zeros: the register tiles read them
  for (int e = t; e < 2 * n4; e += kThreads) {
    const int r = e % n4;
    ptrs[e] = r >= N ? nullptr : (e < n4 ? a_plane : b_plane) + r * N;
  }
  __syncthreads();
  stage_rows<float>(ptrs, 2 * n4, N, ar, L.ld_n);
  cp_async_wait_all();
  __syncthreads();
  float* c = p.workspace + L.c + static_cast<int64_t>(item) * NN;
  const int nb = n4 / kQuad;
  for (int tile = t; tile < nb * nb; tile += kThreads) {
    const int ib = tile % nb, j0 = kQuad * (tile / nb);
    float acc[kQuad][kQuad] = {};
    multiply_rows<kQuad>(ar, L.ld_n, br, L.ld_n, n4, ib, nb, j0, acc);
#pragma unroll
    for (int u = 0; u < kQuad; ++u) {
      const int i = ib + nb * u;
#pragma unroll
      for (int v = 0; v < kQuad; ++v)
        if (i < N && j0 + v < N) c[i * N + j0 + v] = acc[u][v];
    }
  }
}

// ---- three phases: phase 3 -----------------------------------------------------------
// Positions q0 ... q0 + run - 1 of batch entry b (natural order, i N + j): c's values of the run
// into rows of H (read along the run in each plane), LayerNorm, then per 64 output channels the
// projection kRunRows positions at a time: thread = positions s + pos + 16 u (u < 2) x 4 channels.
// params_staged: as output_item's.
template <typename Tx, typename Tw>
__device__ __forceinline__ void run_item(const FusedSmallParams& p, const Plan& L, float* sm, int item,
                                         bool params_staged) {
  float* cr = sm + L.runs_at;
  float* bias = sm + L.tile;
  const float* affine = sm + L.affine;
  const int t = threadIdx.x, NN = L.N * L.N, P = L.P, H = L.H, ld_h = L.ld_h, run = L.run;
  const int b = item / L.runs_per_b, q0 = (item - b * L.runs_per_b) * run;
  const int count = min(run, NN - q0);
  if (!params_staged) {
    stage_round<Tw>(p, L, sm, 0, 0, 0, -1, 0);
    load_output_affine<Tw>(p, L, sm);
  } else {
    __syncthreads();  // the previous item is done with the runs
  }
  // c's values: kBatch loads in flight before their stores; zeros past the run and up to round4(H)
  constexpr int kBatch = 8;
  const float* c = p.workspace + L.c + static_cast<int64_t>(b) * H * NN + q0;
  const int h4 = static_cast<int>(round4(H)), values = h4 * run;
  for (int e0 = t; e0 < values; e0 += kBatch * kThreads) {
    float v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, h = e / run, r = e - h * run;
      v[u] = e < values && h < H && r < count ? c[h * NN + r] : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads, h = e / run, r = e - h * run;
      if (e < values) cr[r * ld_h + h] = v[u];
    }
  }
  cp_async_wait_all();  // (the first Wo tile, where this item staged it)
  __syncthreads();
  for (int s = 0; s < run; s += kRunRows) normalize_rows<kRunRows>(cr + s * ld_h, ld_h, H, affine, p.eps);

  const int pos = t % kPositions, cl = kQuad * (t / kPositions);
  const float* g = p.workspace + 2 * L.B * H * NN + (static_cast<int64_t>(b) * NN + q0) * P;
  Tx* out = static_cast<Tx*>(p.out) + (static_cast<int64_t>(b) * NN + q0) * P;
  for (int p0 = 0; p0 < P; p0 += kTileCols) {
    if (p0 > 0) stage_round<Tw>(p, L, sm, 0, 0, 0, -1, p0);
    cp_async_wait_all();
    __syncthreads();  // LayerNorm written / weights staged
    for (int s = 0; s < count; s += kRunRows) {
      float gate[kRunThreadRows][kQuad];
#pragma unroll
      for (int u = 0; u < kRunThreadRows; ++u) {
        const int r = s + pos + kPositions * u;
#pragma unroll
        for (int v = 0; v < kQuad; ++v) gate[u][v] = r < count && p0 + cl + v < P ? g[r * P + p0 + cl + v] : 0.f;
      }
      float y[kRunThreadRows][kQuad] = {};
      multiply_rows<kRunThreadRows>(cr + s * ld_h, ld_h, sm + L.wo, ld_h, h4, pos, kPositions, cl, y);
#pragma unroll
      for (int u = 0; u < kRunThreadRows; ++u) {
        const int r = s + pos + kPositions * u;
        if (r < count)
#pragma unroll
          for (int v = 0; v < kQuad; ++v)
            if (p0 + cl + v < P) out[r * P + p0 + cl + v] = from_float<Tx>((y[u][v] + bias[cl + v]) * gate[u][v]);
      }
    }
  }
}

template <typename Tx, typename Tw>
__global__ void __launch_bounds__(kThreads, 1) fused_small_kernel(const FusedSmallParams p, const Plan L) {
  extern __shared__ __align__(16) float smem[];
  for (int item = blockIdx.x; item < L.inputs; item += gridDim.x) {
    const int row_tile = item / L.groups, first = (item - row_tile * L.groups) * L.col_group;
    input_item<Tx, Tw>(p, L, smem, row_tile, first, min(first + L.col_group, L.col_tiles));
  }
  if (L.three) {
    cg::this_grid().sync();  // a, b and g complete and visible
    for (int item = blockIdx.x; item < L.outputs; item += gridDim.x) contraction_item(p, L, smem, item);
    // the first phase-3 item's parameters do not depend on c: in flight across the barrier
    if (blockIdx.x < L.runs) {
      stage_round<Tw>(p, L, smem, 0, 0, 0, -1, 0);
      load_output_affine<Tw>(p, L, smem);
    }
    cg::this_grid().sync();  // c complete and visible
    for (int item = blockIdx.x; item < L.runs; item += gridDim.x)
      run_item<Tx, Tw>(p, L, smem, item, item == static_cast<int>(blockIdx.x));
    return;
  }
  // the first phase-2 item's parameters do not depend on phase 1: in flight across the barrier
  if (blockIdx.x < L.outputs) {
    stage_round<Tw>(p, L, smem, 0, 0, 0, -1, 0);
    load_output_affine<Tw>(p, L, smem);
  }
  cg::this_grid().sync();  // a, b and g complete and visible
  for (int item = blockIdx.x; item < L.outputs; item += gridDim.x)
    output_item<Tx, Tw>(p, L, smem, item, item == static_cast<int>(blockIdx.x));
}

template <typename Tx, typename Tw>
static cudaError_t launch_typed(const FusedSmallParams& p, int sm_count, cudaStream_t stream) {
  Plan plan;
  const size_t smem = plan_launch(p.B, p.N, p.P, p.H, &plan) * sizeof(float);
  const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(fused_small_kernel<Tx, Tw>), kThreads, smem);
  if (per_sm == 0) return cudaErrorInvalidConfiguration;
  const int grid = std::min(std::max<int>({plan.inputs, plan.outputs, plan.runs}), per_sm * sm_count);
  FusedSmallParams args = p;
  void* kernel_args[] = {&args, &plan};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(fused_small_kernel<Tx, Tw>),
                                     dim3(static_cast<unsigned>(grid)), dim3(kThreads), kernel_args, smem, stream);
}

cudaError_t launch_fused_small(const FusedSmallParams& p, int sm_count, cudaStream_t stream) {
  const bool f32_weights = p.w_dtype == DType::f32;
  switch (p.x_dtype) {
    case DType::bf16:
      return f32_weights ? launch_typed<__nv_bfloat16, float>(p, sm_count, stream)
                         : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, sm_count, stream);
    case DType::f16:
      return f32_weights ? launch_typed<__half, float>(p, sm_count, stream) : launch_typed<__half, __half>(p, sm_count, stream);
    default: return launch_typed<float, float>(p, sm_count, stream);
  }
}

}  // namespace trimul
