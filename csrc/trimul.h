// trimul: the triangle multiplicative update, kernel-side interface.
//
// Everything in this header is free of torch: plain parameter structs and the
// launch functions the binding calls. The forward runs as four launches:
//
//   pack_params        every weight, bias and LayerNorm affine (any float dtype,
//                      any strides, optional) into one fp32 workspace
//   ln_proj_gate       LayerNorm(x), the four input projections, gating and mask;
//                      writes a and b channel-first, [B*H][Npad][Npad], with the
//                      contraction index k contiguous
//   the contraction    c[bh][i][j] = sum_k a[bh][i][k] * b[bh][j][k], batched over
//                      (batch, h) on tensor cores: triangle_gemm (CUTLASS) at ieee,
//                      and at tf32 where torch's matmul does not take fp32 products
//                      as TF32; else the binding calls torch's bmm (cuBLAS: at
//                      bf16 0.40 ms at N = 1024 on the H200, against 0.78 ms for the
//                      CUTLASS sm80 kernel it replaced)
//   ln_out_proj_gate   LayerNorm(c), output projection, output gate, product
//
// The direction only changes how ln_proj_gate reads x: "incoming" reads x with
// its two spatial strides swapped, which turns it into "outgoing".
//
// Small problems instead run as one launch, fused_small (below), where launch
// latency rather than arithmetic would set the time of the four stages.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace trimul {

// Element types the kernels read. Values are the binding's own codes.
enum class DType : int32_t { f32 = 0, f64 = 1, bf16 = 2, f16 = 3, b8 = 4, u8 = 5, i8 = 6, i16 = 7, i32 = 8, i64 = 9 };

// How the matrix products round their operands.
enum class Precision : int32_t {
  ieee = 0,  // fp32-accurate (3xTF32 on tensor cores)
  tf32 = 1,
  bf16 = 2,
  fp16 = 3,
};

// a / b rounded up (a >= 0, b > 0), for the host and the kernels
__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The contraction operands are padded to a multiple of this along both spatial
// dimensions (padding written as zeros), so every row is 16-byte aligned.
constexpr int64_t kSpatialAlign = 8;
inline int64_t padded_extent(int64_t n) { return (n + kSpatialAlign - 1) / kSpatialAlign * kSpatialAlign; }

// ---- packed parameters (fp32), offsets in elements -------------------------
// w_in rows are interleaved per hidden unit: row 4*h + {0: proj_a, 1: gate_a,
// 2: proj_b, 3: gate_b}, so one thread's four accumulators gate each other.
struct PackedLayout {
  int64_t ln_in_w, ln_in_b;  // [P]
  int64_t w_in, b_in;        // [4H][P], [4H]
  int64_t ln_out_w, ln_out_b;  // [H]
  int64_t w_out, b_out;      // [P][H], [P]
  int64_t w_gate, b_gate;    // [P][P], [P]
  int64_t total;
};
PackedLayout packed_layout(int64_t P, int64_t H);

// One source tensor of pack_params: a (rows x cols) strided matrix (a vector is
// one row) scattered into dst[offset + r * dst_row_stride + c]; a missing
// tensor (ptr == nullptr) writes `fill` instead.
struct PackEntry {
  const void* ptr;
  DType dtype;
  int64_t rows, cols, stride_r, stride_c;
  int64_t offset, dst_row_stride;
  float fill;
};
constexpr int kMaxPackEntries = 16;
struct RangeScales;
struct PackParams {
  PackEntry entry[kMaxPackEntries];  // one per parameter, in trimul.forward's order (kParam...)
  int count;
  float* dst;
  // c's headroom at fp16 operands (RangeScales, launch_range_headroom's): the projections'
  // weights and biases, in the fp32 pack and the stored w_in, times 2^-range_headroom_log2; else nullptr
  const RangeScales* headroom;
};
constexpr int kParamLnInW = 0, kParamLnInB = 1;
constexpr int kParamWIn = 2;  // proj_a weight, bias, gate_a weight, bias, proj_b ..., gate_b ...
constexpr int kParamLnOutW = 10, kParamLnOutB = 11, kParamWOut = 12, kParamBOut = 13;
constexpr int kParamWGate = 14, kParamBGate = 15;

