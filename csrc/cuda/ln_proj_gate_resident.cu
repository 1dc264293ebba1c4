// ln_proj_gate with the weights resident (sm_90a, 16-bit operands, x in their
// type): what ln_proj_gate_mma.cu computes, by persistent blocks that copy all
// 4H packed weight rows into shared memory once and then walk tiles of 64
// positions, each warpgroup on its own tiles with no block-wide barrier:
//
//   1. The warpgroup's 64 positions (one (b, r), c0 .. c0 + 63) come from global
//      memory straight into registers, in the layout of wgmma's A fragment (the
//      m16n8k16 one per warp: thread (g, t) of warp w holds tile rows 16 w + g and
//      16 w + g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9 of every k16 step), one
//      16-byte load per row and pair of steps: the pack's w_in has its columns in
//      the order those loads give (OperandLayout::in_k_paired, PairedColumns), so
//      what a thread holds of a step pair is 8 adjacent columns of x. (The
//      fragment's own order took four 4-byte loads, each warp's touching 8 rows:
//      ~30 % of the stage's L1 wavefronts, the SM's busiest pipe.) The next tile's
//      loads are issued before the current tile's products, so they land under them.
//   2. LayerNorm on those registers (row sums over the 4 lanes t by shuffles) and the
//      kBiasCols bias columns (OperandLayout), zero rows where the mask is 0; the
//      result is the A fragment, kept in registers for every weight chunk. The
//      input affine is the pack's, folded into w_in (OperandLayout::in_folded);
//      the backward, which writes the normalized rows out, applies it here and
//      reads w_in's unfolded copy.
//   3. Per chunk of kChunkRows weight rows (32 hidden units x {proj_a, gate_a,
//      proj_b, gate_b}, the pack's chunk in the core-matrix layout), one wgmma
//      chain m64n128k16 with A from registers, B from the resident weights. Two
//      accumulator sets: chunk ch + 1's chain runs while chunk ch's epilogue gates
//      its accumulators (p + p tanh(g) at half scale, then the mask) into a staging
//      tile, a's box and b's [hidden unit][position] with the 128-byte swizzle
//      (tma.cuh; the folded w_in's rows are ordered so that its 4-byte stores hit
//      32 banks: staged_in_row), which one thread stores to a and b by two
//      tensor-map copies. Staging tiles alternate, so one warpgroup barrier per chunk.
//      With four chunks (H in (96, 128]) the forward runs them straight-line, each
//      chain issued as soon as its accumulator set's epilogue is done, so every
//      epilogue runs under a chain: the last one under the next tile's first chain,
//      issued after that tile's LayerNorm; other counts go in pairs, as does
//      the backward form (in that order it lost 23 %: its staging tiles then take
//      their da and db one chunk at a time, behind a barrier each).
//
// Tile rows 16 w + g and + 8 hold positions 16 w + 2 g and + 1 (as PosOfRow in
// the chunked kernel), so a thread's two values of a channel are adjacent
// positions: one 4-byte staging store.
//
// With InputBackParams (kBack), the input stage's backward front half (trimul.h:
// what the chunked kernel's kBack form computes) over the positions of one chunk:
// the same loads, LayerNorm and chains; xn leaves from the A fragment (the finishing
// form instead writes rstd dpre and no xn: InputBackParams::dpre); each pair of
// chunks' da and db tiles come into the two staging tiles by cp.async, issued with
// the chains, and the epilogue turns the pre-activations into dpre and adds the
// column sums into one row of shared memory per warp (its tiles in order); at the
// end each warpgroup writes its row of partial sums, so the sums are repeatable.
#include <type_traits>
#include <utility>

#include "common.cuh"
#include "mma.cuh"
#include "range.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace trimul {
namespace {

constexpr int kWarpgroups = 2;                       // per block, each on its own tiles
constexpr int kBlockThreads = 128 * kWarpgroups;
constexpr int kTilePositions = 64;                   // wgmma's m64
constexpr int kChunkRows = static_cast<int>(kOperandRowTile);  // weight rows per chain: n128
constexpr int kChunkChannels = kChunkRows / 2;       // gated values per position and chunk
constexpr int kChunkUnits = kChunkChannels / 2;      // hidden units per chunk (a and b each)
constexpr int kMaxSteps = 9;                         // k16 steps: kin <= 144 (P <= 136)
constexpr int kMaxKin = 16 * kMaxSteps;
// the backward's staging rows (channels) kStageLd elements apart: 160 bytes, so the 4 rows a
// warp's lanes t store to start 8 banks apart and the 8 lanes g fill the rest (32 distinct banks)
constexpr int kStageLd = kTilePositions + 16;
constexpr int kStageBuffers = 2;
// The forward's staging tile: a's box and b's (kChunkUnits rows of 64 positions, 128 bytes,
// swizzled: tma.cuh), stored by two tensor-map copies
constexpr int kBoxBytes = kChunkUnits * kSwizzleRowBytes;
static_assert(2 * kBoxBytes <= kChunkChannels * kStageLd * 2, "a buffer's two boxes within the backward's tile");
// The forward's accumulator j of lane t (columns 8 j + 2 t, + 1 of a chunk) is channel j % 2 of
// hidden unit staged_unit(j, t): what the pack's staged_in_row puts there.
__host__ __device__ constexpr int staged_unit(int j, int t) { return 8 * (j / 4) + 2 * t + (j / 2) % 2; }
constexpr bool staged_units_match_pack() {
  for (int j = 0; j < 16; ++j)
    for (int t = 0; t < 4; ++t)
      for (int e = 0; e < 2; ++e)
        if (staged_in_row(4 * staged_unit(j, t) + 2 * (j % 2) + e) != 8 * j + 2 * t + e) return false;
  return true;
}
static_assert(staged_units_match_pack(), "the forward's staging and the pack's w_in rows must agree");
// chunks the forward takes straight-line and the finishing backward takes (H in (96, 128])
constexpr int kRollingChunks = 4;
static_assert(kChunkRows == 128, "one m64n128k16 chain per chunk");
// The backward that finishes the stage (InputBackParams::dx): du = dpre W_in as m64n128 chains,
// so P = 128 (the first 8 of the 9 k16 steps of w_in's columns are x's), and four chunks.
constexpr int kFinishP = 128;

// Column sums a warp keeps in the backward: dpre's (in_rows), then with dx LayerNorm's (2P).
__host__ __device__ inline int64_t sum_cols(int64_t in_rows, int64_t P, bool back, bool finish) {
  return back ? in_rows + (finish ? 2 * P : 0) : 0;
}

struct ResidentSmem {
  size_t w, stage, gamma, beta, colsum, bytes;
  // w: in_rows x kin operands (each chunk's core matrices, back to back: a multiple of
  // kSwizzleBlockBytes, so the staging after it keeps the block's alignment); the staging tiles:
  // kStageBuffers per warpgroup; gamma and beta: kin floats each (the input affine as the kernel
  // extends it); the backward's column sums, `cols` floats per warp (sum_cols). `bytes` has room
  // to align the start to kSwizzleBlockBytes.
  __host__ __device__ static ResidentSmem make(int64_t kin, int64_t in_rows, int64_t cols) {
    ResidentSmem s{};
    s.w = 0;
    s.stage = s.w + 2 * in_rows * kin;
    s.gamma = s.stage + 2 * kWarpgroups * kStageBuffers * kChunkChannels * kStageLd;
    s.beta = s.gamma + sizeof(float) * kin;
    s.colsum = s.beta + sizeof(float) * kin;
    s.bytes = s.colsum + sizeof(float) * 4 * kWarpgroups * cols + kSwizzleBlockBytes;
    return s;
  }
};
static_assert(2 * kChunkRows * 16 % kSwizzleBlockBytes == 0, "w's bytes: whole swizzle blocks");


__device__ __forceinline__ uint4 load_x16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }
__device__ __forceinline__ uint2 load_x8(const void* p) { return __ldg(static_cast<const uint2*>(p)); }


