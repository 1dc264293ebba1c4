// out_stage_back with its weights resident (sm_90a, 16-bit operands, x in their
// type, P = H = 128): what out_stage_back.cu computes, by persistent blocks of two
// warpgroups that copy W' = Wo gamma and Wg (wgmma's core-matrix layout, K-major
// for the forward's products) and the per-channel vectors into shared memory once,
// then walk tiles of 64 positions j of one line (b, i), each warpgroup on its own
// tiles (as ln_out_proj_gate_resident.cu, the forward's stage). Per tile:
//
//   1. c (h-major, as the contraction left it) and x arrive by cp.async, one tile
//      ahead; both A fragments come into registers by ldmatrix (c's transposed),
//      and the output gradient G by cp.async into the warp's quarter of the c
//      tile. c's statistics from its fragment, u = LayerNorm(x) (or x) in place
//      of x's; chat leaves through the warp's own 16 rows of the x tile
//      (stmatrix, then 16-byte rows), where c then stays. u does not leave: the
//      host hands x's rows on in its place (below).
//   2. y = rstd (c . W'^T - mean s) + t and g = u . Wg^T + bg as two m64n128k16
//      chains with A from registers (the gate from x adds x's mean times g_round,
//      Wg's rounding: trimul.h). (No wgmma's A registers are read while it
//      runs: each staging comes before the chain that reads its fragment.)
//   3. Per element: dy = G sigmoid(g), dgp = dy y (1 - sigmoid(g)), rounded into
//      A fragments in place (an m64n128 accumulator pair of 8-column blocks is a
//      k16 step's A fragment); their column sums. With the gate reading
//      LayerNorm(x) (kNormalized), dgp leaves as q = rstd dgp (x's rstd, rounded
//      to the operand type, written over G's elements as they are read): u =
//      (x - mean) rstd gamma + beta, so dgp^T u = (q^T x - m 1^T) diag(gamma) +
//      sum(dgp) beta^T with m = q^T mean, the row means of q^T x, which
//      param_grads forms; u (2 bytes a channel and position, written and read
//      again) never goes to memory.
//   4. dx = dgp . Wg and dh = dy . W' as chains reading the same resident weights
//      N-major (wgmma_desc_n_major); dy leaves before them and dgp under them
//      (q and dy both under them where q is written), dx under the second.
//      dh's accumulator has the layout of c's fragment (read again from
//      the warp's rows), so LayerNorm's gradient dc = rstd (dh - mean(dh) - chat
//      mean(dh chat)) is computed on registers (row sums over the quad), written
//      transposed into the c tile (stmatrix .trans) and out to c's place.
//
// Every staging area is a warp's own rows, so within a tile three warpgroup
// barriers: the tile's copy complete, every warp's c read (the c tile's quarters
// become the warps' rows), and those rows done with before dc is written across
// them. Column sums (sum dy, sum dgp): a thread's two rows, the eight lanes of a
// column by a reduce-scatter of shuffles, into the warp's own running row in
// shared memory (tiles in a fixed order), which becomes its row of `partial`;
// column_sums adds the rows in order: bitwise repeatable on a GPU.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "range.cuh"
#include "wgmma.cuh"