// Precision tf32 on the fp16 stages (range.cu): fp16 holds tf32's 10-bit significand, so fp32
// values brought into fp16's range by powers of two and rounded to fp16 are their tf32
// roundings. x goes in normalized (xhat, |xhat| <= sqrt(P), LayerNorm done in fp32), w_in's
// projection rows (and their bias columns) are stored times 2^proj_log2 and w_out (and its fold
// t) times 2^out_log2, the mask is divided by 2^e (max |mask| 2^-e <= 1, e from mask_amax), so
// that a and b come out times 2^(proj_log2 - e), bounded by 2^range_ab_log2(N) from the
// parameters alone, c times 2^(2 (proj_log2 - e)) (its LayerNorm takes eps times the square of
// that), and the output stage's result times 2^out_log2, bounded by 2^kRangeOutLog2 (the stage
// writes it fp32, the scale undone). The gates' weights (w_in's gate rows with their bias
// columns, and w_gate) are stored times 2^gate_log2, which brings a bound past 2^kRangeGateLog2
// down to it (else 1), and each gate's value is multiplied by 2^-gate_log2 before its tanh (the
// accumulation is fp32: only the stored weights need fp16's range). Written on the device by
// launch_range_scales (the bounds) and launch_range_normalize (mask_amax); range.cuh turns them
// into the exponents.
struct RangeScales {   // (zeroed before launch_range_scales; bounds as float bits, atomicMax'd)
  uint32_t proj_bound;  // the projections' bound, whose exponent gives proj_log2 (range.cuh)
  uint32_t out_bound;   // the output's bound, whose exponent gives out_log2
  uint32_t gate_bound;  // the gates' bound (both gates read xhat), whose exponent gives gate_log2
  uint32_t mask_amax;   // the largest finite |mask| (1 without a mask)
  int32_t ab_log2;      // range_ab_log2(N)
};
constexpr int kRangeOutLog2 = 14;
constexpr int kRangeGateLog2 = 14;
constexpr int kRangeGradLog2 = 14;
// The tf32 backward's contraction gradients on fp16 operands: dc (the gradient of c) stored times
// 2^grad_log2, from its largest magnitude down or up to 2^kRangeGradLog2 (range.cuh), with a and b
// as the fp16 input stage leaves them (times 2^d, d = proj_log2 - e: RangeScales), so da = dc b and
// db = dc^T a come out of their fp32 accumulation times 2^(grad_log2 + d), which `unscale` undoes.
struct GradScale {  // (zeroed before launch_range_grad_amax)
  uint32_t amax;    // the largest |dc| (float bits, atomicMax'd)
  float unscale;    // 2^-(grad_log2 + d), written by the pair layout's conversion (PairLayoutParams)
};
// The headroom of c at fp16 operands (the 16-bit pipeline at precision fp16; range.cu): c's N
// products, accumulated in fp32, are stored in fp16, whose largest finite value is 65504, so large
// projections or a long contraction would store c as inf and the output LayerNorm would give NaN
// where the update is finite. From range_bounds' projection bound and the mask's largest
// magnitude in the RangeScales below (launch_range_headroom), t = ceil_log2(proj_bound) +
// ceil_log2(mask_amax) - ab_log2 held to [0, kHeadroomMaxLog2] (range.cuh: range_headroom_log2).
// The pack stores the projection rows (proj_a's and proj_b's, their biases with them) times 2^-t,
// so a and b come out times 2^-t, at most 2^range_ab_log2(N), and c times 2^-2t, below 2^15; the
// output stage's LayerNorm of c takes eps times 2^-4t. Powers of two commute with every rounding
// between, so the output is what it would be unscaled, but for the rounding of rsqrt(var + eps),
// wherever a, b and c stay in fp16's normal range; t = 0, the usual case, changes nothing. The
// fused backward takes the same t: its gradients are those of the update with the projections
// times 2^-t and eps times 2^-4t, the same function, so param_grads multiplies the projections'
// gradients by 2^-t (ParamGradsParams::headroom). The stage-by-stage backward (trimul/backward.py)
// takes t's 2^-t as a value (RangeHeadroomParams::scale) and runs on the projections' weights and
// biases so scaled, with c's LayerNorm reading c times 2^2t in fp32.
constexpr int kHeadroomMaxLog2 = 25;  // eps 2^-4t stays above fp32's least subnormal for eps >= 2^-49
// a and b at most 2^range_ab_log2(N), so that c's N products stay below 2^15
inline int range_ab_log2(int64_t N) {
  int log2n = 0;
  while ((int64_t{1} << log2n) < N) ++log2n;
  const int room = 15 - log2n;  // (rounded down: N past 2^15 wants a and b below 1)
  return room >= 0 ? room / 2 : -((1 - room) / 2);
}

