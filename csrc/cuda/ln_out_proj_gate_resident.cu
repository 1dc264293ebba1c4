// ln_out_proj_gate with its weights resident (sm_90a, 16-bit operands, x in their
// type, P and H in (112, 128], multiples of 8): what ln_out_proj_gate_mma.cu
// computes at 16 bits, by persistent blocks that copy w_out and w_gate (each
// padded to 128 x 128, in wgmma's core-matrix layout) and the folds into shared
// memory once and then walk tiles of 64 positions j of one (b, i), each
// warpgroup on its own tiles with no block-wide barrier:
//
//   1. The tile's c (h-major, [h][j] as the contraction leaves it) and x
//      ([j][p]) come by cp.async into one of two buffers, the next tile's while
//      the current one is computed.
//   2. Both A fragments from shared memory into registers by ldmatrix (c's
//      transposed), c's LayerNorm statistics over h and x's over p (gate from
//      the normalized input) from those registers (sums over the 4 lanes t).
//   3. Two m64n128k16 chains with A from registers: c . W'^T and x . W'g^T; then
//      per output channel pair the epilogue of the chunked kernel:
//      y = rstd (c . W'^T - mean s) + t, g likewise, out = y sigmoid(g) at half
//      scale (p + p tanh(g)), stored as channel pairs.
//
// Tile row r is position j0 + r; thread (g, t) of warp w holds rows 16 w + g
// and + 8.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "range.cuh"
#include "wgmma.cuh"

namespace trimul {
namespace {

constexpr int kWarpgroups = 2;
constexpr int kBlockThreads = 128 * kWarpgroups;
constexpr int kTilePositions = 64;                 // wgmma's m64
constexpr int kWidth = 128;                         // P and H, padded: the chains' n and k
constexpr int kSteps = kWidth / 16;                 // k16 steps per chain
constexpr int kWidthFloor = kWidth - 16;           // P, H taken above this: the padding wastes <= 8 of 128
constexpr int kLdc = kTilePositions + 8;            // c tile row (h) stride: 144 bytes
constexpr int kLdx = kWidth + 8;                    // x tile row (j) stride: 272 bytes
static_assert(kOperandRowTile == kWidth, "the packed output rows are padded to 128");

struct OutSmem {
  size_t wo, wg, folds, tiles, bytes;
  static constexpr size_t kCTile = 2 * kWidth * kLdc, kXTile = 2 * kTilePositions * kLdx;
  static constexpr size_t kBuffer = kCTile + kXTile;  // bytes of one (c, x) buffer
  __host__ __device__ static OutSmem make() {
    OutSmem s{};
    s.wo = 0;
    s.wg = s.wo + 2 * kWidth * kWidth;
    s.folds = s.wg + 2 * kWidth * kWidth;
    s.tiles = s.folds + sizeof(float) * kOutFolds * kWidth;
    s.bytes = s.tiles + kWarpgroups * 2 * kBuffer;
    return s;
  }
};

// O: the output's type, T (x's), or float for precision tf32 on the fp16 stages (op_layout.range,
// trimul.h: RangeScales: x is x normalized in fp16, c scaled, the output fp32 with its scale
// undone).
using OutLaunch = LineLaunch<LnOutProjGateParams, kTilePositions>;  // tiles along the lines b N + i

template <typename T, typename O>
__global__ void __launch_bounds__(kBlockThreads, 1) ln_out_proj_gate_resident_kernel(const OutLaunch launch, int64_t) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (elsewhere an empty body: plan() launches it on 9.0 only)
  static_assert(sizeof(T) == 2, "16-bit operands");
  constexpr bool kF32Out = std::is_same<O, float>::value;
  const LnOutProjGateParams& p = launch.p;
  extern __shared__ __align__(128) unsigned char smem[];
  const OutSmem L = OutSmem::make();
  T* wo = reinterpret_cast<T*>(smem + L.wo);
  T* wg = reinterpret_cast<T*>(smem + L.wg);
  float* folds = reinterpret_cast<float*>(smem + L.folds);  // s, t of w_out, then of w_gate: kWidth each
  const int P = static_cast<int>(p.P), H = static_cast<int>(p.H);
  const int kp = static_cast<int>(p.op_layout.kp), kh = static_cast<int>(p.op_layout.kh);

