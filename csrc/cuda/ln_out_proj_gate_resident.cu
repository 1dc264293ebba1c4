// ln_out_proj_gate with its weights resident (sm_90a, 16-bit operands, x in their
// type, P and H in (112, 128], multiples of 8): what ln_out_proj_gate_mma.cu
// computes at 16 bits, by persistent blocks that copy w_out and w_gate (each
// padded to 128 x 128, in wgmma's core-matrix layout) and the folds into shared
// memory once and then walk tiles of 64 positions j of one (b, i), each
// warpgroup on its own tiles with no block-wide barrier:
//
//   1. The tile's c (h-major, [h][j] as the contraction leaves it) and x
//      ([j][p], two boxes of 64 channels) come by tensor-map copies (tma.cuh:
//      swizzled rows, zeros past H, P and N) into one of two buffers, the next
//      tile's while the current one is computed.
//   2. Both A fragments from shared memory into registers by ldmatrix (c's
//      transposed), c's LayerNorm statistics over h and x's over p (gate from
//      the normalized input) from those registers (sums over the 4 lanes t).
//   3. c . W'^T and x . W'g^T as chains with A from registers, in two halves of
//      the output channels (m64n64k16, a commit group each); then per output
//      channel pair the epilogue of the chunked kernel: y = rstd (c . W'^T -
//      mean s) + t, g likewise, out = y sigmoid(g) at half scale (p + p
//      tanh(g)), staged in the warp's own rows of the half's x box and stored
//      by a tensor-map copy a warp and half, the first half's under the second
//      half's products (an fp32 output: straight from the registers, after
//      both).
//
// Tile row r is position j0 + r; thread (g, t) of warp w holds rows 16 w + g
// and + 8.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "range.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace trimul {
namespace {

constexpr int kWarpgroups = 2;
constexpr int kBlockThreads = 128 * kWarpgroups;
constexpr int kTilePositions = 64;                 // wgmma's m64
constexpr int kWidth = 128;                         // P and H, padded: the chains' n and k
constexpr int kSteps = kWidth / 16;                 // k16 steps per chain
constexpr int kWidthFloor = kWidth - 16;           // P, H taken above this: the padding wastes <= 8 of 128
constexpr int kBoxWidth = kSwizzleRowBytes / 2;     // channels of an x or out box: 64
constexpr int kXBoxes = kWidth / kBoxWidth;         // x's and out's boxes across a row
constexpr int kStoreRows = 16;                      // a warp's rows of the tile: its output box
constexpr int kHalves = kXBoxes;                    // the chains' halves of n: one output box each
constexpr int kHalfJ = kBoxWidth / 8;               // accumulator blocks of a half (m64n64)
static_assert(kOperandRowTile == kWidth, "the packed output rows are padded to 128");
static_assert(kTilePositions == kBoxWidth, "a c row of the tile is one swizzled box row");

// Tiles first (1024-byte aligned, tma.cuh), then the weights, the folds and the buffers' barriers.
struct OutSmem {
  static constexpr size_t kCTile = 2 * kWidth * kTilePositions;  // [h][j]: 128 rows of 128 bytes
  static constexpr size_t kXBox = 2 * kTilePositions * kBoxWidth;  // [j][64 channels]
  static constexpr size_t kBuffer = kCTile + kXBoxes * kXBox;      // bytes of one (c, x) buffer
  static constexpr size_t kTiles = 0;
  static constexpr size_t kWo = kTiles + kWarpgroups * 2 * kBuffer;
  static constexpr size_t kWg = kWo + 2 * kWidth * kWidth;
  static constexpr size_t kFolds = kWg + 2 * kWidth * kWidth;
  static constexpr size_t kBars = kFolds + sizeof(float) * kOutFolds * kWidth;
  // (the dynamic window's start aligned up to the swizzle's period at run time)
  static constexpr size_t kBytes = kBars + sizeof(uint64_t) * kWarpgroups * 2 + kSwizzleBlockBytes;
  static_assert(kCTile % kSwizzleBlockBytes == 0 && kXBox % kSwizzleBlockBytes == 0, "tiles keep the alignment");
};

// O: the output's type, T (x's), or float for precision tf32 on the fp16 stages (op_layout.range,
// trimul.h: RangeScales: x is x normalized in fp16, c scaled, the output fp32 with its scale
// undone).
// A launch's arguments: the stage's, its tiles along the lines b N + i, and the tensor maps of c
// ([B][H][Npad][Npad]: a tile's box 64 j x 1 x 128 h), x ([B][N][N][P] with x's strides: 64
// channels x 64 j) and the output ([B][N][N][P]: 64 channels x a warp's 16 rows; not for an fp32
// output). Passed as a __grid_constant__ so that the maps' addresses are the parameters'.
struct OutLaunch {
  LnOutProjGateParams p;
  LineTiles<kTilePositions> tiles;
  CUtensorMap c_map, x_map, out_map;
};

template <typename T, typename O>
__global__ void __launch_bounds__(kBlockThreads, 1) ln_out_proj_gate_resident_kernel(const __grid_constant__ OutLaunch launch, int64_t) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (elsewhere an empty body: plan() launches it on 9.0 only)
  static_assert(sizeof(T) == 2, "16-bit operands");
  constexpr bool kF32Out = std::is_same<O, float>::value;
  const LnOutProjGateParams& p = launch.p;
  extern __shared__ __align__(128) unsigned char smem_window[];
  unsigned char* const smem =
      smem_window + (kSwizzleBlockBytes - smem_addr(smem_window) % kSwizzleBlockBytes) % kSwizzleBlockBytes;
  T* wo = reinterpret_cast<T*>(smem + OutSmem::kWo);
  T* wg = reinterpret_cast<T*>(smem + OutSmem::kWg);
  float* folds = reinterpret_cast<float*>(smem + OutSmem::kFolds);  // s, t of w_out, then of w_gate: kWidth each
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
  // shared addresses of this warpgroup's buffers: c's tile, x's boxes, the buffer's barrier
  const uint32_t buffers = smem_addr(smem + OutSmem::kTiles) + wgi * 2 * OutSmem::kBuffer;
  auto c_tile = [&](int buf) { return buffers + buf * static_cast<uint32_t>(OutSmem::kBuffer); };
  auto x_box = [&](int buf, int box) {
    return c_tile(buf) + static_cast<uint32_t>(OutSmem::kCTile + box * OutSmem::kXBox);
  };
  const uint32_t bars = smem_addr(smem + OutSmem::kBars) + wgi * 2 * sizeof(uint64_t);
  auto full = [&](int buf) { return bars + buf * static_cast<uint32_t>(sizeof(uint64_t)); };
  if (wg_tid == 0)
    for (int buf = 0; buf < 2; ++buf) mbarrier_init(full(buf), 1);
  cp_async_wait_all();
  fence_proxy_async_shared();  // the weights for wgmma's reads, the barriers for the copies
  __syncthreads();