// Copies of the three weight matrices for the tensor-core stages, in the
// operand type (bf16 or fp16; fp32 for the tf32 and ieee precisions, which the
// products read as tf32 or as a tf32 pair), zero-padded: rows to a multiple of
// kOperandRowTile, reduction dims to a multiple of 16. Every row is stored at
// half scale (weights and bias / 2), which turns the gating proj * sigmoid(gate)
// into p + p * tanh(g) of the half-scale products p, g. The rows of w_in carry
// their bias in the kBiasCols columns after the weights (hi and lo parts of the
// fp32 bias, hi rounded to the operand type, or to tf32), so the input stage
// adds it by giving its operand tile two columns of ones: kin = round16(P + 2),
// kp = round16(P), kh = round16(H). (The output stage adds its biases in fp32:
// bias rows in its h-major c tile would cost the shared memory of a second
// block per SM at H = 128.) w_out carries the output LayerNorm's scale,
// Wo[j][h] * gamma[h], and out_fold four fp32 vectors of kp entries: the row
// sums s[j] of the stored w_out, t[j] = Wo[j] . beta + bo[j], and the same two
// for w_gate (all at half scale), so the output stage can multiply c as it is
// and apply its LayerNorm afterwards: LN(c) . Wo^T + bo = rstd (c . W'^T - mean
// s) + t (the 16-bit stages; the fp32 ones normalize c first and add t). With
// gate_folded (gate from the normalized input) w_gate likewise carries the
// input LayerNorm's scale and its t is Wg[j] . beta_in + bg[j], so the gate's
// LayerNorm of x comes after its product too; else its t is bg[j]. Rows are
// stored kOperandRowPadBytes of zeros apart, the layout the stages give them in
// shared memory (the pad keeps the ldmatrix rows of a matrix in distinct
// banks), so a chunk of rows is one contiguous copy. With in_blocked (the wgmma
// input stage) each chunk of kOperandRowTile w_in rows instead holds them in
// wgmma's core-matrix layout (csrc/cuda/mma.cuh: CoreBlockedAt, a row in pieces
// of 16 bytes), its padding gathered at the chunk's end; chunks stay as
// far apart; with in_k_paired as well (the resident input stage, which loads x
// straight into wgmma's A fragment) the columns sit where that stage's threads
// hold x (k_paired_position), and w_in is folded (in_folded): its rows carry the
// input LayerNorm's scale, W[r][c] * gamma[c], and its bias columns the shift,
// b[r] + W[r] . beta, so the stage multiplies (x - mean) rstd as it is; where the
// backward stages the parameters (pair_in_layout), an unfolded copy of w_in follows
// the rest, for input_back, whose gradients want the affine in place. Offsets in
// elements of the operand type.
constexpr int64_t kOperandRowTile = 128;
constexpr int64_t kBiasCols = 2;
constexpr int64_t kOperandRowPadBytes = 16;
__host__ __device__ constexpr int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }
constexpr int64_t kOutFolds = 4;  // out_fold's vectors: s, t of w_out, then of w_gate
// The A fragment of a k16 step gives thread t of each quad columns 2t, 2t + 1, 2t + 8 and
// 2t + 9. The resident input stage loads x instead as 16 contiguous bytes per thread and pair of
// steps (x columns 32 u + 8 t .. + 7 for steps 2u and 2u + 1; an unpaired last step 8 bytes,
// 16 s + 4 t .. + 3): a quarter of the load instructions, each touching as many rows. The
// product is the same when w_in's columns move with x's: x column c lands at fragment column
// k_paired_position(c, kin) (kin = 16 steps), a permutation within each step pair.
__host__ __device__ constexpr int64_t k_paired_position(int64_t c, int64_t kin) {
  const int64_t paired = kin / 32 * 32;  // columns in whole step pairs
  const int64_t step = c < paired ? 2 * (c / 32) + c % 8 / 4 : c / 16;
  const int64_t t = c < paired ? c % 32 / 8 : c % 16 / 4, e = c % 4;
  return 16 * step + 2 * t + (e < 2 ? e : 8 + e - 2);
}
// The folded w_in (in_folded; not its plain copy) also has its rows reordered within each
// chunk of kOperandRowTile: the resident input stage's accumulator column 8 j + 2 t + e (thread t
// of a quad, e: projection or gate) is channel ab = j % 2 (a or b) of hidden unit
// 8 (j / 4) + 2 t + (j / 2) % 2 of the chunk, so the four lanes t of a staging store write rows
// 2 t (+ 1) of a 128-byte-swizzled tile: 32 distinct banks (ln_proj_gate_resident.cu). Chunk
// row 4 h + 2 ab + e in the natural order (trimul.forward's: proj_a, gate_a, proj_b, gate_b
// per hidden unit h) is stored at staged_in_row of it.
__host__ __device__ constexpr int64_t staged_in_row(int64_t r) {
  const int64_t e = r % 2, ab = r / 2 % 2, h = r / 4;
  const int64_t j = 4 * (h / 8) + 2 * (h % 2) + ab, t = h % 8 / 2;
  return 8 * j + 2 * t + e;
}
struct OperandLayout {
  bool in_blocked;      // w_in chunks in the core-matrix layout (16-bit and tf32 operands)
  bool in_k_paired;     // and their columns in k_paired_position's order (the resident input stage)
  bool gate_folded;     // w_gate times the input LayerNorm's scale (gate from the normalized input)
  bool tf32_rounded;    // float operands stored rounded to tf32 (precision tf32: the stages skip the rounding)
  bool in_folded;       // w_in times the input LayerNorm's scale, its shift in the bias columns, rows in
                        // staged_in_row's order (in_k_paired)
  int64_t kin, kp, kh;  // reduction widths; rows are kin + pad etc. apart
  int64_t pad;          // kOperandRowPadBytes in elements
  int64_t in_rows, out_rows;  // 4H and P, padded
  int64_t w_in, w_out, w_gate;  // [in_rows][kin + pad], [out_rows][kh + pad], [out_rows][kp + pad]
  int64_t out_fold;             // float [kOutFolds][kp] (16-byte aligned)
  int64_t w_in_plain;           // with in_folded, where asked: w_in without the fold, as w_in is laid out; else -1
  int64_t total;
  const RangeScales* range;     // fp16 operands for precision tf32 (RangeScales: x normalized already); else nullptr
};
OperandLayout operand_layout(int64_t P, int64_t H, int64_t elem_bytes, bool in_blocked, bool gate_folded);
// The resident input stage's form of an in_blocked layout: in_k_paired and in_folded, and with
// `plain_copy` (the backward's staging, which input_back reads) w_in_plain after the rest.
void pair_in_layout(OperandLayout& l, bool plain_copy);