// The tiles of a launch: batch entries b_base + .., rows r_lo + [0, r_count), 64-position
// tiles from c_lo (c_tiles per row); a position is in the problem when its row is below
// r_end and it is below c_end. The forward: every (r, c) of the padded extent (the padding
// written as zeros); the backward's chunk (InputBackParams): natural rows i in [lo, hi) as r
// (outgoing, (i, j) = (r, c)) or as c (incoming, (i, j) = (c, r)). Tile numbers stay below
// 2^31 (resident_takes).
struct TileSpace {
  uint32_t r_count, c_tiles, tiles;
  int64_t b_base, r_lo, c_lo, r_end, c_end;
  FastDiv by_b, by_c_tiles;  // by r_count c_tiles (tiles per batch entry), by c_tiles
};
inline TileSpace make_tile_space(int64_t batches, int64_t r_count, int64_t c_tiles, int64_t b_base, int64_t r_lo,
                                 int64_t c_lo, int64_t r_end, int64_t c_end) {
  const auto per_b = static_cast<uint32_t>(r_count * c_tiles);
  return {static_cast<uint32_t>(r_count), static_cast<uint32_t>(c_tiles), static_cast<uint32_t>(batches * per_b),
          b_base, r_lo, c_lo, r_end, c_end, FastDiv(per_b), FastDiv(static_cast<uint32_t>(c_tiles))};
}
inline TileSpace tile_space(const LnProjGateParams& p) {
  return make_tile_space(p.B, p.Npad, ceil_div(p.Npad, kTilePositions), 0, 0, 0, p.N, p.N);
}
inline TileSpace tile_space(const InputBackParams& q) {
  const int64_t lines = q.hi - q.lo, N = q.in.N;
  return make_tile_space(q.b1 - q.b0, q.incoming ? N : lines, ceil_div(q.incoming ? lines : N, kTilePositions), q.b0,
                         q.incoming ? 0 : q.lo, q.incoming ? q.lo : 0, N, q.incoming ? q.hi : N);
}
__host__ __device__ inline int64_t tile_count(const LnProjGateParams& p) {
  return p.B * p.Npad * ceil_div(p.Npad, kTilePositions);
}
__host__ __device__ inline int64_t tile_count(const InputBackParams& q) {
  const int64_t lines = q.hi - q.lo, N = q.in.N;
  return (q.b1 - q.b0) * (q.incoming ? N * ceil_div(lines, kTilePositions) : lines * ceil_div(N, kTilePositions));
}

// A launch's arguments: the stage's and its tiles' space, which the host computes (the divisors'
// constants then come from the parameter space, not registers), and for the forward the tensor
// maps of a and b ([B][H][Npad][Npad] as 4-D: positions, hidden units, rows, batch entries).
template <typename Params>
struct Resident {
  Params args;
  TileSpace space;
  CUtensorMap a_map, b_map;
};

// The warpgroup's view of one tile: batch entry b, row r, positions c0 .. c0 + 63 (each below
// 2^31: takes() bounds B N and N; every use widens them against 64-bit strides).
struct Tile {
  int32_t b, r, c0;
  __device__ __forceinline__ Tile(uint32_t tile, const TileSpace& sp) {
    const uint32_t bq = sp.by_b.div(tile), rem = tile - bq * sp.by_b.d, rq = sp.by_c_tiles.div(rem);
    b = static_cast<int32_t>(sp.b_base + bq);
    r = static_cast<int32_t>(sp.r_lo + rq);
    c0 = static_cast<int32_t>(sp.c_lo + (rem - rq * sp.c_tiles) * kTilePositions);
  }
};

__device__ __forceinline__ const LnProjGateParams& problem_of(const LnProjGateParams& p) { return p; }
__device__ __forceinline__ const LnProjGateParams& problem_of(const InputBackParams& q) { return q.in; }
inline const LnProjGateParams& problem_of_host(const LnProjGateParams& p) { return p; }
inline const LnProjGateParams& problem_of_host(const InputBackParams& q) { return q.in; }

// An element of any mask dtype as raw bits (zero-extended), and its value: the mask's loads
// stay in flight until the value is wanted (a conversion next to the load would wait for it).
__device__ __forceinline__ uint64_t load_bits(const void* ptr, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::b8:
    case DType::u8:
    case DType::i8: return static_cast<const uint8_t*>(ptr)[i];
    case DType::bf16:
    case DType::f16:
    case DType::i16: return static_cast<const uint16_t*>(ptr)[i];
    case DType::f32:
    case DType::i32: return static_cast<const uint32_t*>(ptr)[i];
    default: return static_cast<const uint64_t*>(ptr)[i];
  }
}
__device__ __forceinline__ float value_of_bits(uint64_t v, DType dtype) {
  const uint32_t lo = static_cast<uint32_t>(v);
  switch (dtype) {
    case DType::f32: return __uint_as_float(lo);
    case DType::f64: return static_cast<float>(__longlong_as_double(static_cast<long long>(v)));
    case DType::bf16: return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(lo)));
    case DType::f16: return __half2float(__ushort_as_half(static_cast<unsigned short>(lo)));
    case DType::b8:
    case DType::u8: return static_cast<float>(lo);
    case DType::i8: return static_cast<float>(static_cast<int8_t>(lo));
    case DType::i16: return static_cast<float>(static_cast<int16_t>(lo));
    case DType::i32: return static_cast<float>(static_cast<int32_t>(lo));
    case DType::i64: return static_cast<float>(static_cast<long long>(v));
  }
  return 0.f;
}

// x columns in the order of the pack's w_in (OperandLayout::in_k_paired): thread t's pieces
// (2t.., 2t + 8..) of steps 2u and 2u + 1 are x columns 32 u + 8 t .. + 7, one 16-byte load; an
// unpaired last step's, 16 s + 4 t .. + 3. The call gives the first of piece (s, piece)'s two
// columns. (P % 8 == 0: a run of 8, or of 4 from a multiple of 4, is in or out whole.)
template <int kSteps>
struct PairedColumns {
  static constexpr int kPairs = kSteps / 2;
  int t;
  __host__ __device__ constexpr int operator()(int s, int piece) const {
    return s < 2 * kPairs ? 32 * (s / 2) + 8 * t + 4 * (s % 2) + 2 * piece : 16 * s + 4 * t + 2 * piece;
  }
  struct In {  // whether the piece is among the row's first len columns
    PairedColumns col;
    int len;
    __device__ __forceinline__ bool operator()(int s, int piece) const { return col(s, piece) < len; }
  };
};