  // The weights once, from the pack's padded rows into the core-matrix layout, columns past
  // kh (kp) zero; the folds (kp entries each) with zeros past kp, their loads issued first and
  // together (each is a round trip the copies' issue then covers).
  {
    const float* fold = reinterpret_cast<const float*>(static_cast<const T*>(p.operands) + p.op_layout.out_fold);
    constexpr int kFoldsPerThread = kOutFolds * kWidth / kBlockThreads;
    static_assert(kOutFolds * kWidth % kBlockThreads == 0, "the folds in whole rounds of the block");
    float fold_v[kFoldsPerThread];
#pragma unroll
    for (int u = 0; u < kFoldsPerThread; ++u) {
      const int e = threadIdx.x + u * kBlockThreads, v = e / kWidth, k = e % kWidth;
      fold_v[u] = k < kp ? fold[v * kp + k] : 0.f;
    }
    const T* w_out = static_cast<const T*>(p.operands) + p.op_layout.w_out;
    const T* w_gate = static_cast<const T*>(p.operands) + p.op_layout.w_gate;
    const CoreBlockedAt<T> at{kWidth / 8};
    const int ldh = kh + static_cast<int>(p.op_layout.pad), ldp = kp + static_cast<int>(p.op_layout.pad);
    for (int e = threadIdx.x; e < 2 * kWidth * (kWidth / 8); e += kBlockThreads) {
      const bool gate = e >= kWidth * (kWidth / 8);
      const int r = (e % (kWidth * (kWidth / 8))) / (kWidth / 8), k = 8 * (e % (kWidth / 8));
      T* dst = (gate ? wg : wo) + at(r, k);
      if (k < (gate ? kp : kh))
        cp_async16(dst, (gate ? w_gate + r * ldp : w_out + r * ldh) + k);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kFoldsPerThread; ++u) folds[threadIdx.x + u * kBlockThreads] = fold_v[u];
  }
  const int wgi = threadIdx.x / 128, wg_tid = threadIdx.x % 128, warp = wg_tid / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  unsigned char* const buffers = smem + L.tiles + wgi * 2 * OutSmem::kBuffer;
  auto c_tile = [&](int buf) { return reinterpret_cast<T*>(buffers + buf * OutSmem::kBuffer); };
  auto x_tile = [&](int buf) { return reinterpret_cast<T*>(buffers + buf * OutSmem::kBuffer + OutSmem::kCTile); };
  // The tiles' padding, written once: c's rows h in [H, 128) and x's columns [P, 128) are zero
  // (the copies never touch them).
  for (int buf = 0; buf < 2; ++buf) {
    for (int e = wg_tid; e < (kWidth - H) * kTilePositions / 8; e += 128)
      *reinterpret_cast<uint4*>(c_tile(buf) + (H + e / (kTilePositions / 8)) * kLdc + 8 * (e % (kTilePositions / 8))) =
          make_uint4(0, 0, 0, 0);
    for (int e = wg_tid; e < kTilePositions * (kWidth - P) / 8; e += 128)
      *reinterpret_cast<uint4*>(x_tile(buf) + (e / ((kWidth - P) / 8)) * kLdx + P + 8 * (e % ((kWidth - P) / 8))) =
          make_uint4(0, 0, 0, 0);
  }
  cp_async_wait_all();
  fence_proxy_async_shared();  // the weights, for wgmma's reads
  __syncthreads();

