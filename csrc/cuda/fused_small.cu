// fused_small: the whole update in one launch, for problems so small that the
// four-stage pipeline would spend its time on launches (the seed's shape does
// ~1 us of arithmetic).
//
// One cooperative grid; a grid-wide barrier separates two phases.
//   phase 1, items = (64 rows of x) x (64 columns of the virtual input weight):
//       LayerNorm, the four input projections, gating and mask -> a, b
//       (channel-first [B*H][N][N], contraction index contiguous, as
//       ln_proj_gate writes them), and the output gate sigmoid(u.Wg^T + bg)
//       -> g ([B][N][N][P], by output position)
//   phase 2, items = (batch, 8 x 8 output positions):
//       c = the triangle product, LayerNorm over H, output projection, times g
//
// The virtual input weight has 4H interleaved rows (4h + {proj_a, gate_a,
// proj_b, gate_b}, as PackedLayout) padded to a multiple of 64, then the P rows
// of the output gate, so a 64-column item is either a/b or gate. Parameters
// are read where the caller keeps them when they share one dtype (fp32 or x's)
// and have contiguous rows; the binding packs any other mix first. Each item
// issues its global loads in batches before storing any (stage_rows), so it
// waits on memory a few times, not once per element. a, b, g live in a
// workspace that stays in L2 at these sizes.
#include <cooperative_groups.h>

#include <type_traits>

#include "mma.cuh"  // cp.async helpers

namespace trimul {
namespace cg = cooperative_groups;

constexpr int kSideTile = 8;  // phase 2: 8 x 8 output positions = kTileRows rows
static_assert(kSideTile * kSideTile == kTileRows, "phase-2 tile is one row tile");
constexpr int kHiddenPass = kThreads / 16;  // phase 2: hidden units per pass of the product (16 threads each)
constexpr int kXsLd = kTileRows + kRowPad;  // xs[k][row], cs[h][row]
constexpr int kWsLd = kTileCols + kColPad;  // ws[k][col]: float4-aligned rows
constexpr int64_t kPairBudget = 18 * 1024;  // floats of a/b staged per round in phase 2

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

// Stages `rows` rows of `len` elements of type T into shared memory:
//   dst[(r >> group_shift) * group_ld + (r & (2^group_shift - 1)) + k * k_ld] = row_ptrs[r][k]
// as float, 0 where row_ptrs[r] is null. Warps take rows, lanes take k
// (coalesced). fp32 rows go by cp.async, all in flight until the caller's
// cp_async_wait_all(); other types through registers, each thread issuing
// kRowsInFlight loads before its first store. One out-of-line copy serves every call
// site: at these sizes the kernel runs most instructions once, so its time
// grows with the code it executes (instruction fetch), about 7 us per 1000
// instructions on the H200 (benchmarks/NOTES.md).
constexpr int kRowsInFlight = 4;

template <typename T>
__device__ __noinline__ void stage_rows(const void* const* row_ptrs, int rows, int len, float* dst, int k_ld,
                                        int group_shift, int group_ld) {
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group_mask = (1 << group_shift) - 1;
  if constexpr (std::is_same_v<T, float>) {
    // fp32 rows: every copy in flight at once, no registers held; the caller
    // waits (cp_async_wait_all) before its barrier
    for (int k = lane; k < len; k += 32)
      for (int r = warp; r < rows; r += kWarps) {
        float* d = dst + (r >> group_shift) * group_ld + (r & group_mask) + k * k_ld;
        const float* ptr = static_cast<const float*>(row_ptrs[r]);
        if (ptr) cp_async4(d, ptr + k);
        else *d = 0.f;
      }
  } else {
    for (int k = lane; k < len; k += 32)
      for (int r0 = warp; r0 < rows; r0 += kWarps * kRowsInFlight) {
        float v[kRowsInFlight];
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const int r = r0 + u * kWarps;
          const T* ptr = r < rows ? static_cast<const T*>(row_ptrs[r]) : nullptr;
          v[u] = ptr ? to_float(ptr[k]) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kRowsInFlight; ++u) {
          const int r = r0 + u * kWarps;
          if (r < rows) dst[(r >> group_shift) * group_ld + (r & group_mask) + k * k_ld] = v[u];
        }
      }
  }
}
constexpr int kTileShift = 6;  // log2(kTileRows): a 64-row tile is one group
constexpr int kSideShift = 3;  // log2(kSideTile)
static_assert(1 << kTileShift == kTileRows && 1 << kSideShift == kSideTile, "shifts");