// PairedColumns and the pack's k_paired_position (trimul.h) describe one order from its two
// ends: the x column a thread loads for fragment piece (s, piece) must sit, in w_in, at that
// piece's fragment column 16 s + 2 t + 8 piece.
template <int kSteps>
constexpr bool paired_columns_match_pack() {
  for (int t = 0; t < 4; ++t)
    for (int s = 0; s < kSteps; ++s)
      for (int piece = 0; piece < 2; ++piece)
        for (int e = 0; e < 2; ++e)
          if (k_paired_position(PairedColumns<kSteps>{t}(s, piece) + e, 16 * kSteps) != 16 * s + 2 * t + 8 * piece + e)
            return false;
  return true;
}
static_assert(paired_columns_match_pack<1>() && paired_columns_match_pack<2>() && paired_columns_match_pack<3>() &&
                  paired_columns_match_pack<8>() && paired_columns_match_pack<kMaxSteps>(),
              "the resident stage's x loads and the pack's w_in columns must agree");

// What a thread holds of a tile before LayerNorm: x at its two rows (row half 0: tile row
// 16 w + g, half 1: + 8) and kSteps k16 steps, fragment pieces (2t, 2t + 1) and (2t + 8,
// 2t + 9), i.e. x columns PairedColumns (s, piece) and + 1, zero past P; and the mask's bits
// at both rows (0 past N; 1 without a mask).
template <int kSteps>
struct Raw {
  uint32_t x[2][kSteps][2];
  uint64_t m[2];
};

// kP: the channels P (a multiple of 8 up to kMaxKin - 8), which fix the k16 steps. Params:
// LnProjGateParams (the forward) or InputBackParams (kBack); kFinish: the backward with
// InputBackParams::dx (input_back_finishes); kRange: the forward at precision tf32 on the fp16
// stages (op_layout.range: x comes normalized, its LayerNorm statistics 0 and 1, and the mask
// scaled; trimul.h: RangeScales).
template <typename T, int kP, typename Params, bool kFinish, bool kRange = false>
__global__ void __launch_bounds__(kBlockThreads, 1) ln_proj_gate_resident_kernel(const __grid_constant__ Resident<Params> launch,
                                                                                 int64_t) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (elsewhere an empty body: plan() launches it on 9.0 only)
  constexpr bool kBack = std::is_same<Params, InputBackParams>::value;
  static_assert(sizeof(T) == 2, "16-bit operands");
  constexpr int kin = static_cast<int>(round16(kP + kBiasCols)), kSteps = kin / 16, P = kP;
  static_assert(kP % 8 == 0 && kin <= kMaxKin, "channels");
  static_assert(!kFinish || (kBack && kP == kFinishP), "the finishing backward: P = 128");
  const Params& args = launch.args;
  const LnProjGateParams& p = problem_of(args);
  extern __shared__ __align__(128) unsigned char smem_window[];
  unsigned char* const smem =
      smem_window + (kSwizzleBlockBytes - smem_addr(smem_window) % kSwizzleBlockBytes) % kSwizzleBlockBytes;
  const int cols = static_cast<int>(sum_cols(p.op_layout.in_rows, P, kBack, kFinish));  // a warp's column sums
  const ResidentSmem L = ResidentSmem::make(kin, p.op_layout.in_rows, cols);
  T* w = reinterpret_cast<T*>(smem + L.w);
  float* gamma = reinterpret_cast<float*>(smem + L.gamma);
  float* beta = reinterpret_cast<float*>(smem + L.beta);
  const int chunks = static_cast<int>(p.op_layout.in_rows / kChunkRows);

  // The weights once: the pack's chunk ch is its core matrices, then padding (OperandLayout);
  // the forward's with the input affine folded in, the backward's (w_in_plain) without.
  const T* w_in = static_cast<const T*>(p.operands) + (kBack ? p.op_layout.w_in_plain : p.op_layout.w_in);
  const int64_t pack_chunk = kChunkRows * (p.op_layout.kin + p.op_layout.pad);
  const int chunk_elems = kChunkRows * kin;
  for (int ch = 0; ch < chunks; ++ch)
    copy_linear<kBlockThreads>(w + ch * chunk_elems, w_in + ch * pack_chunk, chunk_elems * static_cast<int>(sizeof(T)));
  // The backward's affine as the operand row wants it: gamma[k] (0 from P on) and beta[k], then
  // 1 at the bias columns P, P + 1 and 0 after, so (x - mean) rstd gamma + beta is the whole row
  // with x read as 0 past P. (The forward's w_in has it folded in: OperandLayout::in_folded.)
  if constexpr (kBack)
    for (int k = threadIdx.x; k < kin; k += kBlockThreads) {
      gamma[k] = k < P ? p.params[p.layout.ln_in_w + k] : 0.f;
      beta[k] = k < P ? p.params[p.layout.ln_in_b + k] : k < P + kBiasCols ? 1.f : 0.f;
    }
  const int in_rows = static_cast<int>(p.op_layout.in_rows);
  float* colsum = reinterpret_cast<float*>(smem + L.colsum);  // kBack: [warp of the block][cols]
  if constexpr (kBack)
    for (int c = threadIdx.x; c < 4 * kWarpgroups * cols; c += kBlockThreads) colsum[c] = 0.f;
  cp_async_wait_all();
  fence_proxy_async_shared();  // the weights, for wgmma's reads
  __syncthreads();

  const TileSpace& space = launch.space;
  const int wg = threadIdx.x / 128, wg_tid = threadIdx.x % 128, warp = wg_tid / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const uint32_t tiles = space.tiles, tile_step = gridDim.x * kWarpgroups;
  const T* x = static_cast<const T*>(p.x);
  static_assert(!kRange || !kBack, "kRange: the forward");
  const float mask_scale = kRange ? range_mask_scale(*p.op_layout.range) : 1.f;
  // kRange: the gate rows' scale, 1 unless their weights would overflow fp16 (range.cuh), undone in
  // the scaled epilogue (TileOut::scale), which the common case then does not take
  const float gate_unscale = kRange ? range_gate_unscale(*p.op_layout.range) : 1.f;

  constexpr int kPairs = PairedColumns<kSteps>::kPairs;
  const PairedColumns<kSteps> x_col{t};
  // this thread's position at row half `half` of a tile: whether it is in the problem, and its x row
  auto position = [&](const Tile& at, int half, int64_t& pos, int64_t& x_offset) {
    pos = at.c0 + 16 * warp + 2 * g + half;
    x_offset = at.b * p.x_stride_b + at.r * p.x_stride_r + pos * p.x_stride_c;
    return at.r < space.r_end && pos < space.c_end;
  };
  auto load = [&](uint32_t tile, Raw<kSteps>& raw) {
    const Tile at(tile, space);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int64_t pos, x_offset;
      const bool ok = position(at, half, pos, x_offset);
      raw.m[half] = !ok     ? 0
                    : p.mask ? load_bits(p.mask, p.mask_dtype,
                                         at.b * p.mask_stride_b + at.r * p.mask_stride_r + pos * p.mask_stride_c)
                             : 1;
      const T* row = x + x_offset;
#pragma unroll
      for (int u = 0; u < kPairs; ++u) {
        const uint4 v = ok && x_col(2 * u, 0) < P ? load_x16(row + x_col(2 * u, 0)) : make_uint4(0, 0, 0, 0);
        raw.x[half][2 * u][0] = v.x, raw.x[half][2 * u][1] = v.y;
        raw.x[half][2 * u + 1][0] = v.z, raw.x[half][2 * u + 1][1] = v.w;
      }
      if constexpr (kSteps % 2 == 1) {
        const uint2 v = ok && x_col(kSteps - 1, 0) < P ? load_x8(row + x_col(kSteps - 1, 0)) : make_uint2(0, 0);
        raw.x[half][kSteps - 1][0] = v.x, raw.x[half][kSteps - 1][1] = v.y;
      }
    }
  };

  // LayerNorm of the thread's two rows into the A fragment: a[s] = {row g: 2t.., row g + 8:
  // 2t.., row g: 2t + 8.., row g + 8: 2t + 8..}, zero rows where the mask is 0; st[half]: the
  // row's (mean, rstd). The forward's fragment is (x - mean) rstd and 1 at the bias columns (the
  // affine is in its w_in), the backward's (x - mean) rstd gamma + beta.
  // (kBack: xn_row[half], the row of xn for that position or nullptr, takes the normalized row;
  // the forward: stats_at[half], nullptr or where that position's (mean, rstd) go)
  auto layer_norm = [&](const Raw<kSteps>& raw, const float (&m)[2], T* const (&xn_row)[2],
                        float* const (&stats_at)[2], uint32_t (&a)[kSteps][4], float2 (&st)[2]) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float v[kSteps][4];
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int piece = 0; piece < 2; ++piece) {
          const float2 f = Vec2<T>::unpack(*reinterpret_cast<const typename Vec2<T>::type*>(&raw.x[half][s][piece]));
          v[s][2 * piece] = f.x, v[s][2 * piece + 1] = f.y;
        }
      const float2 stats =
          kRange ? make_float2(0.f, 1.f)
                       : fragment_row_stats(v, 1.f / static_cast<float>(P), p.eps, typename PairedColumns<kSteps>::In{x_col, P});
      const float mean = stats.x, rs = stats.y;
      st[half] = stats;
      if constexpr (!kBack)
        if (stats_at[half] != nullptr && t == half) *reinterpret_cast<float2*>(stats_at[half]) = make_float2(mean, rs);
      const bool active = m[half] != 0.f;
