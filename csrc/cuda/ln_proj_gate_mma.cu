// ln_proj_gate on tensor cores, for 16-bit contraction operands (bf16, fp16).
// Computes what ln_proj_gate.cu computes (see there and trimul.h):
//
//   xn = LayerNorm(x[b, r, c, :]);  a, b = gated projections of xn, masked;
//   a_out[b*H + h][r][c] = a[h]     (channel-first, padding written as zeros)
//
// Block: 128 positions c of one (b, r), 8 warps of 16 positions each.
//  1. The x tile arrives by cp.async (16-byte copies, all in flight), straight
//     into the operand tile xs when x already has the operand type, else into a
//     raw tile; LayerNorm statistics come from shared memory, and xs is
//     normalized in place.
//  2. The 4H weight rows (16-bit copies, OperandLayout) stream through in
//     chunks of 64 = 16 hidden units x {proj_a, gate_a, proj_b, gate_b}; each
//     warp multiplies its 16 x 64 piece with mma.sync. (A second chunk buffer,
//     loading under the math, measured slower: it costs a block per SM.) A thread's accumulator
//     pair (2t, 2t+1) is one (projection, gate) pair, so gating happens in
//     registers; gated values pass a staging tile so that a and b leave as
//     16-byte runs along c.
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"

namespace trimul {
namespace {

constexpr int kRows = 128;           // positions per block
constexpr int kWarps = kRows / 16;   // one m16 tile per warp
constexpr int kBlockThreads = kWarps * 32;
constexpr int kCols = static_cast<int>(kOperandRowTile);  // weight rows per chunk
constexpr int kHiddenPerChunk = kCols / 4;
constexpr int kNTiles = kCols / 8;
constexpr int kVec = 8;              // 16-bit elements per 16-byte store
constexpr int kStageLd = kRows + kSmemPad;  // staging rows: a thread's 4 rows in distinct banks
constexpr int kMinBlocksPerSm = 3;   // what shared memory allows at P = 128; caps registers to match

struct Smem {
  int ld, kp;
  size_t xs, raw, ws, stage, msk, bytes;
  // raw_x_bytes: element size of x when it differs from the operand type, else 0
  __host__ __device__ static Smem make(int64_t P, int64_t raw_x_bytes) {
    Smem s{};
    s.kp = static_cast<int>(round_up16(P));
    s.ld = s.kp + kSmemPad;
    s.xs = 0;
    s.raw = s.xs + 2 * kRows * s.ld;
    s.ws = s.raw + raw_x_bytes * kRows * P;
    s.ws = (s.ws + 15) / 16 * 16;
    s.stage = s.ws + 2 * kCols * s.ld;
    s.msk = s.stage + 2 * 2 * kHiddenPerChunk * kStageLd;
    s.bytes = s.msk + sizeof(float) * kRows;
    return s;
  }
};

template <typename Tx, typename Tab>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocksPerSm) ln_proj_gate_mma_kernel(const LnProjGateParams p, int64_t b_first) {
  constexpr bool kInPlace = std::is_same<Tx, Tab>::value;
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem L = Smem::make(p.P, kInPlace ? 0 : sizeof(Tx));
  Tab* xs = reinterpret_cast<Tab*>(smem + L.xs);
  Tx* raw = kInPlace ? reinterpret_cast<Tx*>(xs) : reinterpret_cast<Tx*>(smem + L.raw);
  const int ld_raw = kInPlace ? L.ld : static_cast<int>(p.P);
  Tab* ws = reinterpret_cast<Tab*>(smem + L.ws);        // weight chunk [kCols][ld]
  Tab* stage = reinterpret_cast<Tab*>(smem + L.stage);  // row 2 * hidden + (0: a, 1: b)
  float* msk = reinterpret_cast<float*>(smem + L.msk);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c_tiles = ceil_div(p.Npad, kRows);
  const int64_t r = blockIdx.x / c_tiles, c0 = (blockIdx.x % c_tiles) * kRows;
  const int64_t b = b_first + blockIdx.y;
  const Tx* x = static_cast<const Tx*>(p.x);
  auto valid = [&](int rr) { return r < p.N && c0 + rr < p.N; };
  auto x_row = [&](int rr) -> const Tx* {
    return valid(rr) ? x + b * p.x_stride_b + r * p.x_stride_r + (c0 + rr) * p.x_stride_c : nullptr;
  };
  copy_rows(raw, ld_raw, kRows, static_cast<int>(p.P), kInPlace ? L.kp : static_cast<int>(p.P), x_row,
            p.x_rows_vec16);
  const Tab* w_in = static_cast<const Tab*>(p.operands) + p.op_layout.w_in;
  const int64_t w_rows = 4 * p.H, chunks = ceil_div(w_rows, kCols);
  auto load_chunk = [&](int64_t ch) {
    copy_rows(ws, L.ld, kCols, L.kp, L.kp, [&](int n) { return w_in + (ch * kCols + n) * L.kp; }, true);
  };
  load_chunk(0);
  for (int rr = threadIdx.x; rr < kRows; rr += kBlockThreads) {
    const int64_t c = c0 + rr;
    msk[rr] = !valid(rr) ? 0.f
              : p.mask   ? load_any(p.mask, p.mask_dtype, b * p.mask_stride_b + r * p.mask_stride_r + c * p.mask_stride_c)
                         : 1.f;
  }
  cp_async_wait_all();
  __syncthreads();

  warp_layer_norm_rows(raw, ld_raw, xs, L.ld, warp * 16, 16, static_cast<int>(p.P), L.kp,
                       p.params + p.layout.ln_in_w, p.params + p.layout.ln_in_b, p.eps, true, valid);

  const int g = lane / 4, t = lane % 4;
  const float* bias = p.params + p.layout.b_in;
  for (int64_t ch = 0; ch < chunks; ++ch) {
    if (ch > 0) {
      __syncthreads();  // the previous chunk's weights and staging tile are consumed
      load_chunk(ch);
    }
    cp_async_wait_all();
    __syncthreads();
    const int64_t col0 = ch * kCols;
    float acc[kNTiles][4] = {};
    warp_mma<Tab, kNTiles, false>(acc, xs, L.ld, ws, L.ld, warp * 16, L.kp);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int n = nt * 8 + 2 * t;  // even: (projection, gate) of one hidden unit
      if (col0 + n >= w_rows) continue;
      const float2 bpg = *reinterpret_cast<const float2*>(bias + col0 + n);
      Tab* dst = stage + (2 * (n / 4) + (n % 4) / 2) * kStageLd;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + g + 8 * half;
        const float m = msk[row];
        dst[row] = from_float<Tab>(m == 0.f ? 0.f : (acc[nt][2 * half] + bpg.x) * sigmoidf(acc[nt][2 * half + 1] + bpg.y) * m);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 2 * kHiddenPerChunk * (kRows / kVec); e += kBlockThreads) {
      const int srow = e / (kRows / kVec), seg = e % (kRows / kVec);  // srow = 2 * hidden + which
      const int64_t h = col0 / 4 + srow / 2, c = c0 + seg * kVec;
      if (h >= p.H || c >= p.Npad) continue;
      Tab* out = static_cast<Tab*>(srow % 2 ? p.b : p.a) + ((b * p.H + h) * p.Npad + r) * p.Npad + c;
      *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(stage + srow * kStageLd + seg * kVec);
    }
  }
}

template <typename Tx, typename Tab>
cudaError_t launch_typed(const LnProjGateParams& p, cudaStream_t stream) {
  return launch_grid_rows(ln_proj_gate_mma_kernel<Tx, Tab>, ceil_div(p.Npad, kRows) * p.Npad, p.B, kBlockThreads, Smem::make(p.P, std::is_same<Tx, Tab>::value ? 0 : sizeof(Tx)).bytes, p, stream);
}

template <typename Tab>
cudaError_t launch_for_ab(const LnProjGateParams& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_typed<__nv_bfloat16, Tab>(p, stream);
    case DType::f16: return launch_typed<__half, Tab>(p, stream);
    default: return launch_typed<float, Tab>(p, stream);
  }
}

}  // namespace

size_t ln_proj_gate_mma_smem(int64_t P, int64_t raw_x_bytes) { return Smem::make(P, raw_x_bytes).bytes; }

cudaError_t launch_ln_proj_gate_mma(const LnProjGateParams& p, cudaStream_t stream) {
  return p.ab_dtype == DType::f16 ? launch_for_ab<__half>(p, stream) : launch_for_ab<__nv_bfloat16>(p, stream);
}

}  // namespace trimul