namespace trimul {
namespace {

constexpr int kWarpgroups = 2;
constexpr int kBlockThreads = 128 * kWarpgroups;
constexpr int kWarps = kBlockThreads / 32;  // rows of partial per block
constexpr int kTilePositions = 64;          // wgmma's m64
constexpr int kWarpRows = 16;               // a warp's rows of the tile
constexpr int kWidth = 128;                 // P and H: the chains' n and k
constexpr int kSteps = kWidth / 16;         // k16 steps per chain
constexpr int kLdc = kTilePositions + 8;    // c tile row (h) stride: 144 bytes
constexpr int kLdx = kWidth + 8;            // position-major rows: 272 bytes, a quad's 8 rows in distinct banks
constexpr uint32_t kWeightGroupBytes = 8 * kWidth * 2;  // the weights' 8-row groups (core-matrix layout)

struct Vec {  // the per-channel vectors, resident: rows of kWidth floats
  enum { ln_in_w, ln_in_b, s_out, t_out, b_gate, g_round, kCount };
};
namespace smem_at {
constexpr size_t kWeight = 2 * kWidth * kWidth;           // bytes of W' or Wg
constexpr size_t kCTile = 2 * kWidth * kLdc;              // [h][j]
constexpr size_t kXTile = 2 * kTilePositions * kLdx;      // [j][p]
constexpr size_t kBuffer = kCTile + kXTile;
constexpr size_t kWo = 0;
constexpr size_t kWg = kWo + kWeight;
constexpr size_t kVec = kWg + kWeight;
constexpr size_t kColsum = kVec + sizeof(float) * Vec::kCount * kWidth;  // float [kWarps][2 kWidth]
constexpr size_t kTiles = kColsum + sizeof(float) * kWarps * 2 * kWidth;
constexpr size_t kBytes = kTiles + kWarpgroups * 2 * kBuffer;
static_assert(kTiles % 128 == 0 && kBuffer % 128 == 0, "tiles 128-byte aligned");
static_assert(4 * kWarpRows * kLdx * 2 <= kCTile, "the four warps' staging rows fit in the c tile");
}  // namespace smem_at

// A warp's 16 staged rows (kLdx apart) to dst's rows (kWidth apart), rows < rows_left, 16 bytes a lane.
template <typename T>
__device__ __forceinline__ void rows_out(T* dst, const T* rows, int rows_left, int lane) {
  constexpr int kPieces = kWidth / 8;
#pragma unroll
  for (int k = 0; k < kWarpRows * kPieces / 32; ++k) {
    const int e = lane + 32 * k, r = e / kPieces, q = e % kPieces;
    const uint4 piece = *reinterpret_cast<const uint4*>(rows + r * kLdx + 8 * q);
    if (r < rows_left) *reinterpret_cast<uint4*>(dst + r * kWidth + 8 * q) = piece;
  }
}

// tiles along the lines the launch covers (local lines: line = line0 + local line = b N + i)
using BackLaunch = LineLaunch<OutStageBackParams, kTilePositions>;

// kNormalized: the gate reads LayerNorm(x) (p.gate_from_normalized), else x. (A template flag: a
// branch of this kind cost the kernel 3-4 %.)
template <typename T, bool kNormalized>
__global__ void __launch_bounds__(kBlockThreads, 1) out_stage_back_resident_kernel(const BackLaunch launch) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (elsewhere an empty body: out_stage_back_launch plans it on 9.0 only)
  static_assert(sizeof(T) == 2, "16-bit operands");
  const OutStageBackParams& p = launch.p;
  extern __shared__ __align__(128) unsigned char smem[];
  T* const wo = reinterpret_cast<T*>(smem + smem_at::kWo);  // W': rows p, columns h
  T* const wg = reinterpret_cast<T*>(smem + smem_at::kWg);  // Wg: rows p, columns q
  const float* const vec = reinterpret_cast<const float*>(smem + smem_at::kVec);
  // the warp's running column sums: dy | dgp
  float* const colsum = reinterpret_cast<float*>(smem + smem_at::kColsum) + (threadIdx.x / 32) * 2 * kWidth;
  {  // The weights into the core-matrix layout, the vectors, zero sums; once.
    const CoreBlockedAt<T> at{kWidth / 8};
    constexpr int kPieces = kWidth * (kWidth / 8);  // 16-byte pieces of a weight
    for (int e = threadIdx.x; e < 2 * kPieces; e += kBlockThreads) {
      const bool gate = e >= kPieces;
      const int r = (e % kPieces) / (kWidth / 8), k = 8 * (e % (kWidth / 8));
      cp_async16((gate ? wg : wo) + at(r, k), static_cast<const T*>(gate ? p.wg : p.wo_g) + r * kWidth + k);
    }
    const float* const from[Vec::kCount] = {p.ln_in_w, p.ln_in_b, p.s_out, p.t_out, p.b_gate, p.g_round};
    float* const v = reinterpret_cast<float*>(smem + smem_at::kVec);
#pragma unroll
    for (int i = 0; i < Vec::kCount; ++i)
      for (int ch = threadIdx.x; ch < kWidth; ch += kBlockThreads) v[i * kWidth + ch] = from[i][ch];
    float* const sums = reinterpret_cast<float*>(smem + smem_at::kColsum);
    for (int e = threadIdx.x; e < kWarps * 2 * kWidth; e += kBlockThreads) sums[e] = 0.f;
  }
  cp_async_wait_all();
  fence_proxy_async_shared();  // the weights, for wgmma's reads
  __syncthreads();