#pragma unroll
      for (int s = 0; s < kSteps; ++s)
#pragma unroll
        for (int piece = 0; piece < 2; ++piece) {
          const int col = x_col(s, piece);  // (even, and P too: a piece is x's, the biases' or padding)
          float o0, o1;
          if constexpr (kBack) {
            const float2 gm = *reinterpret_cast<const float2*>(gamma + col);
            const float2 bt = *reinterpret_cast<const float2*>(beta + col);
            o0 = (v[s][2 * piece] - mean) * rs * gm.x + bt.x;
            o1 = (v[s][2 * piece + 1] - mean) * rs * gm.y + bt.y;
          } else if (col < P) {
            o0 = (v[s][2 * piece] - mean) * rs;
            o1 = (v[s][2 * piece + 1] - mean) * rs;
          } else {
            o0 = o1 = col == P ? 1.f : 0.f;
          }
          const typename Vec2<T>::type h = Vec2<T>::pack(o0, o1);
          a[s][half + 2 * piece] = active ? *reinterpret_cast<const uint32_t*>(&h) : 0u;
        }
      if constexpr (kBack)
        if (xn_row[half] != nullptr) {  // the normalized row, in x's column order: as it was loaded
#pragma unroll
          for (int u = 0; u < kPairs; ++u)
            if (x_col(2 * u, 0) < P)
              *reinterpret_cast<uint4*>(xn_row[half] + x_col(2 * u, 0)) =
                  make_uint4(a[2 * u][half], a[2 * u][half + 2], a[2 * u + 1][half], a[2 * u + 1][half + 2]);
          if constexpr (kSteps % 2 == 1)
            if (x_col(kSteps - 1, 0) < P)
              *reinterpret_cast<uint2*>(xn_row[half] + x_col(kSteps - 1, 0)) =
                  make_uint2(a[kSteps - 1][half], a[kSteps - 1][half + 2]);
        }
    }
  };

  const uint32_t w_addr = smem_addr(w), group_bytes = 8 * kin * sizeof(T);
  // (after one wgmma_fence for both chains of a pair: a second fence makes ptxas wait for the first)
  auto products = [&](int ch, const uint32_t (&a)[kSteps][4], float (&acc)[16][4]) {
    const uint64_t desc = wgmma_desc(w_addr + ch * chunk_elems * static_cast<uint32_t>(sizeof(T)), group_bytes);
    wgmma_chain_rs<T, kSteps>(acc, a, desc);
    wgmma_commit();
  };

  // The forward: chunk ch's accumulators, gated, into staging tile `buffer` (a's box, then
  // b's), then out to a and b by two tensor-map copies. Accumulator j of thread t is channel
  // j % 2 (a or b) of the chunk's hidden unit 8 (j / 4) + 2 t + (j / 2) % 2 (the folded w_in's
  // row order, staged_in_row), at positions 16 w + 2 g and + 1: one 4-byte store into row 2 t
  // (+ 1) of eight, whose swizzle puts the 32 lanes in 32 banks.
  const uint32_t stage_boxes = smem_addr(smem + L.stage) + wg * kStageBuffers * 2 * kBoxBytes;
  auto box = [&](int buffer, int ab) { return stage_boxes + (2 * buffer + ab) * static_cast<uint32_t>(kBoxBytes); };
  auto stage_gated = [&](const float (&acc)[16][4], const float (&m)[2], auto scale, int buffer) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      float even, odd;
      if constexpr (kRange && decltype(scale)::value)
        even = gated_half_scale(acc[j][0], acc[j][1] * gate_unscale),
        odd = gated_half_scale(acc[j][2], acc[j][3] * gate_unscale);
      else
        even = gated_half_scale(acc[j][0], acc[j][1]), odd = gated_half_scale(acc[j][2], acc[j][3]);
      if constexpr (decltype(scale)::value) even *= m[0], odd *= m[1];
      const auto pair = Vec2<T>::pack(even, odd);
      sts32(box(buffer, j % 2) + swizzled(staged_unit(j, t), 16 * warp + 2 * g),
            *reinterpret_cast<const uint32_t*>(&pair));
    }
  };
  // (each thread once it has staged its part) Out by the warpgroup's first thread, whose bulk
  // groups have read the other buffer first (the next chunk's staging); the maps leave out what
  // is past Npad and H.
  struct TileAt {
    int32_t b, r, c0;
    bool valid;  // (a tile of the launch)
  };
  auto copy_out = [&](const TileAt& at, int ch, int buffer) {
    fence_proxy_async_shared();  // the staging, for the stores' reads
    if (wg_tid == 0) bulk_wait_read();
    warpgroup_barrier(wg);
    if (wg_tid != 0 || !at.valid) return;
    tma_store_4d(&launch.a_map, at.c0, ch * kChunkUnits, at.r, at.b, box(buffer, 0));
    tma_store_4d(&launch.b_map, at.c0, ch * kChunkUnits, at.r, at.b, box(buffer, 1));
    bulk_commit();
  };

  // The backward: chunk ch's da and db tiles into staging tile `buffer`, channel row 4 j + t of
  // the chunk (= 2 hidden + {0: a, 1: b}) at kStageLd (w_in_plain's natural row order), 16-byte
  // piece q of rows srow0 + 16 i, i.e. hidden unit 32 ch + srow0 / 2 + 8 i of da (srow0 even) or
  // db (left in flight, one cp.async group); pieces past Npad and units past H are not read.
  T* const stages = reinterpret_cast<T*>(smem + L.stage) + wg * kStageBuffers * kChunkChannels * kStageLd;
  const int64_t plane = p.Npad * p.Npad;
  const int q = wg_tid % 8, srow0 = wg_tid / 8;
  constexpr int kCopyRounds = kChunkChannels * 8 / 128;
  const int w_rows = 4 * static_cast<int>(p.H);
  auto copy_in = [&](const Tile& at, int ch, int buffer) {
    if constexpr (kBack) {
      T* stage = stages + buffer * kChunkChannels * kStageLd;
      const int h_left = static_cast<int>(p.H) - ch * (kChunkChannels / 2) - srow0 / 2;
      if (at.c0 + 8 * q < p.Npad) {
        const T* in = static_cast<const T*>(srow0 % 2 ? args.db : args.da) + (at.b * p.H + srow0 / 2) * plane +
                      at.r * p.Npad + at.c0 + 8 * q + ch * (kChunkChannels / 2) * plane;
#pragma unroll
        for (int i = 0; i < kCopyRounds; ++i) {
          if (8 * i >= h_left) break;
          cp_async16(stage + (srow0 + 16 * i) * kStageLd + 8 * q, in + 8 * i * plane);
        }
      }
      cp_async_commit();
    }
  };
  // The backward's epilogue of chunk ch: accumulator (j, 2 half + e) is (projection, gate) e
  // of chunk column 8 j + 2 t at the thread's position `half`, times kOperandScale; its d (da
  // or db) is in the staging tile where the forward puts the gated value. dpre to the
  // positions' rows (dpre_row, nullptr past the chunk), the column sums into the warp's row.
  // kFinish: dpre also into dfrag, the A fragment of du's chain (accumulator blocks 2s and
  // 2s + 1 are k16 step s's pieces), the sums in two halves of the columns (fewer registers
  // live next to du's accumulator), and the rows take dpre times the position's rstd (rs).
  constexpr int kDuSteps = kChunkRows / 16;  // du's chain: k16 steps over a chunk's columns
  auto back_epilogue = [&](T* const (&dpre_row)[2], int ch, const float (&acc)[16][4], const float (&m)[2],
                           int buffer, uint32_t (&dfrag)[kDuSteps][4], const float (&rs)[2]) {
    if constexpr (kBack) {
      constexpr float kUnscale = 1.f / kOperandScale;
      constexpr int kParts = kFinish ? 2 : 1, kJ = 16 / kParts;
      const T* st = stages + buffer * kChunkChannels * kStageLd + t * kStageLd + 16 * warp + 2 * g;
      float* sums = colsum + (wg * 4 + warp) * cols;
#pragma unroll
      for (int part_i = 0; part_i < kParts; ++part_i) {
        float part[2 * kJ];  // part[2 jj + e]: the thread's two positions' (dp, dg) of column 8 j + 2 t + e
#pragma unroll
        for (int jj = 0; jj < kJ; ++jj) {
          const int j = part_i * kJ + jj, col = ch * kChunkRows + 8 * j + 2 * t;
          const bool col_ok = col < w_rows;
          const float2 d = Vec2<T>::unpack(*reinterpret_cast<const typename Vec2<T>::type*>(st + 4 * j * kStageLd));
          part[2 * jj] = part[2 * jj + 1] = 0.f;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float mm = col_ok ? m[half] : 0.f;
            const float dd = mm == 0.f ? 0.f : (half ? d.y : d.x) * mm;  // (stale staging past N or H: not read)
            const float pj = acc[j][2 * half] * kUnscale;
            // (kFinish: sigmoid_pair_from_complement, whose s is absolute-accurate only: with
            // sigmoid_pair ptxas spills 4 bytes in the bf16 kernel at P = 128)
            const float gacc = acc[j][2 * half + 1];
            const SigmoidPair sig =
                kFinish ? sigmoid_pair_from_complement(gacc, kUnscale) : sigmoid_pair(gacc * kUnscale);
            const float dp = dd * sig.s, dg = dp * pj * sig.one_minus_s;
            part[2 * jj] += dp, part[2 * jj + 1] += dg;
            if (col_ok && dpre_row[half] != nullptr) {
              if constexpr (kFinish) store2(dpre_row[half] + col, dp * rs[half], dg * rs[half]);
              else store2(dpre_row[half] + col, dp, dg);
            }
            if constexpr (kFinish) dfrag[j / 2][2 * (j % 2) + half] = pack_reg<T>(dp, dg);
          }
        }
        // over the warp's 8 row groups g (lanes t, t + 4, ...), reduce-scattered in a fixed order:
        // lane (g, t) adds entries first .. first + 2 kJ / 8 - 1, columns 8 j + 2 t + e of adjacent j
        column_sums_scatter(part);
        const int first = scatter_first<2 * kJ>(g);
#pragma unroll
        for (int e = 0; e < 2 * kJ / 8; ++e) {
          const int col = ch * kChunkRows + 8 * (part_i * kJ + (first + e) / 2) + 2 * t + (first + e) % 2;
          if (col < w_rows) sums[col] += part[e];
        }
      }
    }
  };

  // kBack: the natural rows of this thread's positions in a tile (InputBackParams: n = (b - b0)
  // (hi - lo) N + ...), in xn (none for kFinish) and dpre; nullptr past the chunk
  auto natural_rows = [&](const Tile& at, T* (&xn_row)[2], T* (&dpre_row)[2]) {
    if constexpr (kBack) {
      const int64_t lines = (at.b - args.b0) * (args.hi - args.lo);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t pos = at.c0 + 16 * warp + 2 * g + half;
        if (pos >= space.c_end) continue;
        const int64_t n = args.incoming ? (lines + pos - args.lo) * p.N + at.r : (lines + at.r - args.lo) * p.N + pos;
        if constexpr (!kFinish) xn_row[half] = static_cast<T*>(args.xn) + n * P;
        dpre_row[half] = static_cast<T*>(args.dpre) + n * w_rows;
      }
    }
  };

  // kFinish, a tile after its LayerNorm: the four chunks on one accumulator set, chunk ch + 1's
  // da and db copied in under chunk ch's epilogue and chains; each epilogue's dpre goes as an A
  // fragment into du's chain (du += dpre_ch W_ch: the resident chunk read N-major, its first 128
  // columns, x's), issued with the next chunk's products. Then LayerNorm's gradient on du's
  // accumulator, whose element (j, 2 half + e) is x column
  // PairedColumns (j / 2, j % 2) + e of the thread's row `half`: x's row and dx's (the residual)
  // come again in the 16-byte pieces of `load`, and dx leaves in them. `next`: the tile whose x
  // goes into L2 meanwhile (its loads into registers under these chains spill).
  auto finish_tile = [&](uint32_t tile, const uint32_t (&a)[kSteps][4], const float2 (&xst)[2], const float (&m)[2],
                         uint32_t next) {
    if constexpr (kFinish) {
      constexpr int kLnPairs = kFinishP / 32;  // 16-byte pieces of a row a thread holds
      constexpr uint32_t kGroupBytes = 8 * kin * sizeof(T);
      float acc[16][4], du[16][4];
      uint32_t dfrag[kDuSteps][4];  // the last chunk's dpre; zeros before the first
#pragma unroll
      for (int s = 0; s < kDuSteps; ++s) dfrag[s][0] = dfrag[s][1] = dfrag[s][2] = dfrag[s][3] = 0u;
      // du += dfrag W_ch (du = with `first`)
      auto du_chain = [&](int ch, bool first) {
        wgmma_chain_rs<T, kDuSteps, true, kGroupBytes>(
            du, dfrag, wgmma_desc_n_major(w_addr + ch * chunk_elems * static_cast<uint32_t>(sizeof(T)), kGroupBytes),
            !first);
      };
      {  // into L2: the residual's rows (dx) for the end of the tile, the next tile's x for its start
        // (lines of the thread's 16-byte pieces: columns x_col(0, 0) + 32 u)
        const Tile at(tile, space), at_next(next, space);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          int64_t pos, x_offset;
          if (position(at, half, pos, x_offset)) {
            const T* r = static_cast<const T*>(args.dx) + x_offset + x_col(0, 0);
            prefetch_l2(r);
            prefetch_l2(r + 3 * 32);
          }
          if (next < tiles && position(at_next, half, pos, x_offset)) {
            prefetch_l2(x + x_offset + x_col(0, 0));
            prefetch_l2(x + x_offset + x_col(0, 0) + 3 * 32);
          }
        }
      }
      warpgroup_barrier(wg);  // every warp done with the last tile's staging tiles
      copy_in(Tile(tile, space), 0, 0);
      // Per chunk: du's chain for the last chunk's dpre, the chunk's products, both waited for
      // within the iteration (a chain in flight across the loop's back edge makes ptxas wait
      // after every wgmma), then the epilogue. Rolled: four epilogues straight-line missed the
      // instruction cache (68 % of the stall samples, 3.4x the time).
#pragma unroll 1
      for (int ch = 0; ch < kRollingChunks; ++ch) {
        wgmma_fence();
        du_chain(max(ch - 1, 0), ch == 0);
        products(ch, a, acc);
        wgmma_wait<0>(acc);
        cp_async_wait<0>();
        warpgroup_barrier(wg);  // chunk ch's tiles complete; every warp past chunk ch - 1's epilogue
        const Tile at(tile + opaque_zero(), space);  // (recomputed, not held: registers)
        if (ch + 1 < kRollingChunks) copy_in(at, ch + 1, (ch + 1) % 2);
        T* xn_row[2] = {nullptr, nullptr};
        T* dpre_row[2] = {nullptr, nullptr};
        natural_rows(at, xn_row, dpre_row);
        const float rs[2] = {xst[0].y, xst[1].y};
        back_epilogue(dpre_row, ch, acc, m, ch % 2, dfrag, rs);
      }
      wgmma_fence();
      du_chain(kRollingChunks - 1, false);
      wgmma_commit();
      // x and (before LayerNorm) the residual at this thread's rows once du is complete (loaded
      // under the last chain, next to its registers, they spill), from L2 (prefetched as the tile
      // began)
      uint32_t xr[2][kLnPairs][4], res[2][kLnPairs][4];
      // dx's rows: the two positions are adjacent in the tile's row (x_stride_c apart)
      T* dx_row = static_cast<T*>(args.dx);
      bool dx_ok[2];
      const T* const dx_in = static_cast<const T*>(args.dx);
      const Tile at(tile + opaque_zero(), space);
      wgmma_wait<0>(du);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        int64_t pos, x_offset;
        const bool ok = position(at, half, pos, x_offset);
        dx_ok[half] = ok;
        if (half == 0) dx_row += x_offset;
        // (one base per row, the pieces 32 columns apart: immediate offsets, not 16 addresses)
        const uint4* const x_at = reinterpret_cast<const uint4*>(x + x_offset + x_col(0, 0));
        const uint4* const r_at = reinterpret_cast<const uint4*>(dx_in + x_offset + x_col(0, 0));
        const bool load_r = ok && args.residual_before;
#pragma unroll
        for (int u = 0; u < kLnPairs; ++u) {
          const uint4 v = ok ? __ldg(x_at + 4 * u) : make_uint4(0, 0, 0, 0);
          const uint4 r = load_r ? __ldg(r_at + 4 * u) : make_uint4(0, 0, 0, 0);
          xr[half][u][0] = v.x, xr[half][u][1] = v.y, xr[half][u][2] = v.z, xr[half][u][3] = v.w;
          res[half][u][0] = r.x, res[half][u][1] = r.y, res[half][u][2] = r.z, res[half][u][3] = r.w;
        }
      }
      // g = du (+ the residual), in place; per row the means of g gamma and g gamma xhat; the
      // column sums of g, then (below) of g xhat, each reduce-scattered over the lanes g as
      // dpre's (sums[c]: column x_col(2u, 0) + c) into the warp's row after dpre's in_rows
      constexpr float kUnscale = 1.f / kOperandScale;
      const bool before = args.residual_before;
      const float inv_p = 1.f / static_cast<float>(P);
      float* const row_sums = colsum + (wg * 4 + warp) * cols + in_rows;
      auto add_sums = [&](float (&sums)[8], int u, int kind) {
        column_sums_scatter(sums);
        row_sums[kind * P + x_col(2 * u, 0) + scatter_first<8>(g)] += sums[0];
      };
      float s1[2][2] = {}, s2[2][2] = {};  // [half][two interleaved parts]