  // Tiles in 32-bit arithmetic (takes(): B N ceil(N / 64) < 2^31).
  const LineTiles<kTilePositions>& space = launch.tiles;
  const uint32_t N = space.n(), Npad = static_cast<uint32_t>(p.Npad);
  const uint32_t tiles = static_cast<uint32_t>(p.B * p.N) * space.j_tiles(), tile_step = gridDim.x * kWarpgroups;
  const int64_t plane = p.Npad * p.Npad;
  // Tile `tile`'s c and x into buffer `buf` (one cp.async group): c's rows h < H, its pieces of
  // 8 positions below Npad (past it the rows are not stored); x's rows below N. (The copies'
  // address arithmetic spaces out their issue: issued back to back from precomputed addresses, the
  // stage took 10 % longer with 12 % fewer instructions, the memory pipe's queue full.)
  const T* x = static_cast<const T*>(p.x);
  auto load = [&](uint32_t tile, int buf) {
    const auto at = space.at(tile);
    const auto [b, i] = space.position(at.line);
    const T* c = static_cast<const T*>(p.c) + b * p.H * plane + static_cast<int64_t>(i) * Npad + at.j0;
    const uint32_t ct = smem_addr(c_tile(buf));
    constexpr int kPieces = kTilePositions / 8;  // 16-byte pieces of a c row, of an x row: kWidth / 8
#pragma unroll
    for (int k = 0; k < kWidth * kPieces / 128; ++k) {
      const int e = wg_tid + 128 * k, h = e / kPieces, q = e % kPieces;
      if (h < H && at.j0 + 8 * q < Npad) cp_async16(ct + (h * kLdc + 8 * q) * sizeof(T), c + h * plane + 8 * q);
    }
    const T* xr = x + b * p.x_stride_b + i * p.x_stride_i + at.j0 * p.x_stride_j;
    const uint32_t xs = smem_addr(x_tile(buf));
#pragma unroll
    for (int k = 0; k < kTilePositions * (kWidth / 8) / 128; ++k) {
      const int e = wg_tid + 128 * k, r = e / (kWidth / 8), q = e % (kWidth / 8);
      if (8 * q < P && at.j0 + r < N) cp_async16(xs + (r * kLdx + 8 * q) * sizeof(T), xr + r * p.x_stride_j + 8 * q);
    }
    cp_async_commit();
  };

  // ldmatrix addresses (mma.cuh's warp_mma): matrix m = lane / 8 of each x4 load
  const int m8 = lane / 8, r8 = lane % 8;
  const uint32_t c_lane = (((m8 / 2) * 8 + r8) * kLdc + 16 * warp + (m8 % 2) * 8) * sizeof(T);
  const uint32_t x_lane = ((16 * warp + (m8 % 2) * 8 + r8) * kLdx + (m8 / 2) * 8) * sizeof(T);
  const uint64_t desc_o = wgmma_desc(smem_addr(wo), 8 * kWidth * sizeof(T));
  const uint64_t desc_g = wgmma_desc(smem_addr(wg), 8 * kWidth * sizeof(T));
  const float* fold_s = folds;
  const float* fold_t = folds + kWidth;
  const float* gate_s = folds + 2 * kWidth;
  const float* gate_t = folds + 3 * kWidth;
  const float inv_h = 1.f / static_cast<float>(H), inv_p = 1.f / static_cast<float>(P);
  // precision tf32 on the fp16 stages: c arrives scaled by a power of two (RangeScales), which
  // its LayerNorm undoes but for eps
  const float eps_c = kF32Out ? range_c_eps(p.eps, *p.op_layout.range) : p.eps;
  // (an fp32 output: its scale 2^out_log2 undone)
  const float out_unscale = kF32Out ? ldexpf(1.f, -range_out_log2(*p.op_layout.range)) : 1.f;
  // The gate from the normalized input (its weights then carry the affine: gate_folded) takes x's
  // statistics from the input stage where it wrote them (x_stats), else computes them here.
  // Precision tf32 on the fp16 stages (kF32Out: the x tile holds xhat, RangeScales): the gate from
  // xhat takes 0 and 1 as xst starts, the gate from x range_normalize's (-mean rstd, 1 / rstd),
  // both with the gate weights' scale 2^gate_log2 undone in the second (range_normalize's
  // statistics come with it).
  const float* x_stats = p.gate_from_normalized || kF32Out ? p.x_stats : nullptr;
  const bool x_stats_here = p.gate_from_normalized && p.x_stats == nullptr && !kF32Out;
  const float gate_unscale = kF32Out ? range_gate_unscale(*p.op_layout.range) : 1.f;
  const float2 x_stats_start = make_float2(0.f, gate_unscale);