  // Tiles in 32-bit arithmetic (takes(): B N ceil(N / 64) < 2^31).
  const LineTiles<kTilePositions>& space = launch.tiles;
  const uint32_t N = space.n();
  const uint32_t tiles = static_cast<uint32_t>(p.B * p.N) * space.j_tiles(), tile_step = gridDim.x * kWarpgroups;
  // Tile `tile`'s c and x into buffer `buf`, by the warpgroup's first thread: three boxes
  // completing on the buffer's barrier.
  auto load = [&](uint32_t tile, int buf) {
    const auto at = space.at(tile);
    const auto [b, i] = space.position(at.line);
    mbarrier_expect_bytes(full(buf), OutSmem::kBuffer);
    tma_load_4d(c_tile(buf), &launch.c_map, static_cast<int>(at.j0), static_cast<int>(i), 0, static_cast<int>(b),
                full(buf));
#pragma unroll
    for (int box = 0; box < kXBoxes; ++box)
      tma_load_4d(x_box(buf, box), &launch.x_map, kBoxWidth * box, static_cast<int>(at.j0), static_cast<int>(i),
                  static_cast<int>(b), full(buf));
  };

  // ldmatrix addresses (mma.cuh's warp_mma) in the swizzled boxes: matrix m = lane / 8 of each x4
  // load. c's (transposed): rows h = 16 s + 8 (m / 2) + lane % 8, the warp's positions; a step s
  // moves 16 rows, which keeps the swizzle. x's: the warp's rows, channels 16 s + 8 (m / 2), in
  // box s / 4.
  const int m8 = lane / 8, r8 = lane % 8;
  const uint32_t c_lane = swizzled((m8 / 2) * 8 + r8, 16 * warp + (m8 % 2) * 8);
  auto x_lane = [&](int s) {
    return (s * 16 / kBoxWidth) * static_cast<uint32_t>(OutSmem::kXBox) +
           swizzled(16 * warp + (m8 % 2) * 8 + r8, (s * 16) % kBoxWidth + (m8 / 2) * 8);
  };
  const uint64_t desc_o = wgmma_desc(smem_addr(wo), 8 * kWidth * sizeof(T));
  const uint64_t desc_g = wgmma_desc(smem_addr(wg), 8 * kWidth * sizeof(T));
  // a half's weight rows (kBoxWidth of them) further on, in the descriptors' address field
  const uint64_t half_rows_desc = CoreBlockedAt<T>{kWidth / 8}(kBoxWidth, 0) * sizeof(T) >> 4;
  const float* fold_s = folds;
  const float* fold_t = folds + kWidth;
  const float* gate_s = folds + 2 * kWidth;
  const float* gate_t = folds + 3 * kWidth;
  const float inv_h = 1.f / static_cast<float>(H), inv_p = 1.f / static_cast<float>(P);
  // precision tf32 on the fp16 stages, or fp16 operands under c's headroom: c arrives scaled by a
  // power of two (RangeScales), which its LayerNorm undoes but for eps
  const float eps_c = kF32Out ? range_c_eps(p.eps, *p.op_layout.range) : headroom_c_eps(p.eps, p.headroom);
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
  if (tile < tiles && wg_tid == 0) load(tile, 0);
  for (uint32_t round = 0; tile < tiles; tile += tile_step, ++round) {
    const int buf = round % 2;
    const auto at = space.at(tile);
    if (lane == 0) bulk_wait_read();       // this warp's stores have read the other buffer's staging
    mbarrier_wait(full(buf), round / 2 % 2);  // this tile's buffer complete (its use round / 2)
    warpgroup_barrier(wgi);  // every warp past the last tile's reads of the other buffer
    uint32_t ac[kSteps][4], ax[kSteps][4];
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      ldsm_x4_trans(ac[s], c_tile(buf) + c_lane + s * 16 * kSwizzleRowBytes);
      ldsm_x4(ax[s], x_box(buf, 0) + x_lane(s));
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
    if (tile + tile_step < tiles && wg_tid == 0) load(tile + tile_step, buf ^ 1);  // under this tile's work
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      cst[half] = fragment_row_stats<T>(ac, half, H, inv_h, eps_c);
      if (x_stats_here) xst[half] = fragment_row_stats<T>(ax, half, P, inv_p, p.eps);
    }
    // The chains in two halves of n (output channels 0..63, 64..127: out's two boxes), so the
    // first half's epilogue and store run under the second half's products.
    float y[kHalves][kHalfJ][4], gt[kHalves][kHalfJ][4];
    wgmma_fence();
#pragma unroll
    for (int hf = 0; hf < kHalves; ++hf) {
      wgmma_chain_rs<T, kSteps>(y[hf], ac, desc_o + hf * half_rows_desc);
      wgmma_chain_rs<T, kSteps>(gt[hf], ax, desc_g + hf * half_rows_desc);
      wgmma_commit();
    }
    // channels 8 j + 2 t and + 1 of the half's rows `half` (0: g, 1: g + 8), gated, at half scale
    auto out_pair = [&](const float (&yh)[kHalfJ][4], const float (&gh)[kHalfJ][4], int j, int half, float2 so,
                        float2 to, float2 sg, float2 tg) {
      const float mu = cst[half].x, rs = cst[half].y, xm = xst[half].x, xr = xst[half].y;
      const float y0 = fmaf(rs, fmaf(-mu, so.x, yh[j][2 * half]), to.x);
      const float y1 = fmaf(rs, fmaf(-mu, so.y, yh[j][2 * half + 1]), to.y);
      const float g0 = fmaf(xr, fmaf(-xm, sg.x, gh[j][2 * half]), tg.x);
      const float g1 = fmaf(xr, fmaf(-xm, sg.y, gh[j][2 * half + 1]), tg.y);
      return make_float2(gated_half_scale(y0, g0), gated_half_scale(y1, g1));
    };
    // The epilogue of half hf without branches, so its elements' chains interleave. A 16-bit
    // output goes through the warp's own 16 rows of x's box hf (read into ax above; the rows past
    // N and the channels past P the store leaves out); an fp32 one straight from the registers,
    // each row's eight channels of a j one 32-byte sector.
    auto epilogue = [&](const float (&yh)[kHalfJ][4], const float (&gh)[kHalfJ][4], int hf) {
      if constexpr (!kF32Out) {
#pragma unroll
        for (int j = 0; j < kHalfJ; ++j) {
          const int ch = kBoxWidth * hf + 8 * j + 2 * t;
          const float2 so = load2(fold_s + ch), to = load2(fold_t + ch), sg = load2(gate_s + ch),
                       tg = load2(gate_t + ch);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float2 v = out_pair(yh, gh, j, half, so, to, sg, tg);
            const auto pair = Vec2<T>::pack(v.x, v.y);
            sts32(x_box(buf, hf) + swizzled(16 * warp + g + 8 * half, ch % kBoxWidth),
                  *reinterpret_cast<const uint32_t*>(&pair));
          }
        }
        fence_proxy_async_shared();  // the staging, for the store's reads
        __syncwarp();
        if (lane == 0) {
          const auto [b, i] = space.position(at.line);
          tma_store_4d(&launch.out_map, kBoxWidth * hf, static_cast<int>(at.j0) + kStoreRows * warp,
                       static_cast<int>(i), static_cast<int>(b), x_box(buf, hf) + swizzled(kStoreRows * warp, 0));
          bulk_commit();
        }
      } else {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = 16 * warp + g + 8 * half;
          float* const out = static_cast<float*>(p.out) + (static_cast<int64_t>(at.line) * p.N + at.j0 + row) * p.P;
#pragma unroll
          for (int j = 0; j < kHalfJ; ++j) {
            const int ch = kBoxWidth * hf + 8 * j + 2 * t;
            const float2 v =
                out_pair(yh, gh, j, half, load2(fold_s + ch), load2(fold_t + ch), load2(gate_s + ch), load2(gate_t + ch));
            if (row < valid && ch < P)
              *reinterpret_cast<float2*>(out + ch) = make_float2(v.x * out_unscale, v.y * out_unscale);
          }
        }
      }
    };
    if constexpr (!kF32Out) {
      __syncwarp();  // every lane's ldmatrix reads of its rows before any lane's writes
      wgmma_wait<1>(y[0]);
      wgmma_wait<1>(gt[0]);
    } else {  // (both halves first: with A's registers live under the first epilogue it spills)
      wgmma_wait<0>(y[0]);
      wgmma_wait<0>(gt[0]);
    }
    epilogue(y[0], gt[0], 0);
    wgmma_wait<0>(y[1]);
    wgmma_wait<0>(gt[1]);
    epilogue(y[1], gt[1], 1);
  }
  if (lane == 0) bulk_wait_read();  // the last stores' reads before the block's shared memory goes