// One launch: the fp32 pack (p.dst), and where `ol` is given the stored matrices in `dtype`
// at `operands` (laid out as *ol), both from the parameters' sources.
struct PackLaunch {  // (the launcher's plan: blocks for each part)
  int entry_start[kMaxPackEntries + 1];  // pack_params' blocks of entry e: [entry_start[e], entry_start[e + 1])
  int operand_blocks, fold_blocks, in_fold_blocks;
  OperandLayout ol;
  int64_t P, H;
  void* operands;
};
cudaError_t launch_pack(const PackParams& p, const OperandLayout* ol, int64_t P, int64_t H, void* operands,
                        DType dtype, cudaStream_t stream);

// ---- what both outer stages read ----------------------------------------------
struct Problem {
  const void* x;      // [B][N][N][P], last dim contiguous
  DType x_dtype;      // f32, bf16, f16
  bool x_rows_vec16;  // every x row starts 16-byte aligned and P * sizeof(x) % 16 == 0
  int64_t B, N, Npad, P, H;
  float eps;
  const float* params;  // packed, see PackedLayout
  PackedLayout layout;
  const void* operands;  // tensor-core stages: weights in the operand type, see OperandLayout
  OperandLayout op_layout;
  Precision precision;   // tensor-core stages at fp32: tf32, or ieee (3xTF32)
  const RangeScales* headroom;  // fp16 operands: c's headroom (the pack scaled w_in's projection rows); else nullptr
};

// ---- ln_proj_gate -----------------------------------------------------------
struct LnProjGateParams : Problem {
  int64_t x_stride_b, x_stride_r, x_stride_c;  // r: a's free index, c: contraction index
  const void* mask;   // nullptr: all ones
  DType mask_dtype;
  int64_t mask_stride_b, mask_stride_r, mask_stride_c;
  void* a;            // [B*H][Npad][Npad], element type ab_dtype
  void* b;
  DType ab_dtype;     // f32 (ieee, tf32), bf16, f16
  int64_t resident_blocks;  // > 0: the wgmma form may keep its weights resident, on this many blocks
  // The resident form only, where not nullptr: each position's LayerNorm statistics (mean, rstd)
  // of x at x_stats[2 ((b N + i) N + j)], i.e. at 2 (b N N + r stats_stride_r + c stats_stride_c)
  float* x_stats;
  int64_t stats_stride_r, stats_stride_c;
};
cudaError_t launch_ln_proj_gate(const LnProjGateParams& p, cudaStream_t stream);
// tensor-core form: ab_dtype is the operand type (bf16, f16; f32 read as tf32); products by
// wgmma (sm_90a code, a 9.0 device; not 3xTF32) where op_layout.in_blocked, which plan() sets;
// of those, the resident form (ln_proj_gate_resident.cu) where ln_proj_gate_resident_takes()
cudaError_t launch_ln_proj_gate_mma(const LnProjGateParams& p, cudaStream_t stream);
size_t ln_proj_gate_mma_smem(int64_t P, int64_t operand_bytes, int64_t raw_x_bytes);
// The wgmma input stage with all of w_in resident in shared memory, persistent blocks over tiles
// of 64 positions (16-bit x in the operand type, rows 16-byte aligned, P % 8 == 0, kin <= 144):
// its shared memory per block at (P, H), the larger of its forward and backward forms (SIZE_MAX
// where P is not a multiple of 8 or kin too wide), and whether it takes a call (resident_blocks
// set, and the conditions above).
size_t ln_proj_gate_resident_smem(int64_t P, int64_t H);
bool ln_proj_gate_resident_takes(const LnProjGateParams& p);
cudaError_t launch_ln_proj_gate_resident(const LnProjGateParams& p, cudaStream_t stream);

// The input stage's backward, front half (ln_proj_gate_mma.cu with kBack): the
// forward's LayerNorm and products for the positions of one chunk, then, from
// the contraction's gradients da and db, the gating gradients
//   dpre[4 h + k] = d(proj_a | gate_a | proj_b | gate_b)[h]  (k = 0..3: PackedLayout's w_in rows)
// and xn = LayerNorm(x) as the products read it (zero where a 0/1 mask is 0, where
// dpre is 0 too). The chunk is batch entries [b0, b1) and natural rows i in
// [lo, hi) of the pair; row n of dpre and xn is position (b, i, j) at
// n = ((b - b0) (hi - lo) + i - lo) N + j. Incoming chunks want lo % 8 == 0
// (da and db are read in 16-byte runs along the contraction's c = i). The
// column sums of dpre (the input biases' gradients, packed order) by blocks
// into partial, then in order (launch_column_sums).
struct InputBackParams {
  LnProjGateParams in;      // the forward's problem; in.a and in.b unused
  const void* da;           // [B*H][Npad][Npad], in.ab_dtype, as the forward's a
  const void* db;
  void* dpre;               // [rows][4H], in.ab_dtype; where dx: rstd dpre (rstd: the row's LayerNorm)
  void* xn;                 // [rows][P], in.ab_dtype; not written where dx
  float* partial;           // [input_back_blocks][4H], + 2P with dx
  int64_t b0, b1, lo, hi;
  bool incoming;
  // Where not nullptr (input_back_finishes): the resident form also forms du = dpre W_in and
  // LayerNorm's gradient, into dx ([B][N][N][P] contiguous, x's dtype = the operand type; x
  // contiguous too): its rows hold the gate input's gradient, added to LayerNorm's output
  // gradient (residual_before: the gate reads the normalized input) or to its input gradient,
  // and take the pair's. partial's rows then end with the column sums of g xhat and g (P each).
  // dpre's rows then hold q = rstd dpre and xn is not written: with xn = xhat gamma + beta and
  // xhat = (x - mean) rstd, dpre^T xn = (q^T x - m 1^T) diag(gamma) + sum(dpre) beta^T, m the row
  // means of q^T x (each row of xhat sums to 0): centered_rows.
  void* dx;
  bool residual_before;
  // Where not nullptr: da and db carry a scale, each value read times grad->unscale (the chunked
  // form only: GradScale).
  const GradScale* grad;
};
// input_back_blocks: the rows of partial a launch writes. Where the forward's resident form
// would take the chunk's problem (in.resident_blocks set: ln_proj_gate_resident_takes), the
// backward runs in that kernel too (input_back_resident_*: one row of partial sums per
// warpgroup), else in the chunked one.
int64_t input_back_blocks(const InputBackParams& p);
// shared memory per block of input_back's chunked form (the tensor-core stage's tiles and its
// column sums) at P with the operand type and x's type's sizes (raw_x_bytes 0: x in the operand type)
size_t input_back_smem(int64_t P, int64_t operand_bytes, int64_t raw_x_bytes);
cudaError_t launch_input_back(const InputBackParams& p, cudaStream_t stream);
// Whether the launch also finishes the input stage's backward (InputBackParams::dx): the resident
// form at P = 128 with four weight chunks (H in (96, 128]).
bool input_back_finishes(const InputBackParams& q);
bool input_back_resident_takes(const InputBackParams& q);
int64_t input_back_resident_rows(const InputBackParams& q);
cudaError_t launch_input_back_resident(const InputBackParams& q, cudaStream_t stream);

