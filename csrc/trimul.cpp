// The one file that touches torch: argument checks, workspace allocation,
// dispatch and launch of the forward kernels (csrc/cuda/), through the LibTorch
// stable ABI. Public argument validation (shapes, names, messages) lives in
// trimul/ops.py, which calls this internal op with resolved options; the checks
// here only guard the kernels' own assumptions.
#include <Python.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <optional>

#include "trimul.h"

extern "C" {
// An empty module: importing trimul._C loads this library and runs the
// operator registrations below.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace trimul {
namespace {

using torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::headeronly::ScalarType;

DType dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case ScalarType::Float: return DType::f32;
    case ScalarType::Double: return DType::f64;
    case ScalarType::BFloat16: return DType::bf16;
    case ScalarType::Half: return DType::f16;
    case ScalarType::Bool: return DType::b8;
    case ScalarType::Byte: return DType::u8;
    case ScalarType::Char: return DType::i8;
    case ScalarType::Short: return DType::i16;
    case ScalarType::Int: return DType::i32;
    case ScalarType::Long: return DType::i64;
    default: break;
  }
  STD_TORCH_CHECK(false, "trimul: ", name, " has an unsupported dtype");
  return DType::f32;
}

// The one place that picks kernels for a call.
struct Plan {
  // Tensor-core input/output stages (16-bit operands), else fp32 CUDA-core tiles.
  bool mma_stages;
};