  const int wgi = threadIdx.x / 128, wg_tid = threadIdx.x % 128, warp = wg_tid / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  unsigned char* const buffers = smem + smem_at::kTiles + wgi * 2 * smem_at::kBuffer;
  auto c_tile = [&](int buf) { return reinterpret_cast<T*>(buffers + buf * smem_at::kBuffer); };
  auto x_tile = [&](int buf) { return reinterpret_cast<T*>(buffers + buf * smem_at::kBuffer + smem_at::kCTile); };

  // Tiles in 32-bit arithmetic (the host checks lines ceil(N / 32) < 2^31): tile = local line
  // j_tiles + j / 64, line = line0 + local line = b N + i.
  const LineTiles<kTilePositions>& space = launch.tiles;
  const uint32_t N = space.n(), Npad = static_cast<uint32_t>(p.Npad);
  const uint32_t tiles = static_cast<uint32_t>(p.lines) * space.j_tiles(), tile_step = gridDim.x * kWarpgroups;
  const int64_t plane = p.Npad * p.Npad;
  struct Tile {
    uint32_t local_line, line, j0;
  };
  auto tile_at = [&](uint32_t tile) {
    const auto at = space.at(tile);
    return Tile{at.line, static_cast<uint32_t>(p.line0) + at.line, at.j0};
  };
  auto c_of = [&](const Tile& at) {  // the tile's first element of c (h = 0)
    const auto [b, i] = space.position(at.line);
    return static_cast<T*>(p.c) + static_cast<int64_t>(b) * kWidth * plane + static_cast<int64_t>(i) * Npad + at.j0;
  };
  // Tile `tile`'s c and x into buffer `buf` (one cp.async group): c's pieces of 8 positions
  // below Npad, x's rows below N (what is past them stays as it was: rows of other positions).
  auto load = [&](uint32_t tile, int buf) {
    const Tile at = tile_at(tile);
    const T* c = c_of(at);
    const uint32_t cs = smem_addr(c_tile(buf)), xs = smem_addr(x_tile(buf));
    constexpr int kCPieces = kTilePositions / 8, kXPieces = kWidth / 8;
#pragma unroll
    for (int k = 0; k < kWidth * kCPieces / 128; ++k) {
      const int e = wg_tid + 128 * k, h = e / kCPieces, q = e % kCPieces;
      if (at.j0 + 8 * q < Npad) cp_async16(cs + (h * kLdc + 8 * q) * sizeof(T), c + h * plane + 8 * q);
    }
    const T* x = static_cast<const T*>(p.x) + (static_cast<int64_t>(at.line) * N + at.j0) * kWidth;
#pragma unroll
    for (int k = 0; k < kTilePositions * kXPieces / 128; ++k) {
      const int e = wg_tid + 128 * k, r = e / kXPieces, q = e % kXPieces;
      if (at.j0 + r < N) cp_async16(xs + (r * kLdx + 8 * q) * sizeof(T), x + r * kWidth + 8 * q);
    }
    cp_async_commit();
  };

