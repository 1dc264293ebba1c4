// ln_proj_gate on tensor cores, for 16-bit contraction operands (bf16, fp16).
// Computes what ln_proj_gate.cu computes (see there and trimul.h):
//
//   xn = LayerNorm(x[b, r, c, :]);  a, b = gated projections of xn, masked;
//   a_out[b*H + h][r][c] = a[h]     (channel-first, padding written as zeros)
//
// Block: 128 positions c of one (b, r), 8 warps of 16 positions each. The
// normalized tile xs [128][kp] stays in shared memory while the 4H weight rows
// stream through in chunks of 64 (16 hidden units x {proj_a, gate_a, proj_b,
// gate_b}); each warp multiplies its 16 x 64 piece with mma.sync. In the
// accumulator layout a thread holds adjacent columns (2t, 2t+1), i.e. a
// (projection, gate) pair, so gating happens in registers; the gated values go
// through a shared staging tile so that a and b are stored as 16-byte runs of c.
#include "common.cuh"
#include "mma.cuh"

namespace trimul {
namespace {

constexpr int kRows = 128;           // positions per block
constexpr int kWarps = kRows / 16;   // one m16 tile per warp
constexpr int kBlockThreads = kWarps * 32;
constexpr int kCols = 64;            // weight rows per chunk
constexpr int kHiddenPerChunk = kCols / 4;
constexpr int kNTiles = kCols / 8;
constexpr int kVec = 8;              // 16-bit elements per 16-byte store

struct Smem {
  int ld, kp;
  size_t xs, ws, stage, stats, bytes;
  template <typename Tab>
  __host__ __device__ static Smem make(int64_t P) {
    Smem s{};
    s.kp = static_cast<int>(round_up16(P));
    s.ld = s.kp + kSmemPad;
    s.xs = 0;
    s.ws = s.xs + sizeof(Tab) * kRows * s.ld;
    s.stage = s.ws + sizeof(Tab) * kCols * s.ld;
    s.stats = s.stage + sizeof(Tab) * 2 * kHiddenPerChunk * kRows;
    s.bytes = s.stats + sizeof(float) * 3 * kRows;
    return s;
  }
};

template <typename Tx, typename Tab>
__global__ void __launch_bounds__(kBlockThreads) ln_proj_gate_mma_kernel(const LnProjGateParams p, int64_t b_first) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem L = Smem::make<Tab>(p.P);
  Tab* xs = reinterpret_cast<Tab*>(smem + L.xs);
  Tab* ws = reinterpret_cast<Tab*>(smem + L.ws);
  Tab* stage = reinterpret_cast<Tab*>(smem + L.stage);  // [2][kHiddenPerChunk][kRows]
  float* mean = reinterpret_cast<float*>(smem + L.stats);
  float* rstd = mean + kRows;
  float* msk = rstd + kRows;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t c_tiles = ceil_div(p.Npad, kRows);
  const int64_t r = blockIdx.x / c_tiles, c0 = (blockIdx.x % c_tiles) * kRows;
  const int64_t b = b_first + blockIdx.y;
  const Tx* x = static_cast<const Tx*>(p.x);
  const float* prm = p.params;
  const float* ln_w = prm + p.layout.ln_in_w;
  const float* ln_b = prm + p.layout.ln_in_b;

  // Normalized tile, mask and zero padding: each warp its 16 positions.
  for (int rr = warp * 16; rr < warp * 16 + 16; ++rr) {
    const int64_t c = c0 + rr;
    Tab* dst = xs + rr * L.ld;
    if (r >= p.N || c >= p.N) {
      for (int k = lane; k < L.kp; k += 32) dst[k] = from_float<Tab>(0.f);
      if (lane == 0) msk[rr] = 0.f;
      continue;
    }
    const Tx* src = x + b * p.x_stride_b + r * p.x_stride_r + c * p.x_stride_c;
    float sum = 0.f;
    for (int64_t k = lane; k < p.P; k += 32) sum += to_float(src[k]);
    const float mu = warp_sum(sum) / static_cast<float>(p.P);
    float sq = 0.f;
    for (int64_t k = lane; k < p.P; k += 32) {
      const float d = to_float(src[k]) - mu;
      sq += d * d;
    }
    const float rs = rsqrtf(warp_sum(sq) / static_cast<float>(p.P) + p.eps);
    for (int k = lane; k < L.kp; k += 32)
      dst[k] = from_float<Tab>(k < p.P ? (to_float(src[k]) - mu) * rs * ln_w[k] + ln_b[k] : 0.f);
    if (lane == 0)
      msk[rr] = p.mask ? load_any(p.mask, p.mask_dtype, b * p.mask_stride_b + r * p.mask_stride_r + c * p.mask_stride_c)
                       : 1.f;
  }