#pragma unroll
      for (int u = 0; u < kLnPairs; ++u) {
        float sums[8];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float mu = xst[half].x, rs = xst[half].y;
#pragma unroll
          for (int q = 0; q < 4; ++q) {  // piece q: x columns x_col(2u, 0) + 2q, + 1; du's block 4u + q
            float* const d = &du[4 * u + q][2 * half];
            const float2 xv = unpack_reg<T>(xr[half][u][q]), rv = unpack_reg<T>(res[half][u][q]);
            const float2 gm = load2(gamma + x_col(2 * u, 0) + 2 * q);
            d[0] = d[0] * kUnscale + (before ? rv.x : 0.f);
            d[1] = d[1] * kUnscale + (before ? rv.y : 0.f);
            const float e0 = d[0] * gm.x, e1 = d[1] * gm.y;
            s1[half][q % 2] += e0 + e1;
            s2[half][q % 2] += e0 * ((xv.x - mu) * rs) + e1 * ((xv.y - mu) * rs);
            if (half == 0) sums[2 * q] = d[0], sums[2 * q + 1] = d[1];
            else sums[2 * q] += d[0], sums[2 * q + 1] += d[1];
          }
        }
        add_sums(sums, u, 1);
      }
      float mean1[2], mean2[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float a1 = s1[half][0] + s1[half][1], a2 = s2[half][0] + s2[half][1];
        quad_sums(a1, a2);
        mean1[half] = a1 * inv_p, mean2[half] = a2 * inv_p;
      }
      // x unpacked again in the second pass: ptxas would hold the first pass's 64 floats of it
      // (an empty asm makes the packed registers new values)
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int u = 0; u < kLnPairs; ++u)
#pragma unroll
          for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(xr[half][u][q]));
      // dx = rstd (g gamma - mean1 - xhat mean2) (+ the residual), per 16-byte piece
