// ln_proj_gate on tensor cores: 16-bit contraction operands (bf16, fp16), or
// fp32 ones read as tf32 (precision tf32) or as tf32 pairs (3xTF32, ieee).
// Computes what ln_proj_gate.cu computes (see there and trimul.h):
//
//   xn = LayerNorm(x[b, r, c, :]);  a, b = gated projections of xn, masked;
//   a_out[b*H + h][r][c] = a[h]     (channel-first, padding written as zeros)
//
// Block: 128 positions c of one (b, r); 8 warps.
//  1. The x tile arrives by cp.async (16-byte copies, all in flight), straight
//     into the operand tile xs when x already has the operand type, else into a
//     raw tile; each warp normalizes 16 of the tile's rows into xs and sets
//     their bias columns (OperandLayout) to 1, or the whole row to 0 where the
//     mask is 0. Within each 16 rows, rows g and g + 8 hold positions 2g and
//     2g + 1 (PosOfRow).
//  2. The 4H weight rows (copies in the operand type, OperandLayout) stream through in
//     chunks of 128 = 32 hidden units x {proj_a, gate_a, proj_b, gate_b}. With
//     mma.sync the warps split a chunk's 128 x 128 product as 2 (64 positions)
//     x 4 (32 weight rows): per k step a warp loads 4 + 2 fragments for 16
//     mma.sync. With wgmma (sm_90a, 16-bit or tf32 operands: kWgmma) each warpgroup
//     takes 64 positions x all 128 weight rows, one m64n128 per k step, both
//     operands straight from shared memory, whose tiles then take wgmma's
//     core-matrix layout (CoreBlockedAt) instead of padded rows. The next
//     chunk's copy is issued once every warp has read the current one, and
//     lands under the epilogue.
//  3. A thread's accumulator pair (2t, 2t+1) is one (projection, gate) pair,
//     bias included and at half scale, so gating is one tanh and one FMA in
//     registers (fp32 operands: an accurate sigmoid instead); the thread's two
//     rows are adjacent positions, one paired store into a staging tile
//     [channel][position], and the tile leaves as 16-byte runs along c while
//     the next chunk's products run (under wgmma's, which are asynchronous).
//     A mask other than 0 / 1 multiplies in as well.
//
// With InputBackParams (kBack), the input stage's backward front half (trimul.h):
// the same tiles and products for one chunk of positions, then per weight chunk
// the contraction's gradients da and db come in through the staging tile, the
// way a and b leave it in the forward (16-byte runs along c, issued before the
// products), and each thread turns its accumulators (the pre-activations, at
// half scale) into the gating gradients: dpre, (projection, gate) pairs in the
// operand type at the position's natural row, and the chunk's column sums (warps in order,
// then the block's row of partial sums). xn leaves from the LayerNorm's tile.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "wgmma.cuh"

