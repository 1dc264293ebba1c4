// ln_out_proj_gate on tensor cores, for 16-bit operand precisions (bf16, fp16).
// Computes what ln_out_proj_gate.cu computes:
//
//   out[b, i, j, :] = (LayerNorm(c[b, i, j, :]) . Wo^T + bo) * sigmoid(u . Wg^T + bg)
//
// Block: 128 positions j of one (b, i), 8 warps of 16 positions. Both operand
// tiles stay in shared memory, rounded to the operand type: cs [128][kh] (c
// normalized over h, read channel-first) and us [128][kp] (x or LayerNorm(x)).
// Output channels go in chunks of 64: the Wo and Wg rows of a chunk are staged,
// each warp forms its 16 x 64 pieces of y and g with mma.sync, and a thread
// combines y and g of the same elements in registers and stores them.
#include "common.cuh"
#include "mma.cuh"

namespace trimul {
namespace {

constexpr int kRows = 128;
constexpr int kWarps = kRows / 16;
constexpr int kBlockThreads = kWarps * 32;
constexpr int kCols = 64;
constexpr int kNTiles = kCols / 8;
constexpr int kStatParts = kBlockThreads / kRows;

struct Smem {
  int ldh, kh, ldp, kp;
  size_t cs, us, wo, wg, red, bytes;
  template <typename Tab>
  __host__ __device__ static Smem make(int64_t P, int64_t H) {
    Smem s{};
    s.kh = static_cast<int>(round_up16(H));
    s.ldh = s.kh + kSmemPad;
    s.kp = static_cast<int>(round_up16(P));
    s.ldp = s.kp + kSmemPad;
    s.cs = 0;
    s.us = s.cs + sizeof(Tab) * kRows * s.ldh;
    s.wo = s.us + sizeof(Tab) * kRows * s.ldp;
    s.wg = s.wo + sizeof(Tab) * kCols * s.ldh;
    s.red = s.wg + sizeof(Tab) * kCols * s.ldp;
    s.bytes = s.red + sizeof(float) * kStatParts * kRows;
    return s;
  }
};

template <typename Tx, typename Tab>
__global__ void __launch_bounds__(kBlockThreads)
    ln_out_proj_gate_mma_kernel(const LnOutProjGateParams p, int64_t b_first) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Smem L = Smem::make<Tab>(p.P, p.H);
  Tab* cs = reinterpret_cast<Tab*>(smem + L.cs);
  Tab* us = reinterpret_cast<Tab*>(smem + L.us);
  Tab* wo = reinterpret_cast<Tab*>(smem + L.wo);
  Tab* wg = reinterpret_cast<Tab*>(smem + L.wg);
  float* red = reinterpret_cast<float*>(smem + L.red);  // [kStatParts][kRows]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t j_tiles = ceil_div(p.N, kRows);
  const int64_t i = blockIdx.x / j_tiles, j0 = (blockIdx.x % j_tiles) * kRows;
  const int64_t b = b_first + blockIdx.y;
  const float* prm = p.params;

  // cs: LayerNorm of c over h. Thread: position j = tid % 128, every
  // kStatParts-th h; partial sums meet in `red`.
  {
    const int row = threadIdx.x % kRows, part = threadIdx.x / kRows;
    const bool ok = j0 + row < p.N;
    const int64_t plane = p.Npad * p.Npad;
    const float* c = p.c + b * p.H * plane + i * p.Npad + j0 + row;
    float sum = 0.f;
    if (ok)
      for (int64_t h = part; h < p.H; h += kStatParts) sum += c[h * plane];
    red[part * kRows + row] = sum;
    __syncthreads();
    float mu = 0.f;
    for (int q = 0; q < kStatParts; ++q) mu += red[q * kRows + row];
    mu /= static_cast<float>(p.H);
    __syncthreads();
    float sq = 0.f;
    if (ok)
      for (int64_t h = part; h < p.H; h += kStatParts) {
        const float d = c[h * plane] - mu;
        sq += d * d;
      }
    red[part * kRows + row] = sq;
    __syncthreads();
    float var = 0.f;
    for (int q = 0; q < kStatParts; ++q) var += red[q * kRows + row];
    const float rs = rsqrtf(var / static_cast<float>(p.H) + p.eps);
    const float* w = prm + p.layout.ln_out_w;
    const float* bb = prm + p.layout.ln_out_b;
    for (int h = part; h < L.kh; h += kStatParts)
      cs[row * L.ldh + h] = from_float<Tab>(ok && h < p.H ? (c[h * plane] - mu) * rs * w[h] + bb[h] : 0.f);
  }