__host__ __device__ inline int64_t gate_column0(int64_t H) { return ceil_div(4 * H, kTileCols) * kTileCols; }
__host__ __device__ inline int64_t round4(int64_t v) { return (v + 3) / 4 * 4; }

// Dynamic shared memory, offsets in floats (each a multiple of 4: 16-byte aligned).
//   ptrs      row pointers for stage_rows: phase 1 the 64 rows of x and the 64
//             weight rows of the tile's columns; phase 2 the a and b rows of a
//             chunk (2 hc 8) and the 64 rows of Wo
//   ws        [max(P, H)][kWsLd]: a weight tile, k-major (phase 1: input weights, phase 2: Wo)
//   u         phase 1: xs [P][kXsLd], the x tile, normalized in place
//             phase 2: as, bs [hc][pair_ld]: a[h][k][i] and b[h][k][j] of the tile's rows
//   affine    [2 max(P, H)]: a LayerNorm weight and bias
//   tile      [2][64]: bias of the tile's columns (phase 2: of Wo's), mask of its rows
//   cs        [H][kXsLd]: c, then LayerNorm(c), of the tile's 64 positions (phase 2)
struct SmemLayout {
  int64_t ws, u, affine, tile, cs, total;  // ptrs at 0
  int64_t hc, pair_ld;
};

__host__ __device__ inline SmemLayout smem_layout(int64_t N, int64_t P, int64_t H) {
  SmemLayout l{};
  l.pair_ld = N * kSideTile + 8;  // +8: the two hidden units of a warp read other banks
  const int64_t per_h = 2 * l.pair_ld;
  const int64_t fit = kPairBudget / per_h / kHiddenPass * kHiddenPass;
  const int64_t all = ceil_div(H, kHiddenPass) * kHiddenPass;
  l.hc = fit < kHiddenPass ? kHiddenPass : (fit < all ? fit : all);
  const int64_t wide = P > H ? P : H;
  const int64_t n_ptrs = 2 * l.hc * kSideTile + kTileCols;  // >= 2 kTileRows
  int64_t at = round4(2 * n_ptrs);  // 8-byte pointers
  l.ws = at;
  at += round4(wide * kWsLd);
  l.u = at;
  at += round4(P * kXsLd > l.hc * per_h ? P * kXsLd : l.hc * per_h);
  l.affine = at;
  at += round4(2 * wide);
  l.tile = at;
  at += 2 * kTileRows;
  l.cs = at;
  at += round4(H * kXsLd);
  l.total = at;
  return l;
}

size_t fused_small_smem(int64_t N, int64_t P, int64_t H) { return smem_layout(N, P, H).total * sizeof(float); }

int64_t fused_small_workspace(int64_t B, int64_t N, int64_t P, int64_t H) { return B * N * N * (2 * H + P); }

// LayerNorm, in place, of each of the 64 columns of buf[k * kXsLd + col], k < len,
// with weight affine[k] and bias affine[len + k]: four threads per column, two passes.
__device__ __forceinline__ void normalize_columns(float* buf, int len, const float* affine, float eps) {
  const int col = threadIdx.x / 4, part = threadIdx.x % 4;
  float sum = 0.f;
  for (int k = part; k < len; k += 4) sum += buf[k * kXsLd + col];
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const float mu = sum / static_cast<float>(len);
  float sq = 0.f;
  for (int k = part; k < len; k += 4) {
    const float d = buf[k * kXsLd + col] - mu;
    sq += d * d;
  }
  sq += __shfl_xor_sync(0xffffffffu, sq, 1);
  sq += __shfl_xor_sync(0xffffffffu, sq, 2);
  const float rs = rsqrtf(sq / static_cast<float>(len) + eps);
  for (int k = part; k < len; k += 4) buf[k * kXsLd + col] = (buf[k * kXsLd + col] - mu) * rs * affine[k] + affine[len + k];
}