namespace trimul {
namespace {

constexpr int kRows = 128;                 // positions per block
constexpr int kCols = static_cast<int>(kOperandRowTile);  // weight rows per chunk
constexpr int kWarpRows = 64, kWarpCols = 32;
constexpr int kWarpsM = kRows / kWarpRows;
constexpr int kWarpsN = kCols / kWarpCols;
constexpr int kBlockThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpgroupRows = 64;         // wgmma: positions per warpgroup (m64)
static_assert(kRows == kWarpgroupRows * kBlockThreads / 128 && kCols == 128, "wgmma tiles: m64n128 per warpgroup");
constexpr int kLnRows = kRows / (kBlockThreads / 32);     // rows each warp normalizes
constexpr int kStageRows = kCols / 2;      // the chunk's a and b channels, 2 * hidden + (0: a, 1: b)

// The staging tile of operand type T: rows of kRows positions, kStageLd apart
// (the paired stores of (g, t) in distinct banks: 32-bit word 8 t + g, or the
// 64-bit pairs of a half-warp in distinct banks for float), leaving as 16-byte
// runs.
template <typename T>
struct Staging {
  static constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte store
  static constexpr int kSegs = kRows / kVec;    // 16-byte runs per row
  static constexpr int kStoresPerThread = kStageRows * kSegs / kBlockThreads;
  static constexpr int kLd = kRows + 2 * kSmemPad<T>;
  static_assert(kStageRows * kSegs % kBlockThreads == 0 && kBlockThreads % kSegs == 0, "staging copy");
};

struct Smem {
  int ld, kp;
  size_t xs, raw, ws, stage, msk, colsum, bytes;
  // op_bytes: operand element size; raw_x_bytes: element size of x when it
  // differs from the operand type, else 0; blocked: the operand tiles xs and
  // ws in wgmma's core-matrix layout (no row padding; ld is then the row
  // length kp, not a row stride); back: the backward's column sums ([warps][kCols]
  // floats) as well
  __host__ __device__ static Smem make(int64_t P, int op_bytes, int64_t raw_x_bytes, bool blocked,
                                       bool back = false) {
    Smem s{};
    const int pad = static_cast<int>(kOperandRowPadBytes) / op_bytes;
    s.kp = static_cast<int>(round16(P + kBiasCols));  // OperandLayout::kin
    s.ld = blocked ? s.kp : s.kp + pad;
    s.xs = 0;
    s.raw = s.xs + op_bytes * kRows * s.ld;
    s.ws = s.raw + raw_x_bytes * kRows * P;
    s.ws = (s.ws + 15) / 16 * 16;
    s.stage = s.ws + op_bytes * kCols * s.ld;
    s.msk = s.stage + op_bytes * kStageRows * (kRows + 2 * pad);
    s.bytes = s.msk + sizeof(float) * kRows;
    s.colsum = s.bytes;
    if (back) s.bytes += sizeof(float) * (kBlockThreads / 32) * kCols;
    return s;
  }
};

// The position (within the tile) that operand row r holds: rows g and g + 8 of
// each 16 hold positions 2g and 2g + 1, a thread's two accumulator rows.
struct PosOfRow {
  __device__ __forceinline__ int operator()(int r) const { return (r & ~15) | ((r & 7) << 1) | ((r >> 3) & 1); }
};

__device__ __forceinline__ const LnProjGateParams& problem_of(const LnProjGateParams& p) { return p; }
__device__ __forceinline__ const LnProjGateParams& problem_of(const InputBackParams& q) { return q.in; }

// kSplit: float operands as tf32 pairs (3xTF32); float operands without it are tf32, stored
// rounded (the pack's w_in: OperandLayout::tf32_rounded; xs by LayerNorm). kWgmma: the products by
// wgmma (16-bit or tf32 operands, sm_90a), else by mma.sync. Params: LnProjGateParams
// (the forward), or InputBackParams (kBack: the backward's front half).
// (The backward's mma.sync form holds its epilogue's addresses next to 64 accumulators:
// one block per SM, where 128 registers spilled.)
template <typename Tx, typename Tab, bool kSplit, bool kWgmma, typename Params = LnProjGateParams>
__global__ void __launch_bounds__(kBlockThreads, std::is_same<Params, InputBackParams>::value && !kWgmma
                                                     ? 1
                                                     : kStageBlocksPerSm<Tab>)
    ln_proj_gate_mma_kernel(const Params q, int64_t b_first) {
  constexpr bool kBack = std::is_same<Params, InputBackParams>::value;
  const LnProjGateParams& p = problem_of(q);
  constexpr bool kInPlace = std::is_same<Tx, Tab>::value;
  static_assert(!kWgmma || !kSplit, "wgmma takes the 16-bit and tf32 operands (not 3xTF32 pairs)");
  constexpr bool kTf32Rounded = std::is_same<Tab, float>::value && !kSplit;
  using St = Staging<Tab>;
  constexpr int kVec = St::kVec, kSegs = St::kSegs, kStageLd = St::kLd;
  // mma tiles per warp: wgmma's accumulator is a warp's 16 rows x 128 columns
  constexpr int kMT = kWgmma ? 1 : kWarpRows / 16, kNT = kWgmma ? kCols / 8 : kWarpCols / 8;
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem L = Smem::make(p.P, sizeof(Tab), kInPlace ? 0 : sizeof(Tx), kWgmma, kBack);
  // element (r, k) of the operand tiles xs and ws, and of the raw x tile
  const auto op_at = [&] {
    if constexpr (kWgmma)
      return CoreBlockedAt<Tab>{L.ld / CoreBlockedAt<Tab>::kV};
    else
      return RowMajorAt{L.ld};
  }();
  const auto raw_at = [&] {
    if constexpr (kInPlace)
      return op_at;
    else
      return RowMajorAt{static_cast<int>(p.P)};
  }();
  Tab* xs = reinterpret_cast<Tab*>(smem + L.xs);
  Tx* raw = kInPlace ? reinterpret_cast<Tx*>(xs) : reinterpret_cast<Tx*>(smem + L.raw);
  Tab* ws = reinterpret_cast<Tab*>(smem + L.ws);        // weight chunk [kCols][ld]
  Tab* stage = reinterpret_cast<Tab*>(smem + L.stage);  // [kStageRows][kStageLd]
  float* msk = reinterpret_cast<float*>(smem + L.msk);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // This block's positions: c0 .. c0 + kRows - 1 (below c_end) of row r of batch entry b. The
  // forward covers every (r, c) of the padded extent; the backward's chunk, natural rows i in
  // [lo, hi), is r in it (outgoing, (i, j) = (r, c)) or c in it (incoming, (i, j) = (c, r)).
  int64_t r, c0, b, c_end;
  if constexpr (kBack) {
    const int64_t c_lo = q.incoming ? q.lo : 0, r_lo = q.incoming ? 0 : q.lo;
    c_end = q.incoming ? q.hi : p.N;
    const int64_t c_tiles = ceil_div(c_end - c_lo, kRows);
    r = r_lo + blockIdx.x / c_tiles, c0 = c_lo + (blockIdx.x % c_tiles) * kRows;
    b = q.b0 + b_first + blockIdx.y;
  } else {
    const int64_t c_tiles = ceil_div(p.Npad, kRows);
    r = blockIdx.x / c_tiles, c0 = (blockIdx.x % c_tiles) * kRows;
    b = b_first + blockIdx.y;
    c_end = p.N;
  }
  const Tx* x = static_cast<const Tx*>(p.x);
  auto pos = [&](int rr) { return c0 + PosOfRow{}(rr); };
  auto valid = [&](int rr) { return r < p.N && pos(rr) < c_end; };
  // (LayerNorm writes the padding columns of xs.)
  const StridedRows<Tx> x_rows{x + b * p.x_stride_b + r * p.x_stride_r + c0 * p.x_stride_c, p.x_stride_c,
                               r < p.N ? static_cast<int>(std::min<int64_t>(c_end - c0, kRows)) : 0};
  copy_rows(raw, raw_at, kRows, static_cast<int>(p.P), static_cast<int>(p.P), x_rows, PosOfRow{}, p.x_rows_vec16);
  const Tab* w_in = static_cast<const Tab*>(p.operands) + p.op_layout.w_in;
  const int chunks = static_cast<int>(p.op_layout.in_rows / kCols);
  // the chunk as the pack holds it (OperandLayout, blocked with kWgmma): one linear run
  const int64_t chunk_stride = kCols * static_cast<int64_t>(L.kp + kSmemPad<Tab>);
  auto load_chunk = [&](int ch) {
    copy_linear<kBlockThreads>(ws, w_in + ch * chunk_stride, static_cast<int>(kCols * sizeof(Tab)) * L.ld);
  };
  load_chunk(0);
  bool binary = true;
  for (int rr = threadIdx.x; rr < kRows; rr += kBlockThreads) {
    const float m = !valid(rr) ? 0.f
                    : p.mask   ? load_any(p.mask, p.mask_dtype,
                                          b * p.mask_stride_b + r * p.mask_stride_r + pos(rr) * p.mask_stride_c)
                               : 1.f;
    msk[rr] = m;
    binary = binary && (m == 0.f || m == 1.f);
  }
  cp_async_wait_all();
  // A 0 / 1 mask (the usual one) acts through the zeroed rows alone.
  const bool binary_mask = __syncthreads_and(binary);

  auto active = [&](int rr) { return msk[rr] != 0.f; };
  warp_layer_norm_rows<true, kTf32Rounded>(raw, raw_at, xs, op_at, warp * kLnRows, kLnRows, static_cast<int>(p.P),
                                           L.kp, p.params + p.layout.ln_in_w, p.params + p.layout.ln_in_b, p.eps,
                                           true, active);
  warp_bias_columns(xs, op_at, warp * kLnRows, kLnRows, static_cast<int>(p.P),
                    [&](int rr) { return active(rr) ? 1.f : 0.f; });
  if constexpr (kWgmma) fence_proxy_async_shared();  // xs and ws, for wgmma's reads
  __syncthreads();

  // The backward: tile position k's natural row (InputBackParams) is n_base + k n_step;
  // xn leaves from xs in 16-byte runs (P % 8 == 0: launch_input_back).
  int64_t n_base = 0, n_step = 1;
  if constexpr (kBack) {
    const int64_t lines = (b - q.b0) * (q.hi - q.lo);
    n_base = q.incoming ? (lines + c0 - q.lo) * p.N + r : (lines + r - q.lo) * p.N + c0;
    n_step = q.incoming ? p.N : 1;
    constexpr int kV8 = 16 / sizeof(Tab);
    const int runs = static_cast<int>(p.P) / kV8;
    Tab* xn = static_cast<Tab*>(q.xn);
    for (int e = threadIdx.x; e < kRows * runs; e += kBlockThreads) {
      const int rr = e / runs, k = e % runs * kV8;
      if (valid(rr))
        *reinterpret_cast<uint4*>(xn + (n_base + PosOfRow{}(rr) * n_step) * p.P + k) =
            *reinterpret_cast<const uint4*>(xs + op_at(rr, k));
    }
  }

  // This thread's accumulator element (mt, nt, 2 half + e) is operand row
  // row0 + 16 mt + 8 half + g = position row0 + 16 mt + 2 g + half, chunk
  // column col_t + 8 nt + e (e: projection, gate); its gated value goes to
  // staging row 16 warp_n + 4 nt + t (= 2 * hidden + which).
  // (wgmma: warp w holds rows 16 w .. 16 w + 15 of its warpgroup's 64, all 128 columns.)
  const int g = lane / 4, t = lane % 4;
  const int warp_n = kWgmma ? 0 : warp / kWarpsM;
  const int row0 = kWgmma ? 16 * warp : (warp % kWarpsM) * kWarpRows, col_t = warp_n * kWarpCols + 2 * t;
  float m_t[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int half = 0; half < 2; ++half) m_t[mt][half] = msk[row0 + 16 * mt + 8 * half + g];
  Tab* stage_t = stage + (16 * warp_n + t) * kStageLd + row0 + 2 * g;
  const int64_t w_rows = 4 * p.H;

  // Staging copy: thread -> (segment, first staging row); channel h of a chunk
  // sits at plane b * H + 32 ch + srow / 2 of a (srow even) or b (odd).
  const int seg = threadIdx.x % kSegs, srow0 = threadIdx.x / kSegs;
  constexpr int kSrowStep = kBlockThreads / kSegs;
  const int64_t plane = p.Npad * p.Npad;
  const bool seg_ok = c0 + seg * kVec < p.Npad;
  Tab* out_t = static_cast<Tab*>(srow0 % 2 ? p.b : p.a) + (b * p.H + srow0 / 2) * plane + r * p.Npad + c0 + seg * kVec;
  const int64_t plane_step = (kSrowStep / 2) * plane, chunk_planes = (kCols / 4) * plane;

  // The staging tile of chunk ch out to a and b, 16-byte runs along c.
  auto copy_out = [&](int ch) {
    if (!seg_ok) return;
    const int h_left = static_cast<int>(p.H - static_cast<int64_t>(ch) * (kCols / 4));  // channels from this chunk on
    Tab* out_ch = out_t + ch * chunk_planes;
#pragma unroll
    for (int i = 0; i < St::kStoresPerThread; ++i) {
      const int srow = srow0 + i * kSrowStep;
      if (srow / 2 >= h_left) break;  // rows grow with i
      *reinterpret_cast<uint4*>(out_ch + i * plane_step) =
          *reinterpret_cast<const uint4*>(stage + srow * kStageLd + seg * kVec);
    }
  };

  // The backward: chunk ch's da and db channels into the staging tile, as copy_out writes a
  // and b (left in flight; segments past Npad and channels past H are not read).
  auto copy_in = [&](int ch) {
    if constexpr (kBack) {
      if (!seg_ok) return;
      const int h_left = static_cast<int>(p.H - static_cast<int64_t>(ch) * (kCols / 4));
      const Tab* in_ch = static_cast<const Tab*>(srow0 % 2 ? q.db : q.da) +
                         (b * p.H + srow0 / 2) * plane + r * p.Npad + c0 + seg * kVec + ch * chunk_planes;
#pragma unroll
      for (int i = 0; i < St::kStoresPerThread; ++i) {
        const int srow = srow0 + i * kSrowStep;
        if (srow / 2 >= h_left) break;
        cp_async16(stage + srow * kStageLd + seg * kVec, in_ch + i * plane_step);
      }
    }
  };
  float* colsum = reinterpret_cast<float*>(smem + L.colsum);  // [warp][kCols] (kBack)

  // The backward's epilogue of one weight chunk: accumulator (mt, nt, 2 half + e) is
  // (projection, gate) e of unit column col_t + 8 nt at tile position row0 + 16 mt + 2 g +
  // half, times kOperandScale; its d (da or db, masked) sits in the staging tile where the
  // forward puts the gated value. dpre to the natural row, then the column sums.
  auto back_epilogue = [&](const float (&acc)[kMT][kNT][4], int64_t col0, int cols_left) {
    if constexpr (kBack) {
      using Pair = typename Vec2<Tab>::type;
      constexpr float kUnscale = 1.f / kOperandScale;
      const float d_unscale = q.grad != nullptr ? q.grad->unscale : 1.f;  // (da's and db's scale: GradScale)
      // dpre at tile position k: row n_base + k n_step; this thread's first position row0 + 2 g
      const int64_t pos_stride = n_step * w_rows;
      Tab* dpre_t = static_cast<Tab*>(q.dpre) + (n_base + (row0 + 2 * g) * n_step) * w_rows + col0 + col_t;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const bool col_ok = col_t + 8 * nt < cols_left;  // (lane-dependent: no branch around the shuffles)
        float sp = 0.f, sg = 0.f;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const float* v = acc[mt][nt];
          const float2 d = Vec2<Tab>::unpack(*reinterpret_cast<const Pair*>(stage_t + 4 * nt * kStageLd + 16 * mt));
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int k = 16 * mt + half;  // position row0 + 2 g + k
            const float m = col_ok ? m_t[mt][half] : 0.f;
            // (stale staging past N or H: not read)
            const float dd = m == 0.f ? 0.f : (half ? d.y : d.x) * d_unscale * m;
            const float pj = v[2 * half] * kUnscale;
            const SigmoidPair sig = sigmoid_pair(v[2 * half + 1] * kUnscale);
            const float dp = dd * sig.s, dg = dp * pj * sig.one_minus_s;
            sp += dp, sg += dg;
            if (col_ok && c0 + row0 + 2 * g + k < c_end) store2(dpre_t + k * pos_stride + 8 * nt, dp, dg);
          }
        }
        // over the warp's 8 row groups g (lanes t, t + 4, ...), in a fixed order
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          sp += __shfl_xor_sync(0xffffffffu, sp, o);
          sg += __shfl_xor_sync(0xffffffffu, sg, o);
        }
        if (g == 0 && col_ok) {
          colsum[warp * kCols + col_t + 8 * nt] = sp;
          colsum[warp * kCols + col_t + 8 * nt + 1] = sg;
        }
      }
      __syncthreads();
      // the warps holding column c, in order: the block's row of partial sums
      float* part = q.partial + ((b_first + blockIdx.y) * gridDim.x + blockIdx.x) * w_rows + col0;
      for (int c = threadIdx.x; c < cols_left; c += kBlockThreads) {
        float total = 0.f;
        for (int w = 0; w < kBlockThreads / 32; ++w)
          if (kWgmma || w / kWarpsM == c / kWarpCols) total += colsum[w * kCols + c];
        part[c] = total;
      }
    }
  };

  // wgmma: this warpgroup's 64 rows of xs, and ws; 8-row groups 8 L.ld elements apart
  const uint32_t group_bytes = 8 * L.ld * sizeof(Tab);
  const uint64_t desc_a = wgmma_desc(smem_addr(xs) + (warp / 4) * (kWarpgroupRows / 8) * group_bytes, group_bytes);
  const uint64_t desc_b = wgmma_desc(smem_addr(ws), group_bytes);
  for (int ch = 0; ch < chunks; ++ch) {
    if (ch > 0) {
      cp_async_wait_all();
      if constexpr (kWgmma) fence_proxy_async_shared();
      __syncthreads();
    }
    copy_in(ch);             // (the backward: its staging tile's reads of chunk ch - 1 are past)
    float acc[kMT][kNT][4];  // (wgmma_chain overwrites, warp_mma accumulates)
    if constexpr (kWgmma) {  // the previous chunk's copy-out runs under the products
      wgmma_fence();
      wgmma_chain<Tab>(acc[0], desc_a, desc_b, L.kp / kMmaK<Tab>);
      wgmma_commit();
      if (!kBack && ch > 0) copy_out(ch - 1);
      wgmma_wait<0>(acc[0]);
    } else {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
      warp_mma<Tab, kMT, kNT, false, kSplit, false, kTf32Rounded, kTf32Rounded>(
          acc, xs, L.ld, ws + warp_n * kWarpCols * L.ld, L.ld, row0, L.kp);
    }
    __syncthreads();  // every warp has read ws, and the previous staging tile is out
    if (ch + 1 < chunks) load_chunk(ch + 1);
    // the chunk's weight rows that exist; a 32-bit test per tile in the wgmma form (64-bit
    // compares were 4 of its ~10 instructions per tile; with mma.sync a 32-bit one spills)
    const int64_t col0 = static_cast<int64_t>(ch) * kCols;
    const int cols_left = static_cast<int>(std::min<int64_t>(kCols, w_rows - col0));
    if constexpr (kBack) {
      cp_async_wait_all();  // the da / db tile (and the next weight chunk)
      __syncthreads();
      back_epilogue(acc, col0, cols_left);
      continue;
    }
    auto gate_into_stage = [&](auto scale_by_mask) {
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        if (kWgmma ? col_t + 8 * nt >= cols_left : col0 + col_t + 8 * nt >= w_rows) continue;
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const float* v = acc[mt][nt];
          float even = gated_half_scale_for<Tab>(v[0], v[1]), odd = gated_half_scale_for<Tab>(v[2], v[3]);
          if (scale_by_mask) even *= m_t[mt][0], odd *= m_t[mt][1];
          store2(stage_t + 4 * nt * kStageLd + 16 * mt, even, odd);
        }
      }
    };
    if (binary_mask)
      gate_into_stage(std::false_type{});
    else
      gate_into_stage(std::true_type{});
    __syncthreads();
    if constexpr (!kWgmma) copy_out(ch);  // (registers: under mma.sync's products it would spill)
  }
  if constexpr (kWgmma && !kBack) copy_out(chunks - 1);
}