Plan plan(int64_t P, int64_t H, Precision precision, DType x_dtype, int device) {
  constexpr int kMaxDevices = 64;
  static int max_smem[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return Plan{false};
  if (max_smem[device] == 0 &&
      cudaDeviceGetAttribute(&max_smem[device], cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
    cudaGetLastError();  // no such device: leave no error behind for the next launch check
    return Plan{false};
  }
  const bool sixteen_bit = precision == Precision::bf16 || precision == Precision::fp16;
  if (!sixteen_bit) return Plan{false};
  const DType operand = precision == Precision::bf16 ? DType::bf16 : DType::f16;
  const int64_t raw_x_bytes = x_dtype == operand ? 0 : x_dtype == DType::f32 ? 4 : 2;
  const size_t limit = static_cast<size_t>(max_smem[device]);
  return Plan{ln_proj_gate_mma_smem(P, raw_x_bytes) <= limit && ln_out_proj_gate_mma_smem(P, H, raw_x_bytes) <= limit};
}

// Whether every row of x (channel-contiguous) starts 16-byte aligned and spans a
// whole number of 16-byte pieces, so the tensor-core stages can cp.async it.
bool rows_vec16(const Tensor& x, int64_t elem_bytes) {
  const auto s = x.strides();
  const bool strides_ok = (s[0] * elem_bytes) % 16 == 0 && (s[1] * elem_bytes) % 16 == 0 && (s[2] * elem_bytes) % 16 == 0;
  return strides_ok && (x.sizes()[3] * elem_bytes) % 16 == 0 && reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0;
}

void check_cuda(cudaError_t e, const char* stage) {
  STD_TORCH_CHECK(e == cudaSuccess, "trimul: ", stage, " failed: ", cudaGetErrorString(e));
}

// Adds one parameter (or its default) to the pack: `t` is a (rows x cols)
// matrix, or a vector laid out as one row (rows == 1) or one column (cols == 1).
void add_entry(PackParams& pack, const OptTensor& t, int64_t rows, int64_t cols, int64_t offset,
               int64_t dst_row_stride, float fill, const char* name) {
  PackEntry e{};
  e.rows = rows;
  e.cols = cols;
  e.offset = offset;
  e.dst_row_stride = dst_row_stride;
  e.fill = fill;
  if (t.has_value()) {
    const Tensor& v = *t;
    STD_TORCH_CHECK(v.numel() == rows * cols, "trimul: ", name, " has ", v.numel(), " elements, expected ",
                    rows * cols);
    e.ptr = v.const_data_ptr();
    e.dtype = dtype_of(v, name);
    if (v.dim() == 2) {
      e.stride_r = v.strides()[0];
      e.stride_c = v.strides()[1];
    } else {  // a vector walks whichever of rows or cols it spans
      e.stride_r = rows > 1 ? v.strides()[0] : 0;
      e.stride_c = rows > 1 ? 0 : v.strides()[0];
    }
  }
  STD_TORCH_CHECK(pack.count < kMaxPackEntries, "trimul: too many parameters");
  pack.entry[pack.count++] = e;
}

Tensor forward_cuda(const Tensor& x, const OptTensor& mask, const OptTensor& ln_in_weight,
                    const OptTensor& ln_in_bias, const Tensor& proj_a_weight, const OptTensor& proj_a_bias,
                    const Tensor& gate_a_weight, const OptTensor& gate_a_bias, const Tensor& proj_b_weight,
                    const OptTensor& proj_b_bias, const Tensor& gate_b_weight, const OptTensor& gate_b_bias,
                    const OptTensor& ln_out_weight, const OptTensor& ln_out_bias, const Tensor& out_proj_weight,
                    const OptTensor& out_proj_bias, const Tensor& out_gate_weight, const OptTensor& out_gate_bias,
                    int64_t direction, int64_t gate_input, double eps, int64_t precision) {
  STD_TORCH_CHECK(x.dim() == 4, "trimul: x must be (B, N, N, P), got ", x.dim(), " dims");
  STD_TORCH_CHECK(x.strides()[3] == 1, "trimul: x's channel dimension must be contiguous");
  const DType x_dtype = dtype_of(x, "x");
  STD_TORCH_CHECK(x_dtype == DType::f32 || x_dtype == DType::bf16 || x_dtype == DType::f16,
                  "trimul: the CUDA kernels take float32, bfloat16 or float16 x");
  STD_TORCH_CHECK(direction == 0 || direction == 1, "trimul: bad direction code ", direction);
  STD_TORCH_CHECK(precision >= 0 && precision <= 3, "trimul: bad precision code ", precision);
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const int64_t H = proj_a_weight.sizes()[0];
  const int64_t Npad = padded_extent(N);

  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  void* stream_ptr = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(x.get_device_index(), &stream_ptr));
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  if (B * N * N * P == 0) return torch::stable::new_empty(x, {B, N, N, P});

  const PackedLayout layout = packed_layout(P, H);
  Tensor params = torch::stable::new_empty(x, {layout.total}, ScalarType::Float);
  PackParams pack{};
  pack.dst = static_cast<float*>(params.mutable_data_ptr());
  add_entry(pack, ln_in_weight, 1, P, layout.ln_in_w, 0, 1.f, "ln_in_weight");
  add_entry(pack, ln_in_bias, 1, P, layout.ln_in_b, 0, 0.f, "ln_in_bias");
  const Tensor* w_in[4] = {&proj_a_weight, &gate_a_weight, &proj_b_weight, &gate_b_weight};
  const OptTensor* b_in[4] = {&proj_a_bias, &gate_a_bias, &proj_b_bias, &gate_b_bias};
  const char* w_names[4] = {"proj_a_weight", "gate_a_weight", "proj_b_weight", "gate_b_weight"};
  const char* b_names[4] = {"proj_a_bias", "gate_a_bias", "proj_b_bias", "gate_b_bias"};
  for (int q = 0; q < 4; ++q) {  // interleaved rows 4h + q, see PackedLayout
    add_entry(pack, *w_in[q], H, P, layout.w_in + q * P, 4 * P, 0.f, w_names[q]);
    add_entry(pack, *b_in[q], H, 1, layout.b_in + q, 4, 0.f, b_names[q]);
  }
  add_entry(pack, ln_out_weight, 1, H, layout.ln_out_w, 0, 1.f, "ln_out_weight");
  add_entry(pack, ln_out_bias, 1, H, layout.ln_out_b, 0, 0.f, "ln_out_bias");
  add_entry(pack, out_proj_weight, P, H, layout.w_out, H, 0.f, "out_proj_weight");
  add_entry(pack, out_proj_bias, 1, P, layout.b_out, 0, 0.f, "out_proj_bias");
  add_entry(pack, out_gate_weight, P, P, layout.w_gate, P, 0.f, "out_gate_weight");
  add_entry(pack, out_gate_bias, 1, P, layout.b_gate, 0, 0.f, "out_gate_bias");
  check_cuda(launch_pack_params(pack, stream), "pack_params");

  const Precision prec = static_cast<Precision>(precision);
  const ScalarType ab_type = prec == Precision::bf16   ? ScalarType::BFloat16
                             : prec == Precision::fp16 ? ScalarType::Half
                                                       : ScalarType::Float;
  const Plan kernels = plan(P, H, prec, x_dtype, x.get_device_index());
  const int64_t x_bytes = x_dtype == DType::f32 ? 4 : 2;
  const OperandLayout op_layout = operand_layout(P, H);
  std::optional<Tensor> operands;
  if (kernels.mma_stages) {
    operands = torch::stable::new_empty(x, {op_layout.total}, ab_type);
    check_cuda(launch_pack_operands(pack.dst, layout, op_layout, P, H, operands->mutable_data_ptr(),
                                    prec == Precision::fp16 ? DType::f16 : DType::bf16, stream),
               "pack_operands");
  }

  Problem prob{};
  prob.x = x.const_data_ptr();
  prob.x_dtype = x_dtype;
  prob.x_rows_vec16 = rows_vec16(x, x_bytes);
  prob.B = B;
  prob.N = N;
  prob.Npad = Npad;
  prob.P = P;
  prob.H = H;
  prob.eps = static_cast<float>(eps);
  prob.params = pack.dst;
  prob.layout = layout;
  prob.operands = operands ? operands->const_data_ptr() : nullptr;
  prob.op_layout = op_layout;

  // The contraction's output, in the operand type for 16-bit precisions.
  Tensor c = torch::stable::new_empty(x, {B * H, Npad, Npad}, ab_type);
  {  // a and b live only until the contraction has read them
    Tensor a = torch::stable::new_empty(x, {B * H, Npad, Npad}, ab_type);
    Tensor b = torch::stable::new_empty(x, {B * H, Npad, Npad}, ab_type);

    // "incoming" contracts over x's first spatial index: read x transposed.
    const bool incoming = direction == 0;
    LnProjGateParams in{};
    static_cast<Problem&>(in) = prob;
    in.x_stride_b = x.strides()[0];
    in.x_stride_r = incoming ? x.strides()[2] : x.strides()[1];
    in.x_stride_c = incoming ? x.strides()[1] : x.strides()[2];
    if (mask.has_value()) {
      const Tensor& m = *mask;
      STD_TORCH_CHECK(m.dim() == 3, "trimul: mask must be (B, N, N)");
      in.mask = m.const_data_ptr();
      in.mask_dtype = dtype_of(m, "mask");
      in.mask_stride_b = m.strides()[0];
      in.mask_stride_r = incoming ? m.strides()[2] : m.strides()[1];
      in.mask_stride_c = incoming ? m.strides()[1] : m.strides()[2];
    }
    in.a = a.mutable_data_ptr();
    in.b = b.mutable_data_ptr();
    in.ab_dtype = dtype_of(a, "a");
    check_cuda(kernels.mma_stages ? launch_ln_proj_gate_mma(in, stream) : launch_ln_proj_gate(in, stream),
               "ln_proj_gate");

    TriangleGemmParams tg{};
    tg.a = a.const_data_ptr();
    tg.b = b.const_data_ptr();
    tg.c = c.mutable_data_ptr();
    tg.batch = B * H;
    tg.Npad = Npad;
    tg.precision = prec;
    check_cuda(launch_triangle_gemm(tg, stream), "triangle_gemm");
  }

  Tensor out = torch::stable::new_empty(x, {B, N, N, P});
  LnOutProjGateParams op{};
  static_cast<Problem&>(op) = prob;
  op.x_stride_b = x.strides()[0];
  op.x_stride_i = x.strides()[1];
  op.x_stride_j = x.strides()[2];
  op.c = c.const_data_ptr();
  op.c_dtype = dtype_of(c, "c");
  op.gate_from_normalized = gate_input == 1;
  op.out = out.mutable_data_ptr();
  check_cuda(kernels.mma_stages ? launch_ln_out_proj_gate_mma(op, stream) : launch_ln_out_proj_gate(op, stream),
             "ln_out_proj_gate");
  return out;
}

// What plan() picks for a call: 1 for the tensor-core stages, 0 for the fp32 CUDA-core stages.
int64_t plan_query(int64_t P, int64_t H, int64_t precision, int64_t x_dtype, int64_t device) {
  STD_TORCH_CHECK(precision >= 0 && precision <= 3, "trimul: bad precision code ", precision);
  return plan(P, H, static_cast<Precision>(precision), static_cast<DType>(x_dtype), static_cast<int>(device)).mma_stages
             ? 1
             : 0;
}

}  // namespace
}  // namespace trimul

STABLE_TORCH_LIBRARY_FRAGMENT(trimul, m) {
  m.def("_plan(int P, int H, int precision, int x_dtype, int device) -> int");
  m.def(
      "_forward_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, int direction, int gate_input, float eps, "
      "int precision) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(trimul, CUDA, m) { m.impl("_forward_cuda", TORCH_BOX(&trimul::forward_cuda)); }
STABLE_TORCH_LIBRARY_IMPL(trimul, CompositeExplicitAutograd, m) { m.impl("_plan", TORCH_BOX(&trimul::plan_query)); }