#endif
}

template <typename T>
cudaError_t launch_typed(const LnOutProjGateParams& p, cudaStream_t stream) {
  const int64_t tiles = p.B * p.N * ceil_div(p.N, kTilePositions);
  const int64_t blocks = std::min<int64_t>(p.resident_blocks, ceil_div(tiles, kWarpgroups));
  const bool f32_out = p.op_layout.range != nullptr;
  if (f32_out && !std::is_same<T, __half>::value) return cudaErrorInvalidValue;
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  OutLaunch launch{p, LineTiles<kTilePositions>(p.N), {}, {}, {}};
  const int64_t plane = p.Npad * p.Npad;
  cudaError_t e = encode_map_16bit(&launch.c_map, p.c, kBf16, {p.Npad, p.Npad, p.H, p.B}, {p.Npad, plane, p.H * plane},
                                   {kTilePositions, 1, kWidth, 1});
  if (e == cudaSuccess)
    e = encode_map_16bit(&launch.x_map, p.x, kBf16, {p.P, p.N, p.N, p.B}, {p.x_stride_j, p.x_stride_i, p.x_stride_b},
                         {kBoxWidth, kTilePositions, 1, 1});
  if (e == cudaSuccess && !f32_out)
    e = encode_map_16bit(&launch.out_map, p.out, kBf16, {p.P, p.N, p.N, p.B}, {p.P, p.N * p.P, p.N * p.N * p.P},
                         {kBoxWidth, kStoreRows, 1, 1});
  if (e != cudaSuccess) return e;
  if constexpr (std::is_same<T, __half>::value)
    if (f32_out)
      return launch_grid_rows(ln_out_proj_gate_resident_kernel<T, float>, blocks, 1, kBlockThreads, OutSmem::kBytes,
                              launch, stream);
  return launch_grid_rows(ln_out_proj_gate_resident_kernel<T, T>, blocks, 1, kBlockThreads, OutSmem::kBytes, launch,
                          stream);
}

}  // namespace

bool ln_out_proj_gate_resident_takes(const LnOutProjGateParams& p) {
  const bool width_ok = p.P % 8 == 0 && p.H % 8 == 0 && p.P > kWidthFloor && p.H > kWidthFloor && p.P <= kWidth &&
                        p.H <= kWidth;
  const bool tiles_ok = p.B * p.N * ceil_div(p.N, kTilePositions) < (int64_t{1} << 31);  // (32-bit tile math)
  return p.resident_blocks > 0 && (p.c_dtype == DType::bf16 || p.c_dtype == DType::f16) &&
         p.x_dtype == p.c_dtype && p.x_rows_vec16 && width_ok && tiles_ok;
}

size_t ln_out_proj_gate_resident_smem() { return OutSmem::kBytes; }

cudaError_t launch_ln_out_proj_gate_resident(const LnOutProjGateParams& p, cudaStream_t stream) {
  switch (p.c_dtype) {
    case DType::bf16: return launch_typed<__nv_bfloat16>(p, stream);
    case DType::f16: return launch_typed<__half>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace trimul