  // ldmatrix / stmatrix addresses: matrix m = lane / 8 of each x4 access. c's (transposed) over
  // the warp's 16 positions (columns of the c tile) and all h; position-major rows within a
  // warp's 16 rows.
  const int m8 = lane / 8, r8 = lane % 8;
  const uint32_t c_lane = (((m8 / 2) * 8 + r8) * kLdc + kWarpRows * warp + (m8 % 2) * 8) * sizeof(T);
  const uint32_t row_lane = (((m8 % 2) * 8 + r8) * kLdx + (m8 / 2) * 8) * sizeof(T);
  // The weights' descriptors, built where used from a base the compiler cannot hoist (four
  // 64-bit values held across the tile loop are registers the epilogue needs).
  auto weights_at = [&]() { return smem_addr(smem) + opaque_zero(); };
  // a warp's 16 staging rows: a fragment's k16 step s at row_lane + 32 s bytes
  auto stage = [&](T* rows, const uint32_t (&a)[kSteps][4]) {
    const uint32_t base = smem_addr(rows) + row_lane;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) stsm_x4(base + s * 16 * sizeof(T), a[s]);
  };
  const float inv_w = 1.f / kWidth;

  uint32_t tile = blockIdx.x * kWarpgroups + wgi;
  if (tile < tiles) load(tile, 0);
  for (int buf = 0; tile < tiles; tile += tile_step, buf ^= 1) {
    const Tile at = tile_at(tile);
    const int rows_left = static_cast<int>(min(static_cast<uint32_t>(kTilePositions), N - at.j0)) - kWarpRows * warp;
    const int64_t pos = static_cast<int64_t>(at.line) * N + at.j0 + kWarpRows * warp;      // x, G, dx
    const int64_t out_row = static_cast<int64_t>(at.local_line) * N + at.j0 + kWarpRows * warp;  // chat, dy, dgp
    cp_async_wait<0>();
    warpgroup_barrier(wgi);  // this tile's buffer complete; every warp past the last tile's use of the other
    // 1. The fragments: ac (c, positions x h) and au (x, then u).
    uint32_t ac[kSteps][4], au[kSteps][4];
    {
      const uint32_t c_base = smem_addr(c_tile(buf)) + c_lane;
      const uint32_t x_base = smem_addr(x_tile(buf) + kWarpRows * warp * kLdx) + row_lane;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        ldsm_x4_trans(ac[s], c_base + s * 16 * kLdc * sizeof(T));
        ldsm_x4(au[s], x_base + s * 16 * sizeof(T));
      }
    }
    T* const rows1 = x_tile(buf) + kWarpRows * warp * kLdx;  // the warp's rows of the x tile: chat, then c
    T* const rows2 = c_tile(buf) + kWarpRows * warp * kLdx;  // its quarter of the c tile: G (q), then what leaves
    if (tile + tile_step < tiles) load(tile + tile_step, buf ^ 1);
    // G into the warp's quarter of the c tile as soon as every warp has read its c, so that it
    // lands under the statistics, the stagings and the first chains
    warpgroup_barrier(wgi);
    {
      const T* G = static_cast<const T*>(p.grad) + pos * kWidth;
      const uint32_t dst = smem_addr(rows2);
      constexpr int kPieces = kWidth / 8;
#pragma unroll
      for (int k = 0; k < kWarpRows * kPieces / 32; ++k) {
        const int e = lane + 32 * k, r = e / kPieces, q = e % kPieces;
        if (r < rows_left) cp_async16(dst + (r * kLdx + 8 * q) * sizeof(T), G + r * kWidth + 8 * q);
      }
      cp_async_commit();
    }