#pragma unroll
      for (int u = 0; u < kLnPairs; ++u) {
        float sums[8];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float mu = xst[half].x, rs = xst[half].y;
          T* const dx_at = dx_row + half * p.x_stride_c + x_col(2 * u, 0);
          // the residual after LayerNorm: loaded here (from L2, prefetched), not held through the
          // first pass
          const uint4 r4 = !before && dx_ok[half] ? load_x16(dx_at) : make_uint4(0, 0, 0, 0);
          const uint32_t r[4] = {r4.x, r4.y, r4.z, r4.w};
          uint32_t o[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float* const d = &du[4 * u + q][2 * half];
            const float2 xv = unpack_reg<T>(xr[half][u][q]), rv = unpack_reg<T>(r[q]);
            const float2 gm = load2(gamma + x_col(2 * u, 0) + 2 * q);
            const float xh0 = (xv.x - mu) * rs, xh1 = (xv.y - mu) * rs;
            const float dx0 = rs * (d[0] * gm.x - mean1[half] - xh0 * mean2[half]) + (before ? 0.f : rv.x);
            const float dx1 = rs * (d[1] * gm.y - mean1[half] - xh1 * mean2[half]) + (before ? 0.f : rv.y);
            o[q] = pack_reg<T>(dx0, dx1);
            if (half == 0) sums[2 * q] = d[0] * xh0, sums[2 * q + 1] = d[1] * xh1;
            else sums[2 * q] += d[0] * xh0, sums[2 * q + 1] += d[1] * xh1;
          }
          if (dx_ok[half]) *reinterpret_cast<uint4*>(dx_at) = make_uint4(o[0], o[1], o[2], o[3]);
        }
        add_sums(sums, u, 0);
      }
    }
  };

  uint32_t tile = blockIdx.x * kWarpgroups + wg;
  Raw<kSteps> raw;
  if (!kFinish && tile < tiles) load(tile, raw);
  int buffer = 0;

  // A tile's start: its LayerNorm into the A fragment (and x_stats), then the next tile's loads
  // issued; what its epilogues need of it in `to`.
  struct TileOut {
    TileAt at;    // where its copies go
    bool scale;   // a mask other than 0 / 1 scales the gated values (0 / 1 acts through the zero rows),
                  // or (kRange) the gate rows' scale is to be undone
    float m[2];
  };
  // the loaded mask's raw bits (the thread's two positions) as values
  auto mask_values = [&](float (&m)[2]) {
    m[0] = p.mask ? value_of_bits(raw.m[0], p.mask_dtype) : static_cast<float>(raw.m[0]);
    m[1] = p.mask ? value_of_bits(raw.m[1], p.mask_dtype) : static_cast<float>(raw.m[1]);
    if constexpr (kRange) m[0] *= mask_scale, m[1] *= mask_scale;
  };
  auto begin_tile = [&](uint32_t t_at, uint32_t (&a)[kSteps][4], TileOut& to) {
    const Tile at(t_at, space);
    mask_values(to.m);
    // where this thread's positions' LayerNorm statistics go (x_stats), nullptr past N
    float* stats_at[2] = {nullptr, nullptr};
    if (p.x_stats != nullptr)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t pos = at.c0 + 16 * warp + 2 * g + half;
        if (at.r < space.r_end && pos < space.c_end)
          stats_at[half] = p.x_stats + 2 * (at.b * p.N * p.N + at.r * p.stats_stride_r + pos * p.stats_stride_c);
      }
    T* const no_rows[2] = {nullptr, nullptr};
    float2 xst[2];
    layer_norm(raw, to.m, no_rows, stats_at, a, xst);
    to.at = {at.b, at.r, at.c0, true};
    to.scale = !__all_sync(0xffffffffu, (to.m[0] == 0.f || to.m[0] == 1.f) && (to.m[1] == 0.f || to.m[1] == 1.f)) ||
               (kRange && gate_unscale != 1.f);
    if (t_at + tile_step < tiles) load(t_at + tile_step, raw);  // in flight under the products
  };
  // Chunk ch's epilogue in two steps: its gated values into the staging tile, then (every warp's
  // there) out to a and b. The staging tiles alternate.
  auto stage_of = [&](const TileOut& to, const float (&acc)[16][4]) {
    if (to.scale)
      stage_gated(acc, to.m, std::true_type{}, buffer);
    else
      stage_gated(acc, to.m, std::false_type{}, buffer);
  };
  auto copy_of = [&](const TileOut& to, int ch) {
    copy_out(to.at, ch, buffer);
    buffer ^= 1;
  };
  auto gate_of = [&](const TileOut& to, int ch, const float (&acc)[16][4]) {
    stage_of(to, acc);
    copy_of(to, ch);
  };

  if constexpr (!kBack)
    if (chunks == kRollingChunks) {
      // The forward's four chunks straight-line, each chain's epilogue under the next chain (the
      // two accumulator sets in turn), and across tiles: the last chunk's values go into their
      // staging tile before the next tile's LayerNorm and out under that tile's first chain. No
      // chain is in flight where the loop branches (ptxas would wait for it there).
      if (tile >= tiles) return;  // (nothing to copy out)
      uint32_t a[kSteps][4];
      float acc0[16][4], acc1[16][4];
      // with chunk 0's chain in flight: chunk 1's issued, chunks 0 .. 2 gated and out, chunk 3's
      // chain done (its accumulators in acc1)
      auto chunks_1_to_3 = [&](const TileOut& to) {
        products(1, a, acc1);
        wgmma_wait<1>(acc0);
        gate_of(to, 0, acc0);
        wgmma_fence();
        products(2, a, acc0);
        wgmma_wait<1>(acc1);
        gate_of(to, 1, acc1);
        wgmma_fence();
        products(3, a, acc1);
        wgmma_wait<1>(acc0);
        gate_of(to, 2, acc0);
        wgmma_wait<0>(acc1);
      };
      // Per tile: LayerNorm, chain 0 issued, the last tile's chunk 3 out (the first time round
      // only the barrier), chunks 0 .. 2, chunk 3 staged.
      TileOut last{{0, 0, 0, false}, false, {0.f, 0.f}};
      for (; tile < tiles; tile += tile_step) {
        TileOut to;
        begin_tile(tile, a, to);  // (the last tile's chains are done)
        wgmma_fence();
        products(0, a, acc0);
        copy_of(last, 3);
        chunks_1_to_3(to);
        stage_of(to, acc1);
        last = to;
      }
      copy_of(last, 3);
      if (wg_tid == 0) bulk_wait_read();  // the last stores' reads before the block's shared memory goes
      return;
    }

  for (; tile < tiles; tile += tile_step) {
    const Tile at(tile, space);
    uint32_t a[kSteps][4];
    TileOut to;
    T* dpre_row[2] = {nullptr, nullptr};
    if constexpr (kBack) {
      if constexpr (kFinish) load(tile, raw);  // (prefetched into L2 by the last tile: finish_tile)
      mask_values(to.m);
      T* xn_row[2] = {nullptr, nullptr};
      natural_rows(at, xn_row, dpre_row);
      float* const no_stats[2] = {nullptr, nullptr};
      float2 xst[2];
      layer_norm(raw, to.m, xn_row, no_stats, a, xst);
      if constexpr (kFinish) {
        finish_tile(tile, a, xst, to.m, tile + tile_step);
        continue;
      }
      if (tile + tile_step < tiles) load(tile + tile_step, raw);  // in flight under the products
    } else {
      begin_tile(tile, a, to);
    }
    const float (&m)[2] = to.m;
    float acc0[16][4], acc1[16][4];
    // Chunks in pairs, the second chain under the first one's epilogue. No branch between the
    // chains and nothing in flight across iterations (ptxas would wait for the first chain
    // otherwise): an odd count runs the last chunk twice and drops the copy.
    for (int ch = 0; ch < chunks; ch += 2) {
      if constexpr (kBack) {
        // both staging tiles take this pair's da and db once every warp has read the last pair's
        warpgroup_barrier(wg);
        copy_in(at, ch, 0);
        copy_in(at, min(ch + 1, chunks - 1), 1);
      }
      wgmma_fence();
      products(ch, a, acc0);
      products(min(ch + 1, chunks - 1), a, acc1);
      if constexpr (kBack) {
        uint32_t unused[kDuSteps][4];  // (kFinish's)
        const float unscaled[2] = {1.f, 1.f};
        wgmma_wait<1>(acc0);
        cp_async_wait<1>();
        warpgroup_barrier(wg);
        back_epilogue(dpre_row, ch, acc0, m, 0, unused, unscaled);
        wgmma_wait<0>(acc1);
        cp_async_wait<0>();
        warpgroup_barrier(wg);
        if (ch + 1 < chunks) back_epilogue(dpre_row, ch + 1, acc1, m, 1, unused, unscaled);
        continue;
      }
      wgmma_wait<1>(acc0);
      gate_of(to, ch, acc0);
      wgmma_wait<0>(acc1);
      if (ch + 1 < chunks) gate_of(to, ch + 1, acc1);
    }
  }
  if constexpr (!kBack)
    if (wg_tid == 0) bulk_wait_read();  // the last stores' reads before the block's shared memory goes
  if constexpr (kBack) {  // each warpgroup's row of partial sums: its warps' rows in order
    __syncthreads();
    // dpre's 4H columns, then (kFinish) LayerNorm's 2P
    const int row = w_rows + cols - in_rows;
    float* part = args.partial + static_cast<int64_t>(blockIdx.x) * kWarpgroups * row;
    for (int c = threadIdx.x; c < kWarpgroups * row; c += kBlockThreads) {
      const int group = c / row, col = c % row, at_col = col < w_rows ? col : col - w_rows + in_rows;
      float total = 0.f;
      for (int w = 0; w < 4; ++w) total += colsum[(group * 4 + w) * cols + at_col];
      part[c] = total;
    }
  }