// ---- triangle_gemm ----------------------------------------------------------
// Which product of the [Npad][Npad] planes: c = a b^T (the forward's contraction), a b, a^T b.
enum class GemmForm { ab_t, a_b, at_b };
struct TriangleGemmParams {
  const void* a;  // [batch][Npad][Npad], in the operand type (fp32 for tf32 and ieee)
  const void* b;
  void* c;        // [batch][Npad][Npad], in the operand type
  int64_t batch, Npad;
  Precision precision;  // tf32, ieee (the form ab_t only), bf16, fp16
  GemmForm form;
};
cudaError_t launch_triangle_gemm(const TriangleGemmParams& p, cudaStream_t stream);

// ---- ln_out_proj_gate -------------------------------------------------------
struct LnOutProjGateParams : Problem {
  int64_t x_stride_b, x_stride_i, x_stride_j;  // unswapped
  const void* c;      // [B*H][Npad][Npad]
  DType c_dtype;      // f32, bf16, f16
  bool gate_from_normalized;  // gate_input == "normalized"
  void* out;          // [B][N][N][P] contiguous, x's dtype (fp32 where op_layout.range: resident form)
  int64_t resident_blocks;  // > 0: the 16-bit form may keep its weights resident, on this many blocks
  // The resident form only, where not nullptr: x's LayerNorm statistics as the input stage
  // wrote them (LnProjGateParams::x_stats), which the gate then reads instead of computing; in
  // the fp32-output form (op_layout.range) range_normalize's (-mean rstd, 2^-gate_log2 / rstd) for
  // the gate from x, which reads xhat
  const float* x_stats;
};
cudaError_t launch_ln_out_proj_gate(const LnOutProjGateParams& p, cudaStream_t stream);
// tensor-core form: c_dtype is the operand type (bf16, f16; f32 read as tf32)
cudaError_t launch_ln_out_proj_gate_mma(const LnOutProjGateParams& p, cudaStream_t stream);
size_t ln_out_proj_gate_mma_smem(int64_t P, int64_t H, int64_t operand_bytes, int64_t raw_x_bytes);
// The 16-bit output stage with w_out and w_gate resident in shared memory (sm_90a), persistent
// blocks over tiles of 64 positions: where resident_blocks is set, c and x have the 16-bit
// operand type, x's rows are 16-byte aligned and P, H are multiples of 8 in (112, 128].
bool ln_out_proj_gate_resident_takes(const LnOutProjGateParams& p);
size_t ln_out_proj_gate_resident_smem();
cudaError_t launch_ln_out_proj_gate_resident(const LnOutProjGateParams& p, cudaStream_t stream);

// ---- pair_layout (the backward's layout changes) -------------------------------
// Copies between a pair tensor channel-first, pair[b][h][s1][s2] (strides
// stride_b, stride_h, stride_s, 1; S x S with N x N used), and position-major,
// rows[b][p][q][h] (contiguous): rows[b][p][q][h] = pair[b][h][p][q], or
// pair[b][h][q][p] with `swap`. Towards the pair tensor the positions past N
// are written as zeros. Same element type on both sides (f32, bf16, f16).
struct PairLayoutParams {
  DType dtype;
  void* pair;
  void* rows;
  int64_t B, H, N, S;
  int64_t stride_b, stride_h, stride_s;
  bool swap;
  bool to_rows;
  // Where `range` is set, the pair in fp16 (`dtype` f16) and the rows in fp32, for precision tf32
  // on the fp16 stages: to_rows, c's values times 2^-range_c_log2 (range.cuh; the scale undone);
  // else the backward's dc, each value times 2^grad_log2 of *grad (GradScale) rounded to fp16, and
  // grad->unscale written with `range`'s d.
  GradScale* grad;
  const RangeScales* range;
};
cudaError_t launch_pair_layout(const PairLayoutParams& p, cudaStream_t stream);