    float2 cst[2];
    const float eps_c = headroom_c_eps(p.eps, p.headroom);
#pragma unroll
    for (int half = 0; half < 2; ++half) cst[half] = fragment_row_stats<T>(ac, half, kWidth, inv_w, eps_c);
    // chat = (c - mean) rstd at the two values of ac[s][r] (row half r % 2)
    auto chat_at = [&](int s, int r) {
      const float2 v = unpack_reg<T>(ac[s][r]), st = cst[r % 2];
      return make_float2((v.x - st.x) * st.y, (v.y - st.x) * st.y);
    };
    float2 xst[2];  // x's statistics (the gate from x: its mean alone)
#pragma unroll
    for (int half = 0; half < 2; ++half) xst[half] = fragment_row_stats<T>(au, half, kWidth, inv_w, p.eps);
    if constexpr (kNormalized) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) {  // a[s][r]: row half r % 2, columns 16 s + 8 (r / 2) + 2t, + 1
          const int col = 16 * s + 8 * (r / 2) + 2 * t;
          const float2 w = load2(vec + Vec::ln_in_w * kWidth + col), b = load2(vec + Vec::ln_in_b * kWidth + col);
          const float2 v = unpack_reg<T>(au[s][r]), st = xst[r % 2];
          au[s][r] = pack_reg<T>(fmaf((v.x - st.x) * st.y, w.x, b.x), fmaf((v.y - st.x) * st.y, w.y, b.y));
        }
    }
    // chat leaves through the warp's x rows, where c then stays for LayerNorm's gradient (not in
    // 32 registers across the tile).
    {
      uint32_t ch[kSteps][4];
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 xh = chat_at(s, r);
          ch[s][r] = pack_reg<T>(xh.x, xh.y);
        }
      stage(rows1, ch);
    }
    __syncwarp();
    rows_out(static_cast<T*>(p.chat) + out_row * kWidth, rows1, rows_left, lane);
    __syncwarp();
    stage(rows1, ac);

    // 2. y and g (the stagings above came first: a wgmma's A registers are not read while it
    // runs).
    float y[16][4], gt[16][4];
    wgmma_fence();
    wgmma_chain_rs<T, kSteps>(y, ac, wgmma_desc(weights_at() + smem_at::kWo, kWeightGroupBytes));
    wgmma_chain_rs<T, kSteps>(gt, au, wgmma_desc(weights_at() + smem_at::kWg, kWeightGroupBytes));
    wgmma_commit();
    cp_async_wait_all();  // G (and the next tile's copy)
    __syncwarp();
    wgmma_wait<0>(y);
    wgmma_wait<0>(gt);

    // 3. dy and dgp into A fragments (accumulator blocks 2s and 2s + 1 are step s's pieces
    // r = 2 (j % 2) + half), and their column sums, in two halves of the channels: per half
    // entry 2j' + e (dy) and 16 + 2j' + e (dgp) for column 8 (j' + 8 part) + 2t + e.
    uint32_t ady[kSteps][4], adg[kSteps][4];
    constexpr int kHalfBlocks = kWidth / 16;  // 8-column blocks per half
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      float sums[4 * kHalfBlocks];
#pragma unroll
      for (int jj = 0; jj < kHalfBlocks; ++jj) {
        const int j = part * kHalfBlocks + jj, col = 8 * j + 2 * t;
        const float2 so = load2(vec + Vec::s_out * kWidth + col), to = load2(vec + Vec::t_out * kWidth + col);
        const float2 bg = load2(vec + Vec::b_gate * kWidth + col);
        const float2 gr = kNormalized ? make_float2(0.f, 0.f) : load2(vec + Vec::g_round * kWidth + col);
        float* const sy = sums + 2 * jj;
        float* const sg = sums + 2 * kHalfBlocks + 2 * jj;
        sy[0] = sy[1] = sg[0] = sg[1] = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = g + 8 * half;
          const bool in = row < rows_left;
          const float mu = cst[half].x, rs = cst[half].y;
          const float y0 = fmaf(rs, fmaf(-mu, so.x, y[j][2 * half]), to.x);
          const float y1 = fmaf(rs, fmaf(-mu, so.y, y[j][2 * half + 1]), to.y);
          // the gate from x: x's mean through Wg's rounding (g_round)
          const float mx = kNormalized ? 0.f : xst[half].x;
          const SigmoidPair s0 = sigmoid_pair(gt[j][2 * half] + fmaf(mx, gr.x, bg.x));
          const SigmoidPair s1 = sigmoid_pair(gt[j][2 * half + 1] + fmaf(mx, gr.y, bg.y));
          const float2 gv = load2(rows2 + row * kLdx + col);
          // rows past N: zero (their G, x and c are other positions' or never written)
          const float dy0 = in ? gv.x * s0.s : 0.f, dy1 = in ? gv.y * s1.s : 0.f;
          const float dg0 = in ? dy0 * y0 * s0.one_minus_s : 0.f, dg1 = in ? dy1 * y1 * s1.one_minus_s : 0.f;
          sy[0] += dy0, sy[1] += dy1, sg[0] += dg0, sg[1] += dg1;
          ady[j / 2][2 * (j % 2) + half] = pack_reg<T>(dy0, dy1);
          adg[j / 2][2 * (j % 2) + half] = pack_reg<T>(dg0, dg1);
          if constexpr (kNormalized) {  // q over the G just read (rows past N: zero, whatever their rstd)
            const float rx = in ? xst[half].y : 0.f;
            *reinterpret_cast<uint32_t*>(rows2 + row * kLdx + col) = pack_reg<T>(dg0 * rx, dg1 * rx);
          }
        }
      }
      column_sums_scatter(sums);
      // lane (g, t) keeps entries first .. first + 3 (one tensor's)
      const int first = scatter_first<4 * kHalfBlocks>(g);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int entry = first + e, tensor = entry / (2 * kHalfBlocks), jj = (entry % (2 * kHalfBlocks)) / 2;
        colsum[tensor * kWidth + 8 * (part * kHalfBlocks + jj) + 2 * t + entry % 2] += sums[e];
      }
    }

    // 4. dx = dgp . Wg, then dh = dy . W' (B N-major from the resident weights), each chain
    // after the staging of its A fragment (none for dgp's where q leaves in its place); dgp
    // (or q and dy) and dx leave under them.
    float acc[16][4];
    // acc = a . (resident weight at `offset`), its rows along k: issued, not waited for
    auto chain_n_major = [&](const uint32_t (&a)[kSteps][4], size_t offset) {
      wgmma_fence();
      wgmma_chain_rs<T, kSteps, true, kWeightGroupBytes>(acc, a,
                                                           wgmma_desc_n_major(weights_at() + offset, kWeightGroupBytes));
      wgmma_commit();
    };
    T* const dgp_out = static_cast<T*>(p.dgp) + out_row * kWidth;
    __syncwarp();  // every lane's G reads (and q's writes) before the rows are read or staged over
    if constexpr (kNormalized) {
      chain_n_major(adg, smem_at::kWg);
      rows_out(dgp_out, rows2, rows_left, lane);
      __syncwarp();
      stage(rows2, ady);
      __syncwarp();
      rows_out(static_cast<T*>(p.dy) + out_row * kWidth, rows2, rows_left, lane);
    } else {
      stage(rows2, ady);
      __syncwarp();
      rows_out(static_cast<T*>(p.dy) + out_row * kWidth, rows2, rows_left, lane);
      __syncwarp();
      stage(rows2, adg);
      chain_n_major(adg, smem_at::kWg);
      __syncwarp();
      rows_out(dgp_out, rows2, rows_left, lane);
    }
    wgmma_wait<0>(acc);
    {
      uint32_t dx[kSteps][4];
#pragma unroll
      for (int j = 0; j < kWidth / 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half)
          dx[j / 2][2 * (j % 2) + half] = pack_reg<T>(acc[j][2 * half], acc[j][2 * half + 1]);
      __syncwarp();  // the rows' reads (dgp or dy) before dx's writes
      stage(rows2, dx);
    }
    chain_n_major(ady, smem_at::kWo);
    __syncwarp();
    rows_out(static_cast<T*>(p.dx) + pos * kWidth, rows2, rows_left, lane);
    {  // c's fragment again, from the warp's rows
      const uint32_t base = smem_addr(rows1) + row_lane;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) ldsm_x4(ac[s], base + s * 16 * sizeof(T));
    }
    wgmma_wait<0>(acc);

    // LayerNorm's gradient on registers: dh (acc) and chat (from ac) at the same elements;
    // dc replaces ac.
    {
      float part[2][2] = {};  // [half]: sum dh, sum dh chat
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int half = r % 2, j = 2 * s + r / 2;
          const float2 xh = chat_at(s, r);
          part[half][0] += acc[j][2 * half] + acc[j][2 * half + 1];
          part[half][1] += acc[j][2 * half] * xh.x + acc[j][2 * half + 1] * xh.y;
        }
      float mean1[2], mean2[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float a = part[half][0], b = part[half][1];
        quad_sums(a, b);
        mean1[half] = a * inv_w, mean2[half] = b * inv_w;
      }
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int half = r % 2, j = 2 * s + r / 2;
          const float2 xh = chat_at(s, r);
          const float rs = cst[half].y;
          ac[s][r] = pack_reg<T>(rs * (acc[j][2 * half] - mean1[half] - xh.x * mean2[half]),
                                 rs * (acc[j][2 * half + 1] - mean1[half] - xh.y * mean2[half]));
        }
    }
    warpgroup_barrier(wgi);  // every warp's staging rows in the c tile done: dc goes across them
    {
      const uint32_t c_base = smem_addr(c_tile(buf)) + c_lane;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) stsm_x4_trans(c_base + s * 16 * kLdc * sizeof(T), ac[s]);
    }
    __syncwarp();
    {  // the warp's 16 positions of every h, to c's place (positions past N untouched)
      T* const c = c_of(at) + kWarpRows * warp;
      const T* const src = c_tile(buf) + kWarpRows * warp;
#pragma unroll
      for (int k = 0; k < kWidth * 2 / 32; ++k) {
        const int e = lane + 32 * k, h = e / 2, r0 = 8 * (e % 2);
        const T* from = src + h * kLdc + r0;
        T* to = c + h * plane + r0;
        if (r0 + 8 <= rows_left)
          *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
        else
          for (int r = 0; r < rows_left - r0; ++r) to[r] = from[r];
      }
    }
  }
  __syncwarp();  // the lanes' column-sum writes before the warp's row is read whole
  float* const partial = p.partial + static_cast<int64_t>(blockIdx.x * kWarps + threadIdx.x / 32) * 2 * kWidth;
  for (int col = lane; col < 2 * kWidth; col += 32) partial[col] = colsum[col];