#endif
}

// At most one block per SM, and no more blocks than pairs of tiles (two warpgroups each).
template <typename Params>
int64_t resident_grid(const Params& q) {
  return std::min<int64_t>(problem_of_host(q).resident_blocks, ceil_div(tile_count(q), kWarpgroups));
}

// The shapes the backward that finishes the stage takes: P = 128 with four chunks.
inline bool finishing_shape(const LnProjGateParams& p) {
  return p.P == kFinishP && p.op_layout.in_rows == kRollingChunks * kChunkRows;
}

// The forward's maps of a and b into its launch: boxes of a tile's 64 positions and a chunk's
// hidden units.
template <typename Params>
cudaError_t encode_maps(Resident<Params>& launch) {
  if constexpr (std::is_same<Params, LnProjGateParams>::value) {
    const LnProjGateParams& q = launch.args;
    const int64_t plane = q.Npad * q.Npad;
    for (int ab = 0; ab < 2; ++ab) {
      const cudaError_t e = encode_map_16bit(ab ? &launch.b_map : &launch.a_map, ab ? q.b : q.a,
                                             q.ab_dtype == DType::bf16, {q.Npad, q.H, q.Npad, q.B},
                                             {plane, q.Npad, q.H * plane}, {kTilePositions, kChunkUnits, 1, 1});
      if (e != cudaSuccess) return e;
    }
  }
  return cudaSuccess;
}