template <typename Tx, typename Tab, bool kSplit, bool kWgmma>
cudaError_t launch_typed(const LnProjGateParams& p, cudaStream_t stream) {
  const size_t smem = Smem::make(p.P, sizeof(Tab), std::is_same<Tx, Tab>::value ? 0 : sizeof(Tx), kWgmma).bytes;
  return launch_grid_rows(ln_proj_gate_mma_kernel<Tx, Tab, kSplit, kWgmma>, ceil_div(p.Npad, kRows) * p.Npad, p.B,
                          kBlockThreads, smem, p, stream);
}

template <typename Tab, bool kSplit = false, bool kWgmma = false>
cudaError_t launch_for_ab(const LnProjGateParams& p, cudaStream_t stream) {
  if constexpr (kWgmma)  // x in the operand type only (trimul.cpp: plan)
    return p.x_dtype == dtype_code<Tab>() ? launch_typed<Tab, Tab, kSplit, true>(p, stream) : cudaErrorInvalidValue;
  else
    switch (p.x_dtype) {
      case DType::bf16: return launch_typed<__nv_bfloat16, Tab, kSplit, false>(p, stream);
      case DType::f16: return launch_typed<__half, Tab, kSplit, false>(p, stream);
      default: return launch_typed<float, Tab, kSplit, false>(p, stream);
    }
}