  uint32_t tile = blockIdx.x * kWarpgroups + wgi;
  if (tile < tiles) load(tile, 0);
  for (int buf = 0; tile < tiles; tile += tile_step, buf ^= 1) {
    const auto at = space.at(tile);
    cp_async_wait<0>();
    warpgroup_barrier(wgi);  // this tile's buffer complete; every warp past the last tile's reads
    uint32_t ac[kSteps][4], ax[kSteps][4];
    const uint32_t c_base = smem_addr(c_tile(buf)) + c_lane, x_base = smem_addr(x_tile(buf)) + x_lane;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      ldsm_x4_trans(ac[s], c_base + s * 16 * kLdc * sizeof(T));
      ldsm_x4(ax[s], x_base + s * 16 * sizeof(T));
    }
    const int valid = static_cast<int>(min(static_cast<uint32_t>(kTilePositions), N - at.j0));
    float2 cst[2], xst[2] = {x_stats_start, x_stats_start};
    if (x_stats != nullptr)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = 16 * warp + g + 8 * half;
        if (row < valid)
          xst[half] = *reinterpret_cast<const float2*>(x_stats + 2 * (static_cast<int64_t>(at.line) * N + at.j0 + row));
      }
    if (tile + tile_step < tiles) load(tile + tile_step, buf ^ 1);  // under this tile's work
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      cst[half] = fragment_row_stats<T>(ac, half, H, inv_h, eps_c);
      if (x_stats_here) xst[half] = fragment_row_stats<T>(ax, half, P, inv_p, p.eps);
    }
    float y[16][4], gt[16][4];
    wgmma_fence();
    wgmma_chain_rs<T, kSteps>(y, ac, desc_o);
    wgmma_chain_rs<T, kSteps>(gt, ax, desc_g);
    wgmma_commit();
    wgmma_wait<0>(y);
    wgmma_wait<0>(gt);
    // The epilogue without branches (stores predicated), so the 64 elements' chains interleave.
    // Out through the warp's own 16 rows of the x tile (read into ax above): channel pairs in
    // (columns below P: the zero padding stays), then whole rows out in 16-byte pieces (the
    // tile's rows are contiguous in out). An fp32 output takes the rows in two halves of 8 (a
    // float row spans two of the tile's rows).
    T* const stage = x_tile(buf) + 16 * warp * kLdx;
    // channels 8 j + 2 t and + 1 of row half `half` (0: g, 1: g + 8), gated, at half scale
    auto out_pair = [&](int j, int half, float2 so, float2 to, float2 sg, float2 tg) {
      const float mu = cst[half].x, rs = cst[half].y, xm = xst[half].x, xr = xst[half].y;
      const float y0 = fmaf(rs, fmaf(-mu, so.x, y[j][2 * half]), to.x);
      const float y1 = fmaf(rs, fmaf(-mu, so.y, y[j][2 * half + 1]), to.y);
      const float g0 = fmaf(xr, fmaf(-xm, sg.x, gt[j][2 * half]), tg.x);
      const float g1 = fmaf(xr, fmaf(-xm, sg.y, gt[j][2 * half + 1]), tg.y);
      return make_float2(gated_half_scale(y0, g0), gated_half_scale(y1, g1));
    };
    __syncwarp();  // every lane's ldmatrix reads of these rows before any lane's writes
    if constexpr (!kF32Out) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int ch = 8 * j + 2 * t;
        const float2 so = load2(fold_s + ch), to = load2(fold_t + ch), sg = load2(gate_s + ch), tg = load2(gate_t + ch);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float2 v = out_pair(j, half, so, to, sg, tg);
          const auto pair = Vec2<T>::pack(v.x, v.y);
          if (ch < P) *reinterpret_cast<typename Vec2<T>::type*>(stage + (g + 8 * half) * kLdx + ch) = pair;
        }
      }
      __syncwarp();
      T* const out = static_cast<T*>(p.out) + (static_cast<int64_t>(at.line) * p.N + at.j0 + 16 * warp) * p.P;
      const int rows_left = valid - 16 * warp;
      constexpr int kRowPieces = kWidth / 8;