// ---- phase 1 -------------------------------------------------------------------
// 64 rows x 64 virtual columns. The item's global loads go out in a few batched
// rounds (x, weights, LayerNorm affine; row masks and column biases ride along),
// then statistics and products run from shared memory.
template <typename Tx, typename Tw>
__device__ __forceinline__ void input_item(const FusedSmallParams& p, const SmemLayout& L, float* sm,
                                           int64_t row_tile, int64_t col_tile) {
  const void** ptrs = reinterpret_cast<const void**>(sm);  // [0, 64): x rows, [64, 128): weight rows
  float* ws = sm + L.ws;
  float* xs = sm + L.u;
  float* affine = sm + L.affine;
  float* bias = sm + L.tile;
  float* mask = bias + kTileCols;
  const int t = threadIdx.x;
  const int64_t P = p.P, NN = p.N * p.N, rows = p.B * NN;
  const int64_t q0 = row_tile * kTileRows, col0 = col_tile * kTileCols, gate0 = gate_column0(p.H);
  const bool gate_tile = col0 >= gate0;
  const bool normalize = !gate_tile || p.gate_from_normalized;  // else the gate reads x itself
  const Tx* x = static_cast<const Tx*>(p.x);

  __syncthreads();  // the previous item is done with the shared memory
  float m = 1.f, bias_t = 0.f;  // row t's mask and column t's bias, in flight during the staging
  if (t < kTileRows) {
    const int64_t q = q0 + t;
    const Tx* row = nullptr;
    if (q < rows) {
      const int64_t b = q / NN, rem = q % NN, r = rem / p.N, c = rem % p.N;
      row = x + b * p.x_stride_b + r * p.x_stride_r + c * p.x_stride_c;
      if (!gate_tile && p.mask)
        m = load_any(p.mask, p.mask_dtype, b * p.mask_stride_b + r * p.mask_stride_r + c * p.mask_stride_c);
    }
    ptrs[t] = row;
    // column t of the virtual weight: its row of one of the caller's matrices
    const int64_t vc = col0 + t;
    const Tw* w = nullptr;
    if (vc < 4 * p.H) {
      const int64_t q4 = vc % 4, h = vc / 4;
      const void* base = q4 == 0 ? p.w_in[0].ptr : q4 == 1 ? p.w_in[1].ptr : q4 == 2 ? p.w_in[2].ptr : p.w_in[3].ptr;
      const int64_t ld = q4 == 0 ? p.w_in[0].ld : q4 == 1 ? p.w_in[1].ld : q4 == 2 ? p.w_in[2].ld : p.w_in[3].ld;
      w = static_cast<const Tw*>(base) + h * ld;
      bias_t = read_of4<Tw>(p.b_in, q4, h);
    } else if (vc >= gate0 && vc - gate0 < P) {
      w = static_cast<const Tw*>(p.w_gate.ptr) + (vc - gate0) * p.w_gate.ld;
      bias_t = read<Tw>(p.b_gate, vc - gate0);
    }
    ptrs[kTileRows + t] = w;
  }
  __syncthreads();

  // the loads: x tile, weight tile, LayerNorm affine
  const int P32 = static_cast<int>(P);
  stage_rows<Tx>(ptrs, kTileRows, P32, xs, kXsLd, kTileShift, 0);
  stage_rows<Tw>(ptrs + kTileRows, kTileCols, P32, ws, kWsLd, kTileShift, 0);
  if (normalize)
    for (int64_t k = t; k < P; k += kThreads) {
      affine[k] = read<Tw>(p.ln_in_w, k);
      affine[P + k] = read<Tw>(p.ln_in_b, k);
    }
  if (t < kTileRows) {
    mask[t] = m;
    bias[t] = bias_t;
  }
  cp_async_wait_all();
  __syncthreads();

  if (normalize) {
    normalize_columns(xs, P32, affine, p.eps);
    __syncthreads();
  }

  const int row = t % kTileRows, group = t / kTileRows;
  float acc[kColsPerThread] = {};
  multiply_rows<2>(xs, kXsLd, ws, kWsLd, P32, row, group, acc);

  const int64_t q = q0 + row;
  if (q >= rows) return;
  const int64_t b = q / NN, r = (q % NN) / p.N, c = q % p.N;
  const int cl0 = group * kColsPerThread;  // the thread's first column within the tile
  if (!gate_tile) {
    float* a_out = p.workspace;
    float* b_out = p.workspace + p.B * p.H * NN;
#pragma unroll
    for (int u = 0; u < kColsPerThread / 4; ++u) {
      const int cl = cl0 + 4 * u;
      const int64_t h = (col0 + cl) / 4;
      if (h >= p.H) break;
      const float av = (acc[4 * u + 0] + bias[cl + 0]) * sigmoidf(acc[4 * u + 1] + bias[cl + 1]) * mask[row];
      const float bv = (acc[4 * u + 2] + bias[cl + 2]) * sigmoidf(acc[4 * u + 3] + bias[cl + 3]) * mask[row];
      const int64_t o = ((b * p.H + h) * p.N + r) * p.N + c;
      a_out[o] = av;
      b_out[o] = bv;
    }
  } else {
    const int64_t pos = p.incoming ? c * p.N + r : r * p.N + c;
    const int64_t pc0 = col0 - gate0 + cl0;
    float* g = p.workspace + 2 * p.B * p.H * NN + (b * NN + pos) * P + pc0;
    const int cols = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kColsPerThread, P - pc0)));