// ---- backward_rows (the backward's per-position elementwise work) -------------
// Row-wise kernels over `rows` contiguous rows (positions) of up to
// kMaxRowsLen values, every value in fp32 whatever the storage types. Column
// sums: each of the `blocks` blocks (backward_rows_blocks) writes its row of
// partial[blocks][sum_cols], then a second kernel adds the rows in order into
// sums[sum_cols] (no atomics: bitwise repeatable on a given GPU).
constexpr int64_t kMaxRowsLen = 512;
enum class RowsOp : int32_t {
  layer_norm = 0,       // out = LN(src; w, b)
  gate_grads = 1,       // s = sigmoid(gpre): dy = G s, dgp = dy y (1 - s); sums of dy, dgp
  gating_grads = 2,     // d(pa, ga, pb, gb) from pre and the masked da, db; sums of them
  layer_norm_back = 3,  // out = LN's input gradient from g (+ residual); sums of g xhat, g
};
enum class Residual : int32_t { none = 0, before = 1, after = 2 };  // added to g, or to the result
struct RowsParams {
  RowsOp op;
  int64_t rows, len;  // len: the row length of src (layer_norm*), y (gate_grads), da (gating_grads)
  float eps;
  bool vec;  // len % 4 == 0 and every row tensor 16-byte aligned: rows read and written 4 values at a time
  const void* src; DType src_dtype;    // layer_norm*: the normalized rows; gate_grads: y; gating_grads: pre (4 len)
  const void* src2; DType src2_dtype;  // gate_grads: gpre; gating_grads: da; layer_norm_back: g
  const void* src3; DType src3_dtype;  // gate_grads: G; gating_grads: db; layer_norm_back: the residual
  const float* mask;                   // gating_grads: one per row, or nullptr
  const float* w; const float* b;      // LayerNorm affine (fp32)
  Residual residual;
  void* out; DType out_dtype;          // layer_norm*: the result; gate_grads: dy; gating_grads: dpre (da's dtype)
  void* out2;                          // gate_grads: dgp (out_dtype)
  float* partial;                      // workspace [blocks][sum_cols] (not layer_norm)
  float* sums;                         // [sum_cols] (not layer_norm)
};
int64_t backward_rows_blocks(const RowsParams& p, int sm_count);  // on a GPU of sm_count SMs
int64_t backward_rows_sum_cols(const RowsParams& p);
cudaError_t launch_backward_rows(const RowsParams& p, int64_t blocks, cudaStream_t stream);

// sums[c] = the sum over rows r < blocks, in order, of partial[r][c] (c < cols).
cudaError_t launch_column_sums(const float* partial, int64_t blocks, int64_t cols, float* sums, cudaStream_t stream);