// The backward's grid: (r, c tile) per block of a batch entry (kernel's kBack positions).
int64_t back_grid_x(const InputBackParams& q) {
  const int64_t lines = q.hi - q.lo, N = q.in.N;
  return q.incoming ? N * ceil_div(lines, kRows) : lines * ceil_div(N, kRows);
}

template <typename Tx, typename Tab, bool kSplit, bool kWgmma>
cudaError_t launch_back_typed(const InputBackParams& q, cudaStream_t stream) {
  const size_t smem =
      Smem::make(q.in.P, sizeof(Tab), std::is_same<Tx, Tab>::value ? 0 : sizeof(Tx), kWgmma, true).bytes;
  return launch_grid_rows(ln_proj_gate_mma_kernel<Tx, Tab, kSplit, kWgmma, InputBackParams>, back_grid_x(q),
                          q.b1 - q.b0, kBlockThreads, smem, q, stream);
}

template <typename Tab, bool kSplit = false>
cudaError_t launch_back_for_ab(const InputBackParams& q, cudaStream_t stream) {
  if constexpr (!kSplit)
    if (q.in.op_layout.in_blocked)  // x in the operand type only (trimul.cpp: plan)
      return q.in.x_dtype == dtype_code<Tab>() ? launch_back_typed<Tab, Tab, false, true>(q, stream)
                                               : cudaErrorInvalidValue;
  switch (q.in.x_dtype) {
    case DType::bf16: return launch_back_typed<__nv_bfloat16, Tab, kSplit, false>(q, stream);
    case DType::f16: return launch_back_typed<__half, Tab, kSplit, false>(q, stream);
    default: return launch_back_typed<float, Tab, kSplit, false>(q, stream);
  }
}

}  // namespace