#pragma unroll
    for (int u = 0; u < kColsPerThread; ++u)
      if (u < cols) g[u] = sigmoidf(acc[u] + bias[cl0 + u]);
  }
}

// ---- phase 2 -------------------------------------------------------------------
// Stages a[b, h, i0 + side, k] as as[h - h0][k][side] and b likewise, for
// hidden units h0 ... h0 + hc - 1.
__device__ __forceinline__ void load_pairs(const FusedSmallParams& p, const SmemLayout& L, float* sm, int64_t b,
                                           int64_t i0, int64_t j0, int64_t h0) {
  const void** ptrs = reinterpret_cast<const void**>(sm);
  const int chunk_rows = static_cast<int>(L.hc) * kSideTile;
  const int64_t NN = p.N * p.N;
  __syncthreads();  // the table and the tiles are free
  for (int e = threadIdx.x; e < 2 * chunk_rows; e += kThreads) {
    const int which = e >= chunk_rows, r = e - which * chunk_rows;
    const int64_t h = h0 + (r >> kSideShift), side = (which ? j0 : i0) + (r & (kSideTile - 1));
    const float* src = p.workspace + (which * p.B + b) * p.H * NN;
    ptrs[e] = h < p.H && side < p.N ? src + (h * p.N + side) * p.N : nullptr;
  }
  __syncthreads();
  float* as = sm + L.u;
  const int n = static_cast<int>(p.N), pair_ld = static_cast<int>(L.pair_ld);
  stage_rows<float>(ptrs, chunk_rows, n, as, kSideTile, kSideShift, pair_ld);
  stage_rows<float>(ptrs + chunk_rows, chunk_rows, n, as + L.hc * L.pair_ld, kSideTile, kSideShift, pair_ld);
  cp_async_wait_all();  // also the output weights staged just before
}

// Stages Wo's columns p0 ... p0 + 63 as ws[h][col], and their biases.
template <typename Tw>
__device__ __forceinline__ void load_output_weights(const FusedSmallParams& p, const SmemLayout& L, float* sm,
                                                    int64_t p0) {
  const void** ptrs = reinterpret_cast<const void**>(sm) + 2 * L.hc * kSideTile;
  __syncthreads();  // the table and the tile are free
  if (threadIdx.x < kTileCols) {
    const int64_t pc = p0 + threadIdx.x;
    ptrs[threadIdx.x] = pc < p.P ? static_cast<const Tw*>(p.w_out.ptr) + pc * p.w_out.ld : nullptr;
    sm[L.tile + threadIdx.x] = pc < p.P ? read<Tw>(p.b_out, pc) : 0.f;
  }
  __syncthreads();
  stage_rows<Tw>(ptrs, kTileCols, static_cast<int>(p.H), sm + L.ws, kWsLd, kTileShift, 0);
}