#endif
}

template <typename T, bool kNormalized>
cudaError_t launch_form(const OutStageBackParams& p, int64_t blocks, cudaStream_t stream) {
  const auto kernel = out_stage_back_resident_kernel<T, kNormalized>;
  const cudaError_t e = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem_at::kBytes);
  if (e != cudaSuccess) return e;
  kernel<<<static_cast<unsigned>(blocks), kBlockThreads, smem_at::kBytes, stream>>>(BackLaunch(p));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const OutStageBackParams& p, int64_t blocks, cudaStream_t stream) {
  return p.gate_from_normalized ? launch_form<T, true>(p, blocks, stream) : launch_form<T, false>(p, blocks, stream);
}

}  // namespace

bool out_stage_back_resident_takes(const OutStageBackParams& p) {
  return p.wgmma && p.P == kWidth && p.H == kWidth && p.x_dtype == p.op_dtype &&
         (p.op_dtype == DType::bf16 || p.op_dtype == DType::f16) &&
         smem_at::kBytes <= static_cast<size_t>(p.smem_optin);
}

OutBackLaunch out_stage_back_resident_launch(const OutStageBackParams& p) {
  const int64_t tiles = p.lines * ceil_div(p.N, static_cast<int64_t>(kTilePositions));
  return {std::min<int64_t>(p.sms, ceil_div(tiles, static_cast<int64_t>(kWarpgroups))), kWarps, true,
          p.gate_from_normalized};
}

cudaError_t launch_out_stage_back_resident(const OutStageBackParams& p, int64_t blocks, cudaStream_t stream) {
  return p.op_dtype == DType::f16 ? launch_typed<__half>(p, blocks, stream)
                                  : launch_typed<__nv_bfloat16>(p, blocks, stream);
}

}  // namespace trimul