int64_t input_back_blocks(const InputBackParams& q) {
  return input_back_resident_takes(q) ? input_back_resident_rows(q) : back_grid_x(q) * (q.b1 - q.b0);
}

cudaError_t launch_input_back(const InputBackParams& q, cudaStream_t stream) {
  if (q.dx != nullptr && !input_back_finishes(q)) return cudaErrorInvalidValue;
  if (input_back_blocks(q) == 0) return cudaSuccess;
  if (input_back_resident_takes(q))
    return q.grad == nullptr ? launch_input_back_resident(q, stream) : cudaErrorInvalidValue;
  if (q.in.op_layout.in_k_paired) return cudaErrorInvalidValue;  // w_in packed for the resident kernel alone
  switch (q.in.ab_dtype) {
    case DType::bf16: return launch_back_for_ab<__nv_bfloat16>(q, stream);
    case DType::f16: return launch_back_for_ab<__half>(q, stream);
    default:
      if (q.in.precision == Precision::ieee)
        return q.in.op_layout.in_blocked ? cudaErrorInvalidValue : launch_back_for_ab<float, true>(q, stream);
      return q.in.op_layout.tf32_rounded ? launch_back_for_ab<float>(q, stream) : cudaErrorInvalidValue;
  }
}

size_t input_back_smem(int64_t P, int64_t operand_bytes, int64_t raw_x_bytes) {
  return Smem::make(P, static_cast<int>(operand_bytes), raw_x_bytes, false, true).bytes;  // the larger layout
}