// ---- out_stage_back (the output stage's backward, one kernel) -----------------
// Over the positions of lines [line0, line0 + lines) (line = b N + i; every j <
// N), for 16-bit operands (bf16, f16: c, the weights, the position-major
// outputs) with P and H multiples of 16 up to kOutBackMaxWidth; every value in
// fp32 between the products:
//   chat = (c - mean) rstd, y = chat . (Wo gamma)^T + Wo . beta + bo
//   u = LayerNorm(x) (gate_from_normalized) or x, s = sigmoid(u . Wg^T + bg), where from x
//     u . Wg^T adds mean(x) g_round to the product with Wg as stored: x's mean through
//     Wg's rounding, which a gate of saturated x (|g| >> 1) turns into a relative
//     error of its gradients (benchmarks/NOTES.md, "The output gate's gradients")
//   dy = G s, dgp = dy y (1 - s), dh = dy . (Wo gamma) (dcn gamma, dcn = dy . Wo), dx = dgp . Wg
//   dc = LayerNorm's input gradient for dcn: rstd (dh - mean(dh) - chat mean(dh chat))
// dc replaces c in place (the positions past N are not written); dx is
// written at the lines' positions; chat, u, dy and dgp come back
// position-major, [lines N][H or P], for the weight gradients' products; and
// the column sums over the positions, sum(dy), sum(dgp) [P each], by rows of
// partial (one per tile group), then in order (launch_column_sums). (The
// affine's gradients, sum(dcn chat) and sum(dcn), are sum_p Wo (dy^T chat) and
// Wo^T sum(dy).) The resident form writes no u (OutStageBackParams::u unused:
// u is x there, or LayerNorm(x) = (x - mean) rstd gamma + beta); with the gate
// reading LayerNorm(x) (OutBackLaunch::gate_centered) dgp leaves as q = rstd dgp
// (x's rstd), so that dgp^T u = (q^T x - m 1^T) diag(gamma) + sum(dgp) beta^T,
// m = q^T mean: the row means of q^T x.
constexpr int64_t kOutBackMaxWidth = 128;
constexpr int64_t kOutBackTileRows = 32;  // positions j of one line per tile
struct OutStageBackParams {
  int64_t B, N, Npad, P, H;
  int64_t line0, lines;     // line0 + lines and lines ceil(N / kOutBackTileRows) below 2^31 (32-bit tile indices)
  float eps;
  bool gate_from_normalized;
  DType op_dtype;       // bf16, f16
  DType x_dtype;        // x, G and dx: f32, bf16, f16
  int sms;              // the device's multiprocessors (persistent blocks, at most one each)
  int smem_optin;       // its shared memory per block
  int cc;               // its compute capability (major * 10 + minor)
  bool wgmma;           // a 9.0 device and a build with sm_90a code: the resident form may run
  void* c;              // [B*H][Npad][Npad], op_dtype; dc on return
  const void* x;        // [B][N][N][P] contiguous
  const void* grad;     // G, [B][N][N][P] contiguous
  const void* wo_g;     // [P][H]: Wo[p][h] gamma_out[h]
  const void* wg;       // [P][P]: Wg
  const float* s_out;   // [P]: the row sums of wo_g as stored
  const float* t_out;   // [P]: Wo . beta_out + bo
  const float* b_gate;  // [P]
  const float* g_round;  // [P]: sum over q of (Wg - Wg as stored)[p][q]; the gate from x adds mean(x) times it
  const float* ln_in_w;   // [P] (16-byte aligned, as ln_in_b)
  const float* ln_in_b;
  void* dx;             // [B][N][N][P] contiguous, x_dtype
  void* chat; void* u; void* dy; void* dgp;  // position-major, op_dtype (u: not the resident form's)
  float* partial;       // [OutBackLaunch rows][2P]
  float* sums;          // [2P]: sum(dy), sum(dgp)
  const RangeScales* headroom;  // fp16 operands: c's headroom (c's LayerNorm eps times 2^-4t); else nullptr
};
// How out_stage_back runs p (out_stage_back_launch plans it, launch_out_stage_back
// follows the plan): `blocks` persistent blocks of `groups` tile groups (the
// resident form: warps, each keeping its own column sums); partial has blocks *
// groups rows. The resident form (out_stage_back_resident.cu: sm_90a, P = H = 128,
// x in the operand type) where it takes p, else out_stage_back.cu's.
struct OutBackLaunch {
  int64_t blocks;
  int groups;
  bool resident;
  bool gate_centered;  // the resident form with the gate reading LayerNorm(x): dgp is q = rstd dgp
};
OutBackLaunch out_stage_back_launch(const OutStageBackParams& p);
bool out_stage_back_resident_takes(const OutStageBackParams& p);
OutBackLaunch out_stage_back_resident_launch(const OutStageBackParams& p);
cudaError_t launch_out_stage_back_resident(const OutStageBackParams& p, int64_t blocks, cudaStream_t stream);
// Shared memory of a block of its narrower form (the least it runs with), whatever P and H.
size_t out_stage_back_smem();
cudaError_t launch_out_stage_back(const OutStageBackParams& p, const OutBackLaunch& run, cudaStream_t stream);

// ---- the fused backward's parameter-sized work (backward_params.cu) -------------
// out_back_weights: from the fp32 pack (PackedLayout), the output stage's weights as
// out_stage_back reads them: wo_g = Wo gamma_out and wg = Wg in the operand type ([P][H],
// [P][P]), s_out = the row sums of wo_g as stored and t_out = Wo beta_out + bo ([P], fp32).
struct OutBackWeightsParams {
  const float* packed;
  PackedLayout layout;
  int64_t P, H;
  DType op_dtype;  // bf16, f16
  void* wo_g; void* wg;
  float* s_out; float* t_out;
  float* g_round;  // [P]: OutStageBackParams::g_round
};
cudaError_t launch_out_back_weights(const OutBackWeightsParams& p, cudaStream_t stream);

// param_grads: the 16 parameters' gradients, fp32, one after another in trimul.forward's order
// and shapes (param_grads_size floats), from what the backward's kernels and products leave:
// the input LayerNorm's column sums, w_in's and b_in's gradients in the pack's interleaved row
// order, dy^T chat and Wg's gradient (each in the operand type, or fp32 where summed over
// chunks), the column sums of dy and dgp, and the pack (Wo and the output LayerNorm's affine).
struct ParamGradsParams {
  const float* packed;
  PackedLayout layout;
  int64_t P, H;
  const float* in_sums;                     // [2P]: sum(g xhat), sum(g)
  const void* d_w_in; DType d_w_in_dtype;   // [4H][P], row 4 h + k
  const float* d_b_in;                      // [4H], the same order
  const void* m_wo; DType m_wo_dtype;       // [P][H]: dy^T chat
  const void* d_wg; DType d_wg_dtype;       // [P][P]: dgp^T u, or q^T x where gate_centered
  const float* gate_sums;                   // [2P]: sum(dy), sum(dgp)
  bool gate_centered;                       // (OutBackLaunch::gate_centered)
  bool in_centered;                         // d_w_in is q^T x (fp32: InputBackParams::dx)
  // fp16 operands under c's headroom: d_w_in's and d_b_in's projection rows (k = 0, 2) are the
  // gradients of the weights as the pack stored them, times 2^-t, so the result takes them times
  // 2^-t (range_headroom_log2); else nullptr
  const RangeScales* headroom;
  float* grads;
};
int64_t param_grads_size(int64_t P, int64_t H);
cudaError_t launch_param_grads(const ParamGradsParams& p, cudaStream_t stream);
// out[r][c] = (raw[r][c] - mean_c raw[r]) gamma[c] + sums[r] beta[c] for r < rows, c < cols (all
// fp32, contiguous): a weight gradient from q^T x (InputBackParams::dx), as param_grads forms
// the centered ones itself.
cudaError_t launch_centered_rows(const float* raw, const float* gamma, const float* beta, const float* sums,
                                 int64_t rows, int64_t cols, float* out, cudaStream_t stream);