  // us: the gate input, x or LayerNorm(x); each warp its 16 positions.
  const Tx* x = static_cast<const Tx*>(p.x);
  const float* ln_w = prm + p.layout.ln_in_w;
  const float* ln_b = prm + p.layout.ln_in_b;
  for (int rr = warp * 16; rr < warp * 16 + 16; ++rr) {
    Tab* dst = us + rr * L.ldp;
    if (j0 + rr >= p.N) {
      for (int k = lane; k < L.kp; k += 32) dst[k] = from_float<Tab>(0.f);
      continue;
    }
    const Tx* src = x + b * p.x_stride_b + i * p.x_stride_i + (j0 + rr) * p.x_stride_j;
    float mu = 0.f, rs = 1.f;
    if (p.gate_from_normalized) {
      float sum = 0.f;
      for (int64_t k = lane; k < p.P; k += 32) sum += to_float(src[k]);
      mu = warp_sum(sum) / static_cast<float>(p.P);
      float sq = 0.f;
      for (int64_t k = lane; k < p.P; k += 32) {
        const float d = to_float(src[k]) - mu;
        sq += d * d;
      }
      rs = rsqrtf(warp_sum(sq) / static_cast<float>(p.P) + p.eps);
    }
    for (int k = lane; k < L.kp; k += 32) {
      float v = 0.f;
      if (k < p.P) {
        v = to_float(src[k]);
        if (p.gate_from_normalized) v = (v - mu) * rs * ln_w[k] + ln_b[k];
      }
      dst[k] = from_float<Tab>(v);
    }
  }

  const int g = lane / 4, t = lane % 4;
  const float* w_out = prm + p.layout.w_out;
  const float* w_gate = prm + p.layout.w_gate;
  const float* b_out = prm + p.layout.b_out;
  const float* b_gate = prm + p.layout.b_gate;
  Tx* out = static_cast<Tx*>(p.out) + ((b * p.N + i) * p.N + j0) * p.P;
  for (int64_t p0 = 0; p0 < p.P; p0 += kCols) {
    __syncthreads();  // tiles ready / previous chunk's weights consumed
    for (int e = threadIdx.x; e < kCols * L.kh; e += kBlockThreads) {
      const int n = e / L.kh, k = e % L.kh;
      wo[n * L.ldh + k] = from_float<Tab>(p0 + n < p.P && k < p.H ? w_out[(p0 + n) * p.H + k] : 0.f);
    }
    for (int e = threadIdx.x; e < kCols * L.kp; e += kBlockThreads) {
      const int n = e / L.kp, k = e % L.kp;
      wg[n * L.ldp + k] = from_float<Tab>(p0 + n < p.P && k < p.P ? w_gate[(p0 + n) * p.P + k] : 0.f);
    }
    __syncthreads();
    float y[kNTiles][4] = {}, gt[kNTiles][4] = {};
    warp_mma<Tab, kNTiles>(y, cs, wo, L.ldh, warp * 16, L.kh);
    warp_mma<Tab, kNTiles>(gt, us, wg, L.ldp, warp * 16, L.kp);
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int row = warp * 16 + g + 8 * (q / 2);
        const int64_t ch = p0 + nt * 8 + 2 * t + (q % 2);
        if (j0 + row < p.N && ch < p.P)
          out[row * p.P + ch] = from_float<Tx>((y[nt][q] + b_out[ch]) * sigmoidf(gt[nt][q] + b_gate[ch]));
      }
    }
  }
}

template <typename Tx, typename Tab>
cudaError_t launch_typed(const LnOutProjGateParams& p, cudaStream_t stream) {
  const size_t bytes = Smem::make<Tab>(p.P, p.H).bytes;
  auto kernel = ln_out_proj_gate_mma_kernel<Tx, Tab>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return e;
  for (int64_t b0 = 0; b0 < p.B; b0 += kMaxGridY) {
    const dim3 grid(static_cast<unsigned>(ceil_div(p.N, kRows) * p.N),
                    static_cast<unsigned>(std::min<int64_t>(p.B - b0, kMaxGridY)));
    kernel<<<grid, kBlockThreads, bytes, stream>>>(p, b0);
  }
  return cudaGetLastError();
}

template <typename Tab>
cudaError_t launch_for_ab(const LnOutProjGateParams& p, cudaStream_t stream) {
  switch (p.x_dtype) {
    case DType::bf16: return launch_typed<__nv_bfloat16, Tab>(p, stream);
    case DType::f16: return launch_typed<__half, Tab>(p, stream);
    default: return launch_typed<float, Tab>(p, stream);
  }
}

}  // namespace

size_t ln_out_proj_gate_mma_smem(int64_t P, int64_t H) { return Smem::make<__nv_bfloat16>(P, H).bytes; }

cudaError_t launch_ln_out_proj_gate_mma(const LnOutProjGateParams& p, Precision operands, cudaStream_t stream) {
  return operands == Precision::fp16 ? launch_for_ab<__half>(p, stream) : launch_for_ab<__nv_bfloat16>(p, stream);
}

}  // namespace trimul