size_t ln_proj_gate_mma_smem(int64_t P, int64_t operand_bytes, int64_t raw_x_bytes) {
  return Smem::make(P, static_cast<int>(operand_bytes), raw_x_bytes, false).bytes;  // the larger layout
}

cudaError_t launch_ln_proj_gate_mma(const LnProjGateParams& p, cudaStream_t stream) {
  if (ln_proj_gate_resident_takes(p)) return launch_ln_proj_gate_resident(p, stream);
  if (p.op_layout.in_k_paired) return cudaErrorInvalidValue;  // w_in packed for the resident kernel alone
  const bool wgmma = p.op_layout.in_blocked;  // w_in packed for it
  switch (p.ab_dtype) {
    case DType::f16: return wgmma ? launch_for_ab<__half, false, true>(p, stream) : launch_for_ab<__half>(p, stream);
    case DType::bf16:
      return wgmma ? launch_for_ab<__nv_bfloat16, false, true>(p, stream) : launch_for_ab<__nv_bfloat16>(p, stream);
    default:
      if (p.precision == Precision::ieee) return wgmma ? cudaErrorInvalidValue : launch_for_ab<float, true>(p, stream);
      if (!p.op_layout.tf32_rounded) return cudaErrorInvalidValue;
      return wgmma ? launch_for_ab<float, false, true>(p, stream) : launch_for_ab<float>(p, stream);
  }
}

}  // namespace trimul