template <typename Tx, typename Tw>
__device__ __forceinline__ void output_item(const FusedSmallParams& p, const SmemLayout& L, float* sm, int64_t item) {
  float* ws = sm + L.ws;
  float* as = sm + L.u;
  float* bs = as + L.hc * L.pair_ld;
  float* affine = sm + L.affine;
  float* bias = sm + L.tile;
  float* cs = sm + L.cs;
  const int t = threadIdx.x;
  const int64_t N = p.N, H = p.H, NN = N * N;
  const int64_t side_tiles = ceil_div(N, kSideTile);
  const int64_t b = item / (side_tiles * side_tiles);
  const int64_t i0 = (item / side_tiles) % side_tiles * kSideTile, j0 = item % side_tiles * kSideTile;
  const int row = t % kTileRows, group = t / kTileRows;
  const int64_t i = i0 + row / kSideTile, j = j0 + row % kSideTile;
  const bool inside = i < N && j < N;
  const int64_t o = (b * NN + i * N + j) * p.P;
  const float* g = p.workspace + 2 * p.B * H * NN + o;

  __syncthreads();  // the previous item is done with the shared memory
  // this thread's columns of a column tile at p0: cl0 ... cl0 + n_cols(p0) - 1
  const int cl0 = group * kColsPerThread;
  auto n_cols = [&](int64_t p0) {
    return inside ? static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kColsPerThread, p.P - p0 - cl0))) : 0;
  };
  float gate[kColsPerThread];  // the gates of the first column tile: in flight during the product
  int cols = n_cols(0);
#pragma unroll
  for (int u = 0; u < kColsPerThread; ++u) gate[u] = u < cols ? g[cl0 + u] : 0.f;
  for (int64_t h = t; h < H; h += kThreads) {
    affine[h] = read<Tw>(p.ln_out_w, h);
    affine[H + h] = read<Tw>(p.ln_out_b, h);
  }
  load_output_weights<Tw>(p, L, sm, 0);

  // c[h][8 ii + jj] = sum_k a[h][k][ii] b[h][k][jj]: thread = a hidden unit and 2 x 2 positions
  const int hl = t / 16, ii = (t % 16) / 4 * 2, jj = (t % 4) * 2;
  for (int64_t h0 = 0; h0 < H; h0 += L.hc) {
    load_pairs(p, L, sm, b, i0, j0, h0);
    __syncthreads();
    for (int64_t pass = 0; pass < L.hc && h0 + pass < H; pass += kHiddenPass) {
      const int64_t h = h0 + pass + hl;
      const float* ap = as + (pass + hl) * L.pair_ld + ii;
      const float* bp = bs + (pass + hl) * L.pair_ld + jj;
      float acc[2][2] = {};
#pragma unroll 2
      for (int64_t k = 0; k < N; ++k) {
        const float2 av = *reinterpret_cast<const float2*>(ap + k * kSideTile);
        const float2 bv = *reinterpret_cast<const float2*>(bp + k * kSideTile);
        acc[0][0] = fmaf(av.x, bv.x, acc[0][0]);
        acc[0][1] = fmaf(av.x, bv.y, acc[0][1]);
        acc[1][0] = fmaf(av.y, bv.x, acc[1][0]);
        acc[1][1] = fmaf(av.y, bv.y, acc[1][1]);
      }
      if (h < H) {
        float* ch = cs + h * kXsLd + ii * kSideTile + jj;
        ch[0] = acc[0][0];
        ch[1] = acc[0][1];
        ch[kSideTile] = acc[1][0];
        ch[kSideTile + 1] = acc[1][1];
      }
    }
  }
  __syncthreads();

  normalize_columns(cs, static_cast<int>(H), affine, p.eps);

  Tx* out = static_cast<Tx*>(p.out) + o;
  for (int64_t p0 = 0; p0 < p.P; p0 += kTileCols) {
    if (p0 > 0) {
      load_output_weights<Tw>(p, L, sm, p0);
      cols = n_cols(p0);
#pragma unroll
      for (int u = 0; u < kColsPerThread; ++u) gate[u] = u < cols ? g[p0 + cl0 + u] : 0.f;
    }
    cp_async_wait_all();
    __syncthreads();  // LayerNorm written / weights staged
    float y[kColsPerThread] = {};
    multiply_rows<2>(cs, kXsLd, ws, kWsLd, static_cast<int>(H), row, group, y);
#pragma unroll
    for (int u = 0; u < kColsPerThread; ++u)
      if (u < cols) out[p0 + cl0 + u] = from_float<Tx>((y[u] + bias[cl0 + u]) * gate[u]);
  }
}