  const int g = lane / 4, t = lane % 4;
  const float* w_in = prm + p.layout.w_in;
  const float* bias = prm + p.layout.b_in;
  const int64_t w_rows = 4 * p.H;
  for (int64_t col0 = 0; col0 < w_rows; col0 += kCols) {
    __syncthreads();  // tile ready / previous chunk's weights and staging consumed
    for (int e = threadIdx.x; e < kCols * L.kp; e += kBlockThreads) {
      const int n = e / L.kp, k = e % L.kp;
      ws[n * L.ld + k] = from_float<Tab>(col0 + n < w_rows && k < p.P ? w_in[(col0 + n) * p.P + k] : 0.f);
    }
    __syncthreads();
    float acc[kNTiles][4] = {};
    warp_mma<Tab, kNTiles>(acc, xs, ws, L.ld, warp * 16, L.kp);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      const int n = nt * 8 + 2 * t;  // even: (projection, gate) of one hidden unit
      if (col0 + n >= w_rows) continue;
      const float bp = bias[col0 + n], bg = bias[col0 + n + 1];
      Tab* dst = stage + (((n % 4) / 2) * kHiddenPerChunk + n / 4) * kRows;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = warp * 16 + g + 8 * half;
        const float v = (acc[nt][2 * half] + bp) * sigmoidf(acc[nt][2 * half + 1] + bg) * msk[row];
        dst[row] = from_float<Tab>(msk[row] == 0.f ? 0.f : v);
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 2 * kHiddenPerChunk * (kRows / kVec); e += kBlockThreads) {
      const int which = e / (kHiddenPerChunk * (kRows / kVec));
      const int hl = (e / (kRows / kVec)) % kHiddenPerChunk, seg = e % (kRows / kVec);
      const int64_t h = col0 / 4 + hl, c = c0 + seg * kVec;
      if (h >= p.H || c >= p.Npad) continue;
      Tab* out = static_cast<Tab*>(which ? p.b : p.a) + ((b * p.H + h) * p.Npad + r) * p.Npad + c;
      *reinterpret_cast<uint4*>(out) =
          *reinterpret_cast<const uint4*>(stage + (which * kHiddenPerChunk + hl) * kRows + seg * kVec);
    }
  }
}

template <typename Tx, typename Tab>
cudaError_t launch_typed(const LnProjGateParams& p, cudaStream_t stream) {
  const size_t bytes = Smem::make<Tab>(p.P).bytes;
  auto kernel = ln_proj_gate_mma_kernel<Tx, Tab>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  for (int64_t b0 = 0; b0 < p.B; b0 += kMaxGridY) {
    const dim3 grid(static_cast<unsigned>(ceil_div(p.Npad, kRows) * p.Npad),
                    static_cast<unsigned>(std::min<int64_t>(p.B - b0, kMaxGridY)));
    kernel<<<grid, kBlockThreads, bytes, stream>>>(p, b0);
  }
  return cudaGetLastError();
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

size_t ln_proj_gate_mma_smem(int64_t P) { return Smem::make<__nv_bfloat16>(P).bytes; }

cudaError_t launch_ln_proj_gate_mma(const LnProjGateParams& p, cudaStream_t stream) {
  return p.ab_dtype == DType::f16 ? launch_for_ab<__half>(p, stream) : launch_for_ab<__nv_bfloat16>(p, stream);
}

}  // namespace trimul