constexpr int kRangeMinP = 112;  // the kRange form for P above it (range_plan in trimul.cpp)
template <typename T, int kP, typename Params>
cudaError_t launch_p(const Params& q, cudaStream_t stream) {
  const LnProjGateParams& p = problem_of_host(q);
  constexpr bool kBack = std::is_same<Params, InputBackParams>::value;
  auto run = [&](auto kernel, bool finish) {
    const size_t smem =
        ResidentSmem::make(p.op_layout.kin, p.op_layout.in_rows, sum_cols(p.op_layout.in_rows, p.P, kBack, finish))
            .bytes;
    Resident<Params> launch{q, tile_space(q), {}, {}};
    const cudaError_t e = encode_maps(launch);
    return e != cudaSuccess ? e : launch_grid_rows(kernel, resident_grid(q), 1, kBlockThreads, smem, launch, stream);
  };
  if constexpr (kBack) {
    if (q.dx != nullptr && !finishing_shape(p)) return cudaErrorInvalidValue;
    if constexpr (kP == kFinishP)
      if (q.dx != nullptr) return run(ln_proj_gate_resident_kernel<T, kP, Params, true>, true);
  } else if (p.op_layout.range != nullptr) {  // (fp16, P where the output stage's resident form runs)
    if constexpr (std::is_same<T, __half>::value && kP > kRangeMinP)
      return run(ln_proj_gate_resident_kernel<T, kP, Params, false, true>, false);
    return cudaErrorInvalidValue;
  }
  return run(ln_proj_gate_resident_kernel<T, kP, Params, false>, false);
}

// P = 8 (i + 1) for i in kIs: the instantiation for the call's P
template <typename T, typename Params, int... kIs>
cudaError_t launch_for(const Params& q, cudaStream_t stream, std::integer_sequence<int, kIs...>) {
  const int64_t P = problem_of_host(q).P;
  cudaError_t e = cudaErrorInvalidValue;
  (void)((P == 8 * (kIs + 1) && (e = launch_p<T, 8 * (kIs + 1)>(q, stream), true)) || ...);
  return e;
}
constexpr int kMaxP = kMaxKin - 8;  // the widest P whose k16 steps fit kMaxSteps
using PChoices = std::make_integer_sequence<int, kMaxP / 8>;

template <typename Params>
cudaError_t launch_typed(const Params& q, cudaStream_t stream) {
  switch (problem_of_host(q).ab_dtype) {
    case DType::bf16: return launch_for<__nv_bfloat16>(q, stream, PChoices{});
    case DType::f16: return launch_for<__half>(q, stream, PChoices{});
    default: return cudaErrorInvalidValue;
  }
}

template <typename Params>
bool takes(const Params& q) {
  const LnProjGateParams& p = problem_of_host(q);
  // w_in as the form reads it: folded for the forward, the unfolded copy for the backward
  const bool w_in_ok = std::is_same<Params, InputBackParams>::value ? p.op_layout.w_in_plain >= 0 : p.op_layout.in_folded;
  return p.resident_blocks > 0 && p.op_layout.in_blocked && p.op_layout.in_k_paired && w_in_ok && p.x_dtype == p.ab_dtype &&
         p.x_rows_vec16 &&
         (p.ab_dtype == DType::bf16 || p.ab_dtype == DType::f16) && p.P % 8 == 0 && p.op_layout.kin <= kMaxKin &&
         tile_count(q) + p.resident_blocks * kWarpgroups < (int64_t{1} << 31);
}

}  // namespace

size_t ln_proj_gate_resident_smem(int64_t P, int64_t H) {  // the backward's, the larger
  const OperandLayout ol = operand_layout(P, H, 2, true, false);
  const bool finish = P == kFinishP && ol.in_rows == kRollingChunks * kChunkRows;  // (finishing_shape)
  return P % 8 == 0 && ol.kin <= kMaxKin ? ResidentSmem::make(ol.kin, ol.in_rows, sum_cols(ol.in_rows, P, true, finish)).bytes
                                         : SIZE_MAX;
}

bool ln_proj_gate_resident_takes(const LnProjGateParams& p) { return takes(p); }
cudaError_t launch_ln_proj_gate_resident(const LnProjGateParams& p, cudaStream_t stream) {
  return launch_typed(p, stream);
}

bool input_back_resident_takes(const InputBackParams& q) { return takes(q); }
bool input_back_finishes(const InputBackParams& q) { return takes(q) && finishing_shape(q.in); }
int64_t input_back_resident_rows(const InputBackParams& q) { return resident_grid(q) * kWarpgroups; }
cudaError_t launch_input_back_resident(const InputBackParams& q, cudaStream_t stream) {
  return launch_typed(q, stream);
}

}  // namespace trimul