template <typename Tx, typename Tw>
__global__ void __launch_bounds__(kThreads, 1) fused_small_kernel(const FusedSmallParams p) {
  extern __shared__ __align__(16) float smem[];
  const SmemLayout L = smem_layout(p.N, p.P, p.H);

  const int64_t col_tiles = ceil_div(gate_column0(p.H) + p.P, kTileCols);
  const int64_t inputs = ceil_div(p.B * p.N * p.N, kTileRows) * col_tiles;
  for (int64_t item = blockIdx.x; item < inputs; item += gridDim.x)
    input_item<Tx, Tw>(p, L, smem, item / col_tiles, item % col_tiles);

  cg::this_grid().sync();  // a, b and g complete and visible

  const int64_t side_tiles = ceil_div(p.N, kSideTile);
  const int64_t outputs = p.B * side_tiles * side_tiles;
  for (int64_t item = blockIdx.x; item < outputs; item += gridDim.x) output_item<Tx, Tw>(p, L, smem, item);
}

// Blocks of one instance that fit on an SM with `smem` bytes each, per device.
template <typename Tx, typename Tw>
static int resident_blocks(int device, size_t smem) {
  constexpr int kMaxDevices = 64;
  static size_t cached_smem[kMaxDevices] = {};
  static int cached_blocks[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return 0;
  if (cached_smem[device] != smem) {
    int blocks = 0;
    if (cudaFuncSetAttribute(fused_small_kernel<Tx, Tw>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fused_small_kernel<Tx, Tw>, kThreads, smem) !=
            cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    cached_smem[device] = smem;
    cached_blocks[device] = blocks;
  }
  return cached_blocks[device];
}

static int sm_count(int device) {
  constexpr int kMaxDevices = 64;
  static int count[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return 0;
  if (count[device] == 0 && cudaDeviceGetAttribute(&count[device], cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count[device];
}

template <typename Tx, typename Tw>
static cudaError_t launch_typed(const FusedSmallParams& p, int device, cudaStream_t stream) {
  const size_t smem = fused_small_smem(p.N, p.P, p.H);
  const int per_sm = resident_blocks<Tx, Tw>(device, smem);
  if (per_sm == 0) return cudaErrorInvalidConfiguration;
  const int64_t col_tiles = ceil_div(gate_column0(p.H) + p.P, kTileCols);
  const int64_t inputs = ceil_div(p.B * p.N * p.N, kTileRows) * col_tiles;
  const int64_t side_tiles = ceil_div(p.N, kSideTile);
  const int64_t outputs = p.B * side_tiles * side_tiles;
  const int64_t grid = std::min<int64_t>(std::max(inputs, outputs), static_cast<int64_t>(per_sm) * sm_count(device));
  FusedSmallParams args = p;
  void* kernel_args[] = {&args};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(fused_small_kernel<Tx, Tw>),
                                     dim3(static_cast<unsigned>(grid)), dim3(kThreads), kernel_args, smem, stream);
}

cudaError_t launch_fused_small(const FusedSmallParams& p, int device, cudaStream_t stream) {
  const bool f32_weights = p.w_dtype == DType::f32;
  switch (p.x_dtype) {
    case DType::bf16:
      return f32_weights ? launch_typed<__nv_bfloat16, float>(p, device, stream)
                         : launch_typed<__nv_bfloat16, __nv_bfloat16>(p, device, stream);
    case DType::f16:
      return f32_weights ? launch_typed<__half, float>(p, device, stream) : launch_typed<__half, __half>(p, device, stream);
    default: return launch_typed<float, float>(p, device, stream);
  }
}

}  // namespace trimul