// ---- range.cu: precision tf32 on the fp16 stages (RangeScales) --------------
// The bounds from the parameters' sources (a warp per row): proj_log2's from
// |proj_h| <= sqrt(P) |W_h * gamma_in| + |b_h + W_h . beta_in| over both projections' rows,
// out_log2's from |y_p| <= sqrt(H) |Wo_p * gamma_out| + |Wo_p . beta_out + bo_p|, gate_log2's
// the same way over the input gates' rows and w_gate's (with the input LayerNorm's affine where
// the gate is folded, else of the stored weights alone); ab_log2, and mask_amax 1 where there is
// no mask.
cudaError_t launch_range_scales(const PackParams& p, int64_t N, int64_t P, int64_t H, RangeScales* out,
                                bool has_mask, bool gate_folded, cudaStream_t stream);
// c's headroom at fp16 operands: into `out` (zeroed before), one launch, the projections' bound
// proj_bound as launch_range_scales forms it (the projection rows alone), ab_log2, and mask_amax:
// the largest finite |mask| (1 without a mask); where `scale` is given, a second launch (one
// thread) writes 2^-t there, what the projections are multiplied by, as an fp32 value.
struct RangeHeadroomParams {
  PackParams pack;  // the parameters' sources (pack_entries with no destination)
  const void* mask;  // nullptr: none
  DType mask_dtype;
  int64_t mask_stride_b, mask_stride_i, mask_stride_j;
  int64_t B, N, P, H;
  RangeScales* scales;
  float* scale;  // nullptr: not wanted
};
cudaError_t launch_range_headroom(const RangeHeadroomParams& p, int sm_count, cudaStream_t stream);
// xhat = (x - mean) rsqrt(var + eps) of every position (fp32 statistics), as fp16 into a
// contiguous [B][N][N][P], with x = xhat / rstd + mean into x_stats where wanted (the output
// stage's gate from x: Wg x = (Wg xhat) / rstd + mean sum(Wg), the gate's weights stored times
// 2^gate_log2, which the second statistic undoes); and the largest finite |mask| into
// scales->mask_amax.
struct RangeNormalizeParams {
  const float* x;  // last dim contiguous
  int64_t x_stride_b, x_stride_i, x_stride_j;
  const void* mask;  // nullptr: none
  DType mask_dtype;
  int64_t mask_stride_b, mask_stride_i, mask_stride_j;
  int64_t B, N, P;
  float eps;
  void* xhat;  // fp16
  float* x_stats;  // nullptr, or (-mean rstd, 2^-gate_log2 / rstd) a position (natural order): the gate from x
  RangeScales* scales;
};
cudaError_t launch_range_normalize(const RangeNormalizeParams& p, int sm_count, cudaStream_t stream);
// The largest |value| of `count` fp32 values (a multiple of 4, 16-byte aligned) into g->amax.
cudaError_t launch_range_grad_amax(const float* src, int64_t count, GradScale* g, int sm_count, cudaStream_t stream);

// ---- fused_small -------------------------------------------------------------
// A parameter as fused_small reads it: element (r, c) at ptr[r * ld + c], of
// the call's weight dtype; ptr == nullptr reads `fill` everywhere.
struct ParamRef {
  const void* ptr;
  int64_t ld;
  float fill;
};

// The whole update in one cooperative launch; every product at fp32 accuracy (the
// input projections as 3xTF32 on tensor cores, the rest in fp32 on CUDA cores),
// whatever the precision (its accuracy is the "ieee" one).
struct FusedSmallParams {
  const void* x;  // [B][N][N][P], any strides; read as LnProjGateParams does
  DType x_dtype;  // f32, bf16, f16
  int64_t x_stride_b, x_stride_r, x_stride_c;  // r: a's free index, c: contraction index
  const void* mask;  // nullptr: all ones
  DType mask_dtype;
  int64_t mask_stride_b, mask_stride_r, mask_stride_c;
  bool incoming;              // (r, c) is output position (c, r)
  bool gate_from_normalized;  // gate_input == "normalized"
  int64_t B, N, P, H;
  float eps;
  DType w_dtype;  // of every parameter: f32, or x_dtype (the binding packs other mixes to f32)
  ParamRef ln_in_w, ln_in_b, w_in[4], b_in[4];  // w_in / b_in: proj_a, gate_a, proj_b, gate_b
  ParamRef ln_out_w, ln_out_b, w_out, b_out, w_gate, b_gate;
  float* workspace;  // fused_small_workspace(B, N, P, H) floats
  void* out;         // [B][N][N][P] contiguous, x's dtype
};
int64_t fused_small_workspace(int64_t B, int64_t N, int64_t P, int64_t H);
// Dynamic shared memory per block for this shape (must fit the device's opt-in limit).
size_t fused_small_smem(int64_t B, int64_t N, int64_t P, int64_t H);
cudaError_t launch_fused_small(const FusedSmallParams& p, int sm_count, cudaStream_t stream);  // on a GPU of sm_count SMs

}  // namespace trimul