#pragma unroll
      for (int k = 0; k < 16 * kRowPieces / 32; ++k) {
        const int e = lane + 32 * k, r = e / kRowPieces, q = e % kRowPieces;
        const uint4 piece = *reinterpret_cast<const uint4*>(stage + r * kLdx + 8 * q);
        if (r < rows_left && 8 * q < P) *reinterpret_cast<uint4*>(out + r * P + 8 * q) = piece;
      }
    } else {
      float* const stage_f = reinterpret_cast<float*>(stage);  // 8 rows of kLdx floats
      constexpr int kRowPieces = kWidth / 4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int ch = 8 * j + 2 * t;
          const float2 v = out_pair(j, half, load2(fold_s + ch), load2(fold_t + ch), load2(gate_s + ch), load2(gate_t + ch));
          if (ch < P) *reinterpret_cast<float2*>(stage_f + g * kLdx + ch) = make_float2(v.x * out_unscale, v.y * out_unscale);
        }
        __syncwarp();
        float* const out =
            static_cast<float*>(p.out) + (static_cast<int64_t>(at.line) * p.N + at.j0 + 16 * warp + 8 * half) * p.P;
#pragma unroll
        for (int k = 0; k < 8 * kRowPieces / 32; ++k) {
          const int e = lane + 32 * k, r = e / kRowPieces, q = e % kRowPieces;
          const float4 piece = *reinterpret_cast<const float4*>(stage_f + r * kLdx + 4 * q);
          if (r + 8 * half < valid - 16 * warp && 4 * q < P) *reinterpret_cast<float4*>(out + r * P + 4 * q) = piece;
        }
        __syncwarp();  // (the second half's writes after every lane's reads)
      }
    }
  }
#endif
}

template <typename T>
cudaError_t launch_typed(const LnOutProjGateParams& p, cudaStream_t stream) {
  const int64_t tiles = p.B * p.N * ceil_div(p.N, kTilePositions);
  const int64_t blocks = std::min<int64_t>(p.resident_blocks, ceil_div(tiles, kWarpgroups));
  if (p.op_layout.range != nullptr) {
    if constexpr (std::is_same<T, __half>::value)
      return launch_grid_rows(ln_out_proj_gate_resident_kernel<T, float>, blocks, 1, kBlockThreads,
                              OutSmem::make().bytes, OutLaunch(p), stream);
    return cudaErrorInvalidValue;
  }
  return launch_grid_rows(ln_out_proj_gate_resident_kernel<T, T>, blocks, 1, kBlockThreads, OutSmem::make().bytes,
                          OutLaunch(p), stream);
}

}  // namespace

bool ln_out_proj_gate_resident_takes(const LnOutProjGateParams& p) {
  const bool width_ok = p.P % 8 == 0 && p.H % 8 == 0 && p.P > kWidthFloor && p.H > kWidthFloor && p.P <= kWidth &&
                        p.H <= kWidth;
  const bool tiles_ok = p.B * p.N * ceil_div(p.N, kTilePositions) < (int64_t{1} << 31);  // (32-bit tile math)
  return p.resident_blocks > 0 && (p.c_dtype == DType::bf16 || p.c_dtype == DType::f16) &&
         p.x_dtype == p.c_dtype && p.x_rows_vec16 && width_ok && tiles_ok;
}

size_t ln_out_proj_gate_resident_smem() { return OutSmem::make().bytes; }

cudaError_t launch_ln_out_proj_gate_resident(const LnOutProjGateParams& p, cudaStream_t stream) {
  switch (p.c_dtype) {
    case DType::bf16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::f16: return launch_typed<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace trimul
