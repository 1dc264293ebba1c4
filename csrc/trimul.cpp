// The one file that touches torch: argument checks, workspace allocation,
// dispatch and launch of the forward kernels (csrc/cuda/), through the LibTorch
// stable ABI. Public argument validation (shapes, names, messages) lives in
// trimul/ops.py, which calls this internal op with resolved options; the
// forward's entry checks every argument too (check_arguments), so that the eager
// path can leave the Python checks for wording an error once one is found.
#include <Python.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "blas_lt.h"
#include "trimul.h"

namespace trimul {
bool input_back_takes_call(int64_t P, int64_t H, int64_t precision, int64_t x_dtype, int64_t device);
std::vector<std::array<int64_t, 4>> chunks_call(int64_t B, int64_t N, int64_t step);
bool own_contraction_call(int64_t batch, int64_t N, int64_t precision, bool matmul_tf32);
bool timed_pick_call(int64_t batch, int64_t Npad);
bool range_takes_call(int64_t B, int64_t N, int64_t P, int64_t H, int64_t device);
bool range_backward_takes_call(int64_t P, int64_t H, int64_t device);
}

extern "C" {
// trimul._C.input_back_takes(P, H, precision, x_dtype, device) (codes of trimul._codes): whether
// trimul::_input_stage_back_cuda takes the backward of such calls (at every B and N).
static PyObject* input_back_takes(PyObject*, PyObject* args) {
  long P = 0, H = 0, precision = 0, x_dtype = 0, device = 0;
  if (!PyArg_ParseTuple(args, "lllll", &P, &H, &precision, &x_dtype, &device)) return nullptr;
  return PyBool_FromLong(trimul::input_back_takes_call(P, H, precision, x_dtype, device));
}

// trimul._C.chunks(B, N, step): the chunks (b0, b1, i0, i1) the backward's ops take for a
// chunk size `step` (trimul/backward.py's _chunks, which a package without this module uses).
static PyObject* chunks(PyObject*, PyObject* args) {
  long B = 0, N = 0, step = 0;
  if (!PyArg_ParseTuple(args, "lll", &B, &N, &step)) return nullptr;
  if (B < 1 || N < 1 || step < 1) {
    PyErr_SetString(PyExc_ValueError, "trimul._C.chunks takes positive B, N and step");
    return nullptr;
  }
  const auto list = trimul::chunks_call(B, N, step);
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(list.size()));
  for (size_t i = 0; out != nullptr && i < list.size(); ++i) {
    const auto& c = list[i];
    PyObject* t = Py_BuildValue("(LLLL)", static_cast<long long>(c[0]), static_cast<long long>(c[1]),
                                static_cast<long long>(c[2]), static_cast<long long>(c[3]));
    if (t == nullptr || PyList_SetItem(out, static_cast<Py_ssize_t>(i), t) != 0) {
      Py_DECREF(out);
      return nullptr;
    }
  }
  return out;
}

// trimul._C.own_contraction(batch, N, precision, matmul_tf32): whether the contraction of `batch`
// planes of N x N at that precision code runs trimul's own GEMM (triangle_gemm) rather than
// cuBLAS through torch's bmm (trimul.info describes the call with it).
static PyObject* own_contraction(PyObject*, PyObject* args) {
  long batch = 0, N = 0, precision = 0;
  int matmul_tf32 = 0;
  if (!PyArg_ParseTuple(args, "lllp", &batch, &N, &precision, &matmul_tf32)) return nullptr;
  return PyBool_FromLong(trimul::own_contraction_call(batch, N, precision, matmul_tf32 != 0));
}

// trimul._C.blas_lt_pick(device, batch, N, fp16, form=0): None where the 16-bit products are not
// timed against cuBLASLt (past kTimedPickMaxFmas, no cuBLASLt, or TRIMUL_BLASLT=0); else
// (picked, rank, candidates, differed) for `batch` planes of N x N on that device, of the forward's
// product c = a b^T (form 0) or of its gradients' a b (1) and a^T b (2) (csrc/blas_lt.h: LtPick;
// (False, -1, 0, 0) before the size's first call).
static PyObject* blas_lt_pick(PyObject*, PyObject* args) {
  long device = 0, batch = 0, N = 0, form = 0;
  int fp16 = 0;
  if (!PyArg_ParseTuple(args, "lllp|l", &device, &batch, &N, &fp16, &form)) return nullptr;
  if (form < 0 || form > 2) {
    PyErr_SetString(PyExc_ValueError, "trimul: blas_lt_pick: form must be 0 (a b^T), 1 (a b) or 2 (a^T b)");
    return nullptr;
  }
  const int64_t Npad = trimul::padded_extent(N);
  if (!trimul::timed_pick_call(batch, Npad)) Py_RETURN_NONE;
  const trimul::LtPick pick =
      trimul::lt_pick(static_cast<int>(device), batch, Npad, fp16 != 0, static_cast<trimul::GemmForm>(form));
  return Py_BuildValue("(Oiii)", pick.picked ? Py_True : Py_False, pick.rank, pick.candidates, pick.differed);
}

// trimul._C.tf32_on_fp16(B, N, P, H, device): whether a forward at precision tf32 of such a shape
// (fp32 x, rows 16-byte aligned, on the tiled path by the dispatcher's choice) runs on the fp16
// stages (trimul.h: RangeScales).
static PyObject* tf32_on_fp16(PyObject*, PyObject* args) {
  long B = 0, N = 0, P = 0, H = 0, device = 0;
  if (!PyArg_ParseTuple(args, "lllll", &B, &N, &P, &H, &device)) return nullptr;
  return PyBool_FromLong(trimul::range_takes_call(B, N, P, H, device));
}

// trimul._C.tf32_backward_on_fp16(P, H, device): whether the backward of a tf32 call at (P, H) takes
// its contraction's gradients on fp16 operands (trimul.h: GradScale; trimul/backward.py).
static PyObject* tf32_backward_on_fp16(PyObject*, PyObject* args) {
  long P = 0, H = 0, device = 0;
  if (!PyArg_ParseTuple(args, "lll", &P, &H, &device)) return nullptr;
  return PyBool_FromLong(trimul::range_backward_takes_call(P, H, device));
}

// trimul._C.packed_sizes(P, H): the pieces of the fp32 parameter pack
// (PackedLayout) in order, which the backward splits the pack into.
static PyObject* packed_sizes(PyObject*, PyObject* args) {
  long P = 0, H = 0;
  if (!PyArg_ParseTuple(args, "ll", &P, &H)) return nullptr;
  const trimul::PackedLayout l = trimul::packed_layout(P, H);
  const int64_t at[] = {l.ln_in_w, l.ln_in_b, l.w_in, l.b_in, l.ln_out_w, l.ln_out_b,
                        l.w_out,   l.b_out,   l.w_gate, l.b_gate, l.total};
  constexpr int kPieces = sizeof(at) / sizeof(at[0]) - 1;
  PyObject* sizes = PyTuple_New(kPieces);
  for (int i = 0; sizes != nullptr && i < kPieces; ++i) {
    PyObject* n = PyLong_FromLongLong(at[i + 1] - at[i]);
    if (n == nullptr || PyTuple_SetItem(sizes, i, n) != 0) {
      Py_DECREF(sizes);
      return nullptr;
    }
  }
  return sizes;
}

// Importing trimul._C loads this library and runs the operator registrations
// below. The module holds the limits the backward's Python side checks before
// choosing a kernel: the shared memory per block out_stage_back needs (its
// narrower form, laid out for P = H = kOutBackMaxWidth whatever the call's),
// that width, the row kernels' longest row, the int32 sizes of RangeScales and GradScale
// (the fakes of the ops returning them); input_back_takes, chunks, own_contraction, blas_lt_pick,
// tf32_on_fp16, tf32_backward_on_fp16 and packed_sizes.
PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {
      {"packed_sizes", packed_sizes, METH_VARARGS, "The pieces of the fp32 parameter pack for (P, H)."},
      {"chunks", chunks, METH_VARARGS, "The backward's chunks (b0, b1, i0, i1) of positions for (B, N, step)."},
      {"own_contraction", own_contraction, METH_VARARGS,
       "Whether the contraction of (batch, N, precision code, matmul_tf32) runs trimul's own GEMM."},
      {"blas_lt_pick", blas_lt_pick, METH_VARARGS,
       "None where the product is not timed against cuBLASLt; else (picked, rank, candidates, differed) "
       "for (device, batch, N, fp16, form=0): form 0 the forward's a b^T, 1 a b, 2 a^T b."},
      {"tf32_on_fp16", tf32_on_fp16, METH_VARARGS,
       "Whether a tf32 forward of (B, N, P, H, device) runs on the fp16 stages."},
      {"tf32_backward_on_fp16", tf32_backward_on_fp16, METH_VARARGS,
       "Whether a tf32 backward of (P, H, device) takes its contraction's gradients on fp16 operands."},
      {"input_back_takes", input_back_takes, METH_VARARGS,
       "Whether the input stage's backward kernel takes calls of (P, H, precision, x dtype, device codes)."},
      {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  const long smem = static_cast<long>(trimul::out_stage_back_smem());
  if (PyModule_AddIntConstant(m, "OUT_STAGE_BACK_SMEM", smem) != 0 ||
      PyModule_AddIntConstant(m, "OUT_BACK_MAX_WIDTH", static_cast<long>(trimul::kOutBackMaxWidth)) != 0 ||
      PyModule_AddIntConstant(m, "MAX_ROWS_LEN", static_cast<long>(trimul::kMaxRowsLen)) != 0 ||
      PyModule_AddIntConstant(m, "RANGE_SCALES_INTS", static_cast<long>(sizeof(trimul::RangeScales) / 4)) != 0 ||
      PyModule_AddIntConstant(m, "GRAD_SCALE_INTS", static_cast<long>(sizeof(trimul::GradScale) / 4)) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
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

// The floating types the kernels store: f32, bf16, f16.
bool is_stored_dtype(DType d) { return d == DType::f32 || d == DType::bf16 || d == DType::f16; }
ScalarType scalar_type_of(DType d) {
  return d == DType::bf16 ? ScalarType::BFloat16 : d == DType::f16 ? ScalarType::Half : ScalarType::Float;
}
int64_t element_bytes(DType d) { return d == DType::f32 ? 4 : 2; }

// The matrix products' operand type at a precision (fp32 for tf32 and ieee).
DType operand_dtype(Precision p) {
  return p == Precision::bf16 ? DType::bf16 : p == Precision::fp16 ? DType::f16 : DType::f32;
}

// The one place that picks kernels for a call.
enum class Path : int64_t {
  tiled_fp32 = 0,   // pack_params, fp32 CUDA-core stages, the contraction
  tiled_mma = 1,    // pack_params + pack_operands, tensor-core stages, the contraction
  fused_small = 2,  // one cooperative launch (csrc/cuda/fused_small.cu)
  tiled_sync = 3,   // tiled_mma with mma.sync products even where wgmma could run (forced only)
  tiled_chunked = 4,  // tiled_mma with the wgmma input stage streaming its weights (forced only)
};

// Where fused_small beats the tiled pipeline (CUDA-graph replay on the H200,
// benchmarks/NOTES.md, "Small problems"): up to about this many multiply-adds
// per call, by the wider of P and H. Against the 16-bit tensor-core stages, at
// P = 64, H = 32, it wins up to N = 32 (16 M; the seed's 31.5 M), is within 2 us
// at N = 48 (37 M) and loses from N = 64 on (67 M: 36.7 vs 25.9 us); it loses at
// P = H = 128. Against the fp32 stages (tensor cores or CUDA cores) it wins at
// P = H = 128, N = 64 (436 M: 67 vs 113 us) and loses at N = 96; at P = 64, H = 32
// the count alone does not separate the two sides: at 160 M it loses at B = 1,
// N = 96 (66 vs 53 us against the tensor-core stages) and wins at B = 4, N = 48
// (50 vs 78 us), so that limit also caps N: it wins at N = 64 (31 vs 51 us), and
// its time grows about as N^2 from there while the tiled one stays near 52 us, so
// the two cross near N = 80.
struct FusedSmallLimit {
  int64_t max_width;
  double max_fmas;
  int64_t max_n;
};
constexpr int64_t kAnyN = int64_t{1} << 40;
constexpr FusedSmallLimit kFusedSmallVs16Bit[] = {{64, 4.0e7, kAnyN}};
constexpr FusedSmallLimit kFusedSmallVsFp32[] = {{64, 2.0e8, 80}, {128, 4.5e8, kAnyN}};

template <size_t kCount>
bool fused_small_wins(const FusedSmallLimit (&limits)[kCount], int64_t width, int64_t N, double fmas) {
  for (const FusedSmallLimit& l : limits)
    if (width <= l.max_width) return fmas <= l.max_fmas && N <= l.max_n;
  return false;
}

double forward_fmas(int64_t B, int64_t N, int64_t P, int64_t H) {
  const double rows = static_cast<double>(B) * N * N;
  return rows * static_cast<double>(4 * H * P + P * P + H * P) + rows * static_cast<double>(N) * H;
}

// What the host side asks of a device, read once per device: the shared memory
// a block may opt into, the compute capability (major * 10 + minor), the SMs.
struct DeviceFacts {
  int max_smem = 0;
  int cc = 0;
  int sms = 0;
};

// nullptr where the device cannot be asked (no such device). Asked once per device; calls may
// come from several host threads (the kernels' launches take their SM counts from here too).
const DeviceFacts* device_facts(int device) {
  constexpr int kMaxDevices = 64;
  static DeviceFacts facts[kMaxDevices];
  static std::atomic<bool> known[kMaxDevices];
  static std::mutex lock;
  if (device < 0 || device >= kMaxDevices) return nullptr;
  if (!known[device].load(std::memory_order_acquire)) {
    const std::lock_guard<std::mutex> hold(lock);
    if (!known[device].load(std::memory_order_relaxed)) {
      int major = 0, minor = 0, smem = 0, sms = 0;
      if (cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
          cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
        cudaGetLastError();  // leave no error behind for the next launch check
        return nullptr;
      }
      facts[device] = {smem, major * 10 + minor, sms};
      known[device].store(true, std::memory_order_release);
    }
  }
  return &facts[device];
}

// Whether this build holds the wgmma (sm_90a) form of the 16-bit and tf32 input stage:
// TORCH_CUDA_ARCH_LIST with 9.0a, which setup.py turns into TRIMUL_SM90A. It
// runs on compute capability 9.0 only.
#ifdef TRIMUL_SM90A
constexpr bool kBuiltSm90a = true;
#else
constexpr bool kBuiltSm90a = false;
#endif
// What the dispatcher picks for a call: the path, whether the input stage
// of the tensor-core path runs its products on wgmma (16-bit or tf32 operands, x
// already in their type, whose tile the stage then takes as it is; a 9.0
// device and a build with sm_90a code), and whether that wgmma stage keeps all
// of w_in resident in shared memory (16-bit operands; ln_proj_gate_resident.cu: where it fits,
// P % 8 == 0 and kin <= 144; the launch also wants x's rows 16-byte aligned), and
// whether the output stage may run its resident form as well
// (ln_out_proj_gate_resident.cu, where its shared memory fits; its takes() has the
// rest of its conditions).
struct Plan {
  Path path;
  bool wgmma;
  bool resident;
  bool out_resident;
};

// `forced`: -1 lets the dispatcher choose; a Path code forces that path where it can run.
Plan plan(int64_t B, int64_t N, int64_t P, int64_t H, Precision precision, DType x_dtype, int device,
          int64_t forced = -1) {
  const DeviceFacts* dev = device_facts(device);
  if (dev == nullptr) return {Path::tiled_fp32, false, false, false};
  const size_t limit = static_cast<size_t>(dev->max_smem);
  const bool fused_ok = fused_small_smem(B, N, P, H) <= limit &&
                        fused_small_workspace(B, N, P, H) < (int64_t{1} << 31);  // its 32-bit row math
  if (forced == static_cast<int64_t>(Path::fused_small) && fused_ok) return {Path::fused_small, false, false, false};
  const DType operand = operand_dtype(precision);
  const int64_t op_bytes = element_bytes(operand);
  const int64_t raw_x_bytes = x_dtype == operand ? 0 : element_bytes(x_dtype);
  const bool mma_fits = ln_proj_gate_mma_smem(P, op_bytes, raw_x_bytes) <= limit &&
                        ln_out_proj_gate_mma_smem(P, H, op_bytes, raw_x_bytes) <= limit;
  const bool chunked = forced == static_cast<int64_t>(Path::tiled_chunked);
  const Path tiled = !mma_fits || forced == static_cast<int64_t>(Path::tiled_fp32) ? Path::tiled_fp32
                     : forced == static_cast<int64_t>(Path::tiled_sync)                ? Path::tiled_sync
                                                                                        : Path::tiled_mma;
  const int64_t width = std::max(P, H);
  const double fmas = forward_fmas(B, N, P, H);
  const bool fused_wins = tiled != Path::tiled_fp32 && op_bytes == 2 ? fused_small_wins(kFusedSmallVs16Bit, width, N, fmas)
                                                                    : fused_small_wins(kFusedSmallVsFp32, width, N, fmas);
  if (forced < 0 && fused_ok && fused_wins) return {Path::fused_small, false, false, false};
  const bool wgmma = tiled == Path::tiled_mma && (op_bytes == 2 || precision == Precision::tf32) &&
                     raw_x_bytes == 0 && kBuiltSm90a && dev->cc == 90;
  const bool resident = wgmma && op_bytes == 2 && !chunked && ln_proj_gate_resident_smem(P, H) <= limit;
  return {tiled, wgmma, resident, resident && ln_out_proj_gate_resident_smem() <= limit};
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

// The parameters' dtypes: those load_param reads.
bool floating_dtype(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::BFloat16 || t == ScalarType::Half || t == ScalarType::Double;
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
    STD_TORCH_CHECK(floating_dtype(v.scalar_type()), "trimul: ", name,
                    " must be float32, bfloat16, float16 or float64");  // (load_param's types)
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

constexpr int kParams = 16;  // in trimul.forward's order, see PARAM_NAMES in trimul/ops.py
const char* const kParamNames[kParams] = {
    "ln_in_weight",  "ln_in_bias",    "proj_a_weight", "proj_a_bias",     "gate_a_weight",   "gate_a_bias",
    "proj_b_weight", "proj_b_bias",   "gate_b_weight", "gate_b_bias",     "ln_out_weight",   "ln_out_bias",
    "out_proj_weight", "out_proj_bias", "out_gate_weight", "out_gate_bias"};

// Every parameter (any float dtype, any strides, defaults for missing ones) as the pack's
// entries, into the fp32 workspace at `dst` laid out as `layout`.
PackParams pack_entries(const OptTensor* params, int64_t P, int64_t H, const PackedLayout& layout, float* dst) {
  PackParams pack{};
  pack.dst = dst;
  add_entry(pack, params[kParamLnInW], 1, P, layout.ln_in_w, 0, 1.f, kParamNames[kParamLnInW]);
  add_entry(pack, params[kParamLnInB], 1, P, layout.ln_in_b, 0, 0.f, kParamNames[kParamLnInB]);
  for (int q = 0; q < 4; ++q) {  // interleaved rows 4h + q, see PackedLayout
    const int w = kParamWIn + 2 * q;
    add_entry(pack, params[w], H, P, layout.w_in + q * P, 4 * P, 0.f, kParamNames[w]);
    add_entry(pack, params[w + 1], H, 1, layout.b_in + q, 4, 0.f, kParamNames[w + 1]);
  }
  add_entry(pack, params[kParamLnOutW], 1, H, layout.ln_out_w, 0, 1.f, kParamNames[kParamLnOutW]);
  add_entry(pack, params[kParamLnOutB], 1, H, layout.ln_out_b, 0, 0.f, kParamNames[kParamLnOutB]);
  add_entry(pack, params[kParamWOut], P, H, layout.w_out, H, 0.f, kParamNames[kParamWOut]);
  add_entry(pack, params[kParamBOut], 1, P, layout.b_out, 0, 0.f, kParamNames[kParamBOut]);
  add_entry(pack, params[kParamWGate], P, P, layout.w_gate, P, 0.f, kParamNames[kParamWGate]);
  add_entry(pack, params[kParamBGate], 1, P, layout.b_gate, 0, 0.f, kParamNames[kParamBGate]);
  STD_TORCH_CHECK(pack.count == kParams, "trimul: the pack holds one entry per parameter");
  return pack;
}

// The fp32 pack alone; one launch.
Tensor pack_parameters(const Tensor& x, const OptTensor* params, int64_t P, int64_t H, const PackedLayout& layout,
                       cudaStream_t stream) {
  Tensor packed = torch::stable::new_empty(x, {layout.total}, ScalarType::Float);
  const PackParams pack = pack_entries(params, P, H, layout, static_cast<float*>(packed.mutable_data_ptr()));
  check_cuda(launch_pack(pack, nullptr, P, H, nullptr, DType::f32, stream), "pack_params");
  return packed;
}

// fused_small reads the parameters in place when all present ones share one
// dtype, fp32 or x's, and have contiguous rows (the usual case); else from a pack.
bool params_readable_in_place(const OptTensor* params, DType x_dtype, DType* common) {
  std::optional<DType> seen;
  for (int i = 0; i < kParams; ++i) {
    if (!params[i].has_value()) continue;
    const Tensor& t = *params[i];
    const DType d = dtype_of(t, kParamNames[i]);
    if (seen && d != *seen) return false;
    seen = d;
    if (t.strides()[t.dim() - 1] != 1) return false;
  }
  *common = seen.value_or(DType::f32);
  return *common == DType::f32 || *common == x_dtype;
}

ParamRef param_ref(const OptTensor& t, float fill) {
  ParamRef r{nullptr, 1, fill};
  if (t.has_value()) {
    r.ptr = t->const_data_ptr();
    r.ld = t->dim() == 2 ? t->strides()[0] : 1;
  }
  return r;
}

// The strides of x and the mask as the input stage reads them (LnProjGateParams,
// FusedSmallParams): "incoming" contracts over x's first spatial index, so it
// reads both with their two spatial strides swapped.
template <typename Params>
void set_input_strides(Params& p, const Tensor& x, const OptTensor& mask, bool incoming) {
  p.x_stride_b = x.strides()[0];
  p.x_stride_r = incoming ? x.strides()[2] : x.strides()[1];
  p.x_stride_c = incoming ? x.strides()[1] : x.strides()[2];
  if (mask.has_value()) {
    const Tensor& m = *mask;
    STD_TORCH_CHECK(m.dim() == 3, "trimul: mask must be (B, N, N)");
    p.mask = m.const_data_ptr();
    p.mask_dtype = dtype_of(m, "mask");
    p.mask_stride_b = m.strides()[0];
    p.mask_stride_r = incoming ? m.strides()[2] : m.strides()[1];
    p.mask_stride_c = incoming ? m.strides()[1] : m.strides()[2];
  }
}

Tensor forward_fused_small(const Tensor& x, const OptTensor& mask, const OptTensor* params, bool incoming,
                           bool gate_from_normalized, double eps, int device, cudaStream_t stream) {
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const int64_t H = params[2]->sizes()[0];
  FusedSmallParams f{};
  f.x = x.const_data_ptr();
  f.x_dtype = dtype_of(x, "x");
  set_input_strides(f, x, mask, incoming);
  f.incoming = incoming;
  f.gate_from_normalized = gate_from_normalized;
  f.B = B;
  f.N = N;
  f.P = P;
  f.H = H;
  f.eps = static_cast<float>(eps);
  std::optional<Tensor> packed;
  if (params_readable_in_place(params, f.x_dtype, &f.w_dtype)) {
    f.ln_in_w = param_ref(params[0], 1.f);
    f.ln_in_b = param_ref(params[1], 0.f);
    for (int q = 0; q < 4; ++q) {  // proj_a, gate_a, proj_b, gate_b
      f.w_in[q] = param_ref(params[2 + 2 * q], 0.f);
      f.b_in[q] = param_ref(params[3 + 2 * q], 0.f);
    }
    f.ln_out_w = param_ref(params[10], 1.f);
    f.ln_out_b = param_ref(params[11], 0.f);
    f.w_out = param_ref(params[12], 0.f);
    f.b_out = param_ref(params[13], 0.f);
    f.w_gate = param_ref(params[14], 0.f);
    f.b_gate = param_ref(params[15], 0.f);
  } else {
    const PackedLayout l = packed_layout(P, H);
    packed = pack_parameters(x, params, P, H, l, stream);
    const float* base = static_cast<const float*>(packed->const_data_ptr());
    auto at = [&](int64_t offset, int64_t ld) { return ParamRef{base + offset, ld, 0.f}; };
    f.w_dtype = DType::f32;
    f.ln_in_w = at(l.ln_in_w, 1);
    f.ln_in_b = at(l.ln_in_b, 1);
    for (int q = 0; q < 4; ++q) {
      f.w_in[q] = at(l.w_in + q * P, 4 * P);
      f.b_in[q] = at(l.b_in + q, 4);
    }
    f.ln_out_w = at(l.ln_out_w, 1);
    f.ln_out_b = at(l.ln_out_b, 1);
    f.w_out = at(l.w_out, H);
    f.b_out = at(l.b_out, 1);
    f.w_gate = at(l.w_gate, P);
    f.b_gate = at(l.b_gate, 1);
  }
  Tensor workspace = torch::stable::new_empty(x, {fused_small_workspace(B, N, P, H)}, ScalarType::Float);
  Tensor out = torch::stable::new_empty(x, {B, N, N, P});
  f.workspace = static_cast<float*>(workspace.mutable_data_ptr());
  f.out = out.mutable_data_ptr();
  const DeviceFacts* dev = device_facts(device);
  STD_TORCH_CHECK(dev != nullptr, "trimul: fused_small: cannot query the device");
  check_cuda(launch_fused_small(f, dev->sms, stream), "fused_small");
  return out;
}

cudaStream_t stream_of(const Tensor& t) {
  void* stream_ptr = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(t.get_device_index(), &stream_ptr));
  return static_cast<cudaStream_t>(stream_ptr);
}

// The checks both CUDA entry points make; their stream.
cudaStream_t check_and_stream(const Tensor& x, int64_t direction, int64_t precision) {
  STD_TORCH_CHECK(x.dim() == 4, "trimul: x must be (B, N, N, P), got ", x.dim(), " dims");
  STD_TORCH_CHECK(x.strides()[3] == 1, "trimul: x's channel dimension must be contiguous");
  const DType x_dtype = dtype_of(x, "x");
  STD_TORCH_CHECK(is_stored_dtype(x_dtype), "trimul: the CUDA kernels take float32, bfloat16 or float16 x");
  STD_TORCH_CHECK(direction == 0 || direction == 1, "trimul: bad direction code ", direction);
  STD_TORCH_CHECK(precision >= 0 && precision <= 3, "trimul: bad precision code ", precision);
  return stream_of(x);
}

// What the tiled stages of one call share: the packed parameters, their
// copies in the operand type (tensor-core stages), and the Problem both
// stages read.
struct Staged {
  // the one workspace: the fp32 pack (its first prob.layout.total floats; slices of it at the
  // pack's offsets are the pack's) and the operand copies (prob.operands)
  Tensor workspace;
  Problem prob;
  DType ab_dtype;  // of a, b (and c)
  bool mma;        // tensor-core stages (the input stage's wgmma form: prob.op_layout.in_blocked)
  int64_t resident_blocks;  // the resident wgmma input stage's blocks (one per SM), 0 where not planned
};

constexpr int64_t kOperandsAlign = 32;  // floats: the operand copies start 128-byte aligned in the workspace

// `chosen`: tiled_mma, tiled_sync or tiled_fp32 (plan()); `gate_folded`: the
// gate reads the normalized input (OperandLayout); `for_input_back`: input_back
// reads the operands too (with the resident input stage, w_in's unfolded copy);
// `range`: precision tf32 on the fp16 stages; `headroom`: c's headroom at fp16 operands (each a
// RangeScales written on the device before).
Staged stage_parameters(const Tensor& x, const OptTensor* params, int64_t H, double eps, Precision prec,
                        const Plan& chosen, bool gate_folded, bool for_input_back, cudaStream_t stream,
                        const RangeScales* range = nullptr, const RangeScales* headroom = nullptr) {
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const DType x_dtype = dtype_of(x, "x");
  const PackedLayout layout = packed_layout(P, H);
  const DType operand = operand_dtype(prec);
  const bool mma = chosen.path != Path::tiled_fp32;
  const DeviceFacts* dev = device_facts(x.get_device_index());
  const int64_t resident_blocks = chosen.resident && dev != nullptr ? dev->sms : 0;
  OperandLayout op_layout = operand_layout(P, H, element_bytes(operand), chosen.wgmma, gate_folded);
  // w_in in the resident input stage's form where that stage takes the call (its other
  // conditions are the plan's and the tile count's); the chunked kernels refuse such a pack
  const bool x_rows_vec16 = rows_vec16(x, element_bytes(x_dtype));
  if (chosen.resident && x_dtype == operand && x_rows_vec16) pair_in_layout(op_layout, for_input_back);
  op_layout.tf32_rounded = operand == DType::f32 && prec == Precision::tf32;
  op_layout.range = range;
  // one workspace, one launch: the fp32 pack, then (tensor-core stages) the operand copies
  const int64_t operands_at = (layout.total + kOperandsAlign - 1) / kOperandsAlign * kOperandsAlign;
  const int64_t operand_floats = mma ? (op_layout.total * element_bytes(operand) + 3) / 4 : 0;
  Tensor workspace = torch::stable::new_empty(x, {operands_at + operand_floats}, ScalarType::Float);
  float* const base = static_cast<float*>(workspace.mutable_data_ptr());
  PackParams pack = pack_entries(params, P, H, layout, base);
  pack.headroom = headroom;
  check_cuda(launch_pack(pack, mma ? &op_layout : nullptr, P, H, base + operands_at, operand, stream), "pack_params");
  Staged s{workspace, Problem{}, operand, mma, resident_blocks};
  Problem& prob = s.prob;
  prob.x = x.const_data_ptr();
  prob.x_dtype = x_dtype;
  prob.x_rows_vec16 = x_rows_vec16;
  prob.B = B;
  prob.N = N;
  prob.Npad = padded_extent(N);
  prob.P = P;
  prob.H = H;
  prob.eps = static_cast<float>(eps);
  prob.params = base;
  prob.layout = layout;
  prob.operands = mma ? base + operands_at : nullptr;
  prob.op_layout = op_layout;
  prob.precision = prec;
  prob.headroom = headroom;
  return s;
}

// The input stage's parameters but for a and b (and x_stats, nullptr).
LnProjGateParams input_params(const Staged& s, const Tensor& x, const OptTensor& mask, int64_t direction) {
  LnProjGateParams in{};
  static_cast<Problem&>(in) = s.prob;
  set_input_strides(in, x, mask, direction == 0);
  in.ab_dtype = s.ab_dtype;
  in.resident_blocks = s.resident_blocks;
  const int64_t N = s.prob.N;
  in.stats_stride_r = direction == 0 ? 1 : N;  // (incoming: r is j, c is i)
  in.stats_stride_c = direction == 0 ? N : 1;
  return in;
}

// a and b, [B*H][Npad][Npad] in the operand type (padding zeroed), by the input stage with
// parameters `in` (input_params'); in.x_stats, where set, takes x's LayerNorm statistics (the
// resident input stage only).
std::tuple<Tensor, Tensor> input_stage(const Staged& s, LnProjGateParams in, const Tensor& x, cudaStream_t stream) {
  const int64_t BH = s.prob.B * s.prob.H, Npad = s.prob.Npad;
  Tensor a = torch::stable::new_empty(x, {BH, Npad, Npad}, scalar_type_of(s.ab_dtype));
  Tensor b = torch::stable::new_empty(x, {BH, Npad, Npad}, scalar_type_of(s.ab_dtype));
  in.a = a.mutable_data_ptr();
  in.b = b.mutable_data_ptr();
  check_cuda(s.mma ? launch_ln_proj_gate_mma(in, stream) : launch_ln_proj_gate(in, stream), "ln_proj_gate");
  return {a, b};
}

#define TRIMUL_PARAM_ARGS                                                                                      \
  const OptTensor &ln_in_weight, const OptTensor &ln_in_bias, const Tensor &proj_a_weight,                     \
      const OptTensor &proj_a_bias, const Tensor &gate_a_weight, const OptTensor &gate_a_bias,                 \
      const Tensor &proj_b_weight, const OptTensor &proj_b_bias, const Tensor &gate_b_weight,                  \
      const OptTensor &gate_b_bias, const OptTensor &ln_out_weight, const OptTensor &ln_out_bias,              \
      const Tensor &out_proj_weight, const OptTensor &out_proj_bias, const Tensor &out_gate_weight,            \
      const OptTensor &out_gate_bias
#define TRIMUL_PARAM_LIST                                                                                      \
  {ln_in_weight,  ln_in_bias,    proj_a_weight,   proj_a_bias,   gate_a_weight,   gate_a_bias,                 \
   proj_b_weight, proj_b_bias,   gate_b_weight,   gate_b_bias,   ln_out_weight,   ln_out_bias,                 \
   out_proj_weight, out_proj_bias, out_gate_weight, out_gate_bias}

// An ATen operator through the dispatcher (those torch::stable does not wrap); its first result as R.
template <size_t kArgs, typename R = Tensor>
R aten_call(const char* name, const char* overload, std::array<StableIValue, kArgs> stack) {
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return torch::stable::detail::to<R>(stack[0]);
}
// a + b (the one stable addition: a - (-1) b, exact)
Tensor add(const Tensor& a, const Tensor& b) { return torch::stable::subtract(a, b, -1.0); }
// the products by their ATen operators: matmul's own dispatch (expand, reshape, view around
// the same mm or bmm) costs several µs of host time a call
Tensor mm(const Tensor& a, const Tensor& b) {
  return aten_call<2>("aten::mm", "", {torch::stable::detail::from(a), torch::stable::detail::from(b)});
}
// a b in fp32 from 16-bit or fp32 operands: the 16-bit ones by cuBLAS's fp32-output form (as fast
// at the weight gradients' shapes; no rounding of a sum over positions to the operand type)
Tensor mm_f32(const Tensor& a, const Tensor& b) {
  const ScalarType t = a.scalar_type();
  if (t != ScalarType::BFloat16 && t != ScalarType::Half) return mm(a, b);
  return aten_call<3>("aten::mm", "dtype", {torch::stable::detail::from(a), torch::stable::detail::from(b),
                                            torch::stable::detail::from(ScalarType::Float)});
}
Tensor bmm(const Tensor& a, const Tensor& b) {
  return aten_call<2>("aten::bmm", "", {torch::stable::detail::from(a), torch::stable::detail::from(b)});
}
Tensor t2(const Tensor& a) { return torch::stable::transpose(a, 0, 1); }

// The weight gradients' products by slices of positions: kPositionSlices slices (32 or 128 were
// slower than the one product at one of the two widths, M = 128 and 512), from kSlicedMinRows
// positions on (N = 728 at B = 1; at N = 384 and 512 the slices were no faster).
constexpr int64_t kPositionSlices = 64;
constexpr int64_t kSlicedMinRows = 1 << 19;

// The number of slices of R positions, or 1 for the one product (also where 64 does not divide R:
// N not a multiple of 8).
int64_t position_slices(int64_t R) { return R >= kSlicedMinRows && R % kPositionSlices == 0 ? kPositionSlices : 1; }

// a^T b over positions, fp32 (a [R][M], b [R][K]: position-major rows; the weight gradients'
// products). cuBLAS's split-K form of the one product reads its operands at 2.5-2.8 TB/s on an
// H100 at these shapes; as a batched product over slices of the positions (cuBLAS's non-split
// tiles, a slice a batch entry) and a sum over the slices, at 2.8-3.0 from N = 768 on
// (benchmarks/NOTES.md, "The weight gradients' products by slices of positions"). The slices' fp32
// products are summed in a fixed order: bitwise repeatable, as the split-K form is.
Tensor positions_product(const Tensor& a, const Tensor& b) {
  const int64_t R = a.sizes()[0], S = position_slices(R);
  const ScalarType t = a.scalar_type();
  if (S == 1 || (t != ScalarType::BFloat16 && t != ScalarType::Half) || !a.is_contiguous() || !b.is_contiguous())
    return mm_f32(t2(a), b);
  const Tensor as = torch::stable::transpose(torch::stable::view(a, {S, R / S, a.sizes()[1]}), 1, 2);
  const Tensor bs = torch::stable::view(b, {S, R / S, b.sizes()[1]});
  const Tensor parts =
      aten_call<3>("aten::bmm", "dtype", {torch::stable::detail::from(as), torch::stable::detail::from(bs),
                                          torch::stable::detail::from(ScalarType::Float)});
  const int64_t slice_dim[] = {0};
  return torch::stable::sum(parts, torch::headeronly::IntHeaderOnlyArrayRef(slice_dim, 1));
}

// Whether two 16-bit tensors of one shape hold the same bits (signed zeros and NaNs included).
bool same_bits16(const Tensor& a, const Tensor& b) {
  auto bits = [](const Tensor& t) {
    return aten_call<2>("aten::view", "dtype", {torch::stable::detail::from(t),
                                                torch::stable::detail::from(ScalarType::Short)});
  };
  return aten_call<2, bool>("aten::equal", "",
                            {torch::stable::detail::from(bits(a)), torch::stable::detail::from(bits(b))});
}
Tensor slice(Tensor t, int64_t start, int64_t length) { return torch::stable::narrow(t, 0, start, length); }

// The contraction and its gradients take our CUTLASS kernels (triangle_gemm.cu) for fp32 products
// where torch's matmul would not run them as TF32 (`matmul_tf32`: torch.backends.cuda.matmul.allow_tf32),
// and for 16-bit products of up to this many multiply-adds (B*H planes of Npad^3: N = 128 at
// B = 1, H = 128), where either kernel takes a few us; cuBLAS through torch's bmm otherwise, or for
// 16-bit products cuBLASLt's kernel where one was timed faster at the size and form
// (csrc/blas_lt.h). cuBLAS's sm90 kernels run larger products at about twice CUTLASS sm80's rate
// (N = 256: 11.7 against 19.8 us), but a call through the dispatcher costs the host more than the
// whole product of small planes (benchmarks/NOTES.md, "The contraction of small planes").
constexpr double kOwnContraction16MaxFmas = 128.0 * 128 * 128 * 128;
double product_fmas(int64_t batch, int64_t Npad) { return static_cast<double>(batch) * Npad * Npad * Npad; }
bool own_contraction(GemmForm form, Precision prec, int64_t batch, int64_t Npad, bool matmul_tf32) {
  if (prec == Precision::ieee || prec == Precision::tf32)
    return form == GemmForm::ab_t && !(prec == Precision::tf32 && matmul_tf32);
  return product_fmas(batch, Npad) <= kOwnContraction16MaxFmas;
}
// The timed pick between torch's bmm and cuBLASLt up to this many multiply-adds (N = 1024 at B = 1,
// H = 128). Past it the forward runs at the GPU's power cap, where a kernel timed faster alone draws
// more and slows the stages around it: at N = 2048 cuBLASLt's picks cost the forward 3-4 %
// (benchmarks/NOTES.md, "The contraction's kernel timed per size").
constexpr double kTimedPickMaxFmas = 128.0 * 1024 * 1024 * 1024;
bool timed_pick(int64_t batch, int64_t Npad) {
  return product_fmas(batch, Npad) <= kTimedPickMaxFmas && lt_available();
}

// c = a b^T, a b or a^T b over [B*H][Npad][Npad] planes (contiguous), in a's type.
Tensor contraction(const Tensor& a, const Tensor& b, GemmForm form, Precision prec, bool matmul_tf32,
                   cudaStream_t stream) {
  const int64_t Npad = a.sizes()[1];
  if (!own_contraction(form, prec, a.sizes()[0], Npad, matmul_tf32)) {
    const ScalarType t = a.scalar_type();
    auto by_bmm = [&] {
      if (form == GemmForm::ab_t) return bmm(a, torch::stable::transpose(b, 1, 2));
      if (form == GemmForm::a_b) return bmm(a, b);
      return bmm(torch::stable::transpose(a, 1, 2), b);
    };
    if ((t == ScalarType::BFloat16 || t == ScalarType::Half) && timed_pick(a.sizes()[0], Npad)) {
      std::optional<Tensor> c, other;  // (c allocated only where cuBLASLt's kernel or the pick runs)
      const LtWays ways{[&] {
                          if (!c) c = torch::stable::new_empty(a, {a.sizes()[0], Npad, Npad});
                          return c->mutable_data_ptr();
                        },
                        [&] { other = by_bmm(); }, [&] { return same_bits16(*c, *other); }};
      const LtContraction lt{a.const_data_ptr(), b.const_data_ptr(), a.sizes()[0], Npad, t == ScalarType::Half,
                             form, a.get_device_index(), stream};
      if (lt_contraction(lt, ways)) return *c;
      if (other) return *other;  // (a pick's first call, which ran the other way)
    }
    return by_bmm();
  }
  Tensor c = torch::stable::new_empty(a, {a.sizes()[0], Npad, Npad});
  TriangleGemmParams tg{};
  tg.a = a.const_data_ptr();
  tg.b = b.const_data_ptr();
  tg.c = c.mutable_data_ptr();
  tg.batch = a.sizes()[0];
  tg.Npad = Npad;
  tg.precision = prec;
  tg.form = form;
  check_cuda(launch_triangle_gemm(tg, stream), "triangle_gemm");
  return c;
}

// Every argument check trimul/ops.py's check_inputs makes that the options' codes and x's
// (B, N, N, P) form do not already settle: the CUDA path there (_run_cuda: the op's CUDA kernel
// and trimul.call) calls this op without check_inputs and runs it only to word the error after
// one of these fails, so nothing wrong may pass here. P and H come from x and proj_a_weight.
void check_arguments(const Tensor& x, const OptTensor& mask, const OptTensor* params) {
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  STD_TORCH_CHECK(x.sizes()[2] == N && P >= 1, "trimul: x must be a square pair (B, N, N, P) with P >= 1");
  const OptTensor& wa = params[kParamWIn];
  STD_TORCH_CHECK(wa.has_value() && wa->dim() == 2 && wa->sizes()[0] >= 1,
                  "trimul: proj_a_weight must have shape (H, P) with H >= 1");
  const int64_t H = wa->sizes()[0];
  // (rows, cols) of each parameter in trimul.forward's order; cols 0 for a vector
  const int64_t shape[kParams][2] = {{P, 0}, {P, 0}, {H, P}, {H, 0}, {H, P}, {H, 0}, {H, P}, {H, 0},
                                     {H, P}, {H, 0}, {H, 0}, {H, 0}, {P, H}, {P, 0}, {P, P}, {P, 0}};
  const int device = x.get_device_index();
  for (int i = 0; i < kParams; ++i) {
    const OptTensor& t = params[i];
    if (!t.has_value()) continue;  // (the schema has the six weights as Tensor, not Tensor?)
    const bool matrix = shape[i][1] != 0;
    STD_TORCH_CHECK(t->dim() == (matrix ? 2 : 1) && t->sizes()[0] == shape[i][0] &&
                        (!matrix || t->sizes()[1] == shape[i][1]),
                    "trimul: ", kParamNames[i], " has a wrong shape");
    STD_TORCH_CHECK(floating_dtype(t->scalar_type()), "trimul: ", kParamNames[i],
                    " must be float32, bfloat16, float16 or float64");
    STD_TORCH_CHECK(t->is_cuda() && t->get_device_index() == device, "trimul: ", kParamNames[i],
                    " is not on x's device");
  }
  if (mask.has_value()) {
    const Tensor& m = *mask;
    STD_TORCH_CHECK(m.dim() == 3 && m.sizes()[0] == B && m.sizes()[1] == N && m.sizes()[2] == N,
                    "trimul: mask must have shape (B, N, N)");
    STD_TORCH_CHECK(m.is_cuda() && m.get_device_index() == device, "trimul: mask is not on x's device");
  }
}

// The tiled pipeline on parameters staged for it (`chosen`): the input stage, the contraction and
// the output stage, the result of type `out_type` (x's; fp32 from the fp16 stages at precision
// tf32); `product`, where given, takes the contraction's c. `range_x_stats`: the fp16 stages at
// precision tf32 with the gate from x, x's statistics from range_normalize for the output stage.
Tensor tiled_forward(const Staged& s, const Plan& chosen, const Tensor& x, const OptTensor& mask, int64_t direction,
                     int64_t gate_input, Precision prec, bool matmul_tf32, std::optional<Tensor>* product,
                     ScalarType out_type, cudaStream_t stream, const float* range_x_stats = nullptr) {
  const int64_t B = s.prob.B, N = s.prob.N, P = s.prob.P;
  LnOutProjGateParams op{};
  static_cast<Problem&>(op) = s.prob;
  op.x_stride_b = x.strides()[0];
  op.x_stride_i = x.strides()[1];
  op.x_stride_j = x.strides()[2];
  op.c_dtype = s.ab_dtype;  // (what the contraction below leaves: the operand type, or f32)
  op.gate_from_normalized = gate_input == 1;
  op.resident_blocks = chosen.out_resident ? s.resident_blocks : 0;
  LnProjGateParams in = input_params(s, x, mask, direction);
  // Where both stages run resident and the gate reads the normalized input, the input stage
  // hands x's LayerNorm statistics (8 bytes a position) to the output stage.
  std::optional<Tensor> x_stats;
  if (op.gate_from_normalized && s.prob.op_layout.range == nullptr && ln_proj_gate_resident_takes(in) &&
      ln_out_proj_gate_resident_takes(op))
    x_stats = torch::stable::new_empty(x, {B * N * N * 2}, ScalarType::Float);
  in.x_stats = x_stats ? static_cast<float*>(x_stats->mutable_data_ptr()) : nullptr;
  op.x_stats = range_x_stats != nullptr ? range_x_stats : in.x_stats;
  // The contraction's output, in the operand type for 16-bit precisions.
  std::optional<Tensor> c_out;
  {  // a and b live only until the contraction has read them
    auto [a, b] = input_stage(s, in, x, stream);
    c_out = contraction(a, b, GemmForm::ab_t, prec, matmul_tf32, stream);
  }
  const Tensor& c = *c_out;
  if (product != nullptr) *product = c;

  Tensor out = torch::stable::new_empty(x, {B, N, N, P}, out_type);
  op.c = c.const_data_ptr();
  op.c_dtype = dtype_of(c, "c");
  op.out = out.mutable_data_ptr();
  check_cuda(s.mma ? launch_ln_out_proj_gate_mma(op, stream) : launch_ln_out_proj_gate(op, stream),
             "ln_out_proj_gate");
  return out;
}

// Between the layouts of the pair tensors (pair_layout.cu): channel-first
// [B][H][S][S] (pair, last dim contiguous) and position-major [B][N][N][H]
// (rows, contiguous), same dtype; `to_rows` says which one is written. With `range`, the pair in
// fp16 and the rows in fp32, each value scaled (PairLayoutParams: c's scale undone to rows, or
// dc's `grad` scale applied to the pair).
void run_pair_layout(const Tensor& pair, const Tensor& rows, int64_t N, bool swap, bool to_rows,
                     GradScale* grad = nullptr, const RangeScales* range = nullptr) {
  PairLayoutParams p{};
  p.dtype = dtype_of(pair, "pair");
  p.pair = to_rows ? const_cast<void*>(pair.const_data_ptr()) : pair.mutable_data_ptr();
  p.rows = to_rows ? rows.mutable_data_ptr() : const_cast<void*>(rows.const_data_ptr());
  p.B = pair.sizes()[0], p.H = pair.sizes()[1], p.N = N, p.S = pair.sizes()[2];
  p.stride_b = pair.strides()[0], p.stride_h = pair.strides()[1], p.stride_s = pair.strides()[2];
  p.swap = swap;
  p.to_rows = to_rows;
  p.grad = grad;
  p.range = range;
  check_cuda(launch_pair_layout(p, stream_of(pair)), to_rows ? "pair_to_rows" : "rows_to_pair");
}

// Precision tf32 on the fp16 stages (trimul.h: RangeScales) at this shape, the tiled path chosen:
// where both resident stages take it at fp16 (P and H in (112, 128], multiples of 8; 32-bit tile
// numbers). (forward_run adds the call's conditions: fp32 x with 16-byte aligned rows, the
// dispatcher's own choice, no forced kernel.) The fp16 pipeline's plan where it takes the shape,
// else none.
std::optional<Plan> range_plan(int64_t B, int64_t N, int64_t P, int64_t H, int device) {
  const Plan fp16 = plan(B, N, P, H, Precision::fp16, DType::f16, device, static_cast<int64_t>(Path::tiled_mma));
  LnOutProjGateParams out{};  // (what the output stage's takes() reads of a call on x normalized into fp16)
  out.B = B, out.N = N, out.P = P, out.H = H;
  out.x_dtype = out.c_dtype = DType::f16;
  out.x_rows_vec16 = P * element_bytes(DType::f16) % 16 == 0;
  out.resident_blocks = fp16.out_resident ? 1 : 0;
  if (fp16.resident && ln_out_proj_gate_resident_takes(out)) return fp16;
  return std::nullopt;
}

// What the fp16 stages at precision tf32 begin with: the scales' bounds (RangeScales, on the
// device), x normalized into fp16 (with the mask's largest magnitude; x's rows 16-byte aligned)
// and the parameters staged with the scaled weights for `fp16` (range_plan's plan). With
// `x_stats`, range_normalize also writes x's statistics for the output stage's gate from x.
struct RangeStaged {
  Tensor scales;  // RangeScales, int32
  Tensor xhat;    // [B][N][N][P] fp16
  std::optional<Tensor> x_stats;
  Staged s;
};
RangeStaged range_stage(const Tensor& x, const OptTensor& mask, const OptTensor* params, bool gate_folded,
                        bool x_stats, double eps, const Plan& fp16, int device, cudaStream_t stream) {
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const int64_t H = params[kParamWIn]->sizes()[0];
  const int sms = device_facts(device)->sms;
  Tensor scales_t = torch::stable::new_zeros(x, {sizeof(RangeScales) / sizeof(int32_t)}, ScalarType::Int);
  RangeScales* scales = static_cast<RangeScales*>(scales_t.mutable_data_ptr());
  const PackParams pack = pack_entries(params, P, H, packed_layout(P, H), nullptr);
  check_cuda(launch_range_scales(pack, N, P, H, scales, mask.has_value(), gate_folded, stream), "range_scales");
  Tensor xhat = torch::stable::new_empty(x, {B, N, N, P}, ScalarType::Half);
  RangeNormalizeParams np{};
  np.x = static_cast<const float*>(x.const_data_ptr());
  np.x_stride_b = x.strides()[0], np.x_stride_i = x.strides()[1], np.x_stride_j = x.strides()[2];
  if (mask.has_value()) {
    np.mask = mask->const_data_ptr();
    np.mask_dtype = dtype_of(*mask, "mask");
    np.mask_stride_b = mask->strides()[0], np.mask_stride_i = mask->strides()[1], np.mask_stride_j = mask->strides()[2];
  }
  np.B = B, np.N = N, np.P = P;
  np.eps = static_cast<float>(eps);
  np.xhat = xhat.mutable_data_ptr();
  np.scales = scales;
  std::optional<Tensor> stats;  // the gate from x: x = xhat / rstd + mean
  if (x_stats) stats = torch::stable::new_empty(x, {B * N * N * 2}, ScalarType::Float);
  np.x_stats = stats ? static_cast<float*>(stats->mutable_data_ptr()) : nullptr;
  check_cuda(launch_range_normalize(np, sms, stream), "range_normalize");
  Staged s = stage_parameters(xhat, params, H, eps, Precision::fp16, fp16, gate_folded, false, stream, scales);
  return {scales_t, xhat, stats, s};
}

Tensor pair_to_rows_fp16_cuda(const Tensor& pair, int64_t N, const Tensor& scales);

// The forward on the fp16 stages (range_plan's conditions and forward_run's; `fp16` is range_plan's
// plan): range_stage, then the tiled pipeline on xhat at fp16 with an fp32 result. `product`,
// where given, takes c for the backward as fp32 rows [B, N, N, H], its scale undone (where the
// backward's output stage reads it: trimul/backward.py).
Tensor forward_range(const Tensor& x, const OptTensor& mask, const OptTensor* params, int64_t direction,
                     int64_t gate_input, double eps, const Plan& fp16, int device, cudaStream_t stream,
                     std::optional<Tensor>* product) {
  const RangeStaged r = range_stage(x, mask, params, gate_input == 1, gate_input == 0, eps, fp16, device, stream);
  const float* x_stats = r.x_stats ? static_cast<const float*>(r.x_stats->const_data_ptr()) : nullptr;
  Tensor out = tiled_forward(r.s, fp16, r.xhat, mask, direction, gate_input, Precision::fp16, false, product,
                             ScalarType::Float, stream, x_stats);
  if (product != nullptr && product->has_value()) {
    const Tensor& c16 = **product;  // [B*H][Npad][Npad]
    const int64_t B = x.sizes()[0], Npad = c16.sizes()[1];
    *product = pair_to_rows_fp16_cuda(torch::stable::view(c16, {B, c16.sizes()[0] / B, Npad, Npad}), x.sizes()[1],
                                      r.scales);
  }
  return out;
}

// c's headroom at fp16 operands (trimul.h, kHeadroomMaxLog2): its RangeScales (int32), written on
// the device by one launch after the zeroing; where `scale` is given, 2^-t there (fp32) as well.
Tensor c_headroom(const Tensor& x, const OptTensor& mask, const OptTensor* params, int device, cudaStream_t stream,
                  float* scale = nullptr) {
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const int64_t H = params[kParamWIn]->sizes()[0];
  Tensor scales = torch::stable::new_zeros(x, {sizeof(RangeScales) / sizeof(int32_t)}, ScalarType::Int);
  RangeHeadroomParams hp{};
  hp.pack = pack_entries(params, P, H, packed_layout(P, H), nullptr);
  if (mask.has_value()) {
    hp.mask = mask->const_data_ptr();
    hp.mask_dtype = dtype_of(*mask, "mask");
    hp.mask_stride_b = mask->strides()[0], hp.mask_stride_i = mask->strides()[1], hp.mask_stride_j = mask->strides()[2];
  }
  hp.B = B, hp.N = N, hp.P = P, hp.H = H;
  hp.scales = static_cast<RangeScales*>(scales.mutable_data_ptr());
  hp.scale = scale;
  check_cuda(launch_range_headroom(hp, device_facts(device)->sms, stream), "range_headroom");
  return scales;
}

// The forward. `product`, where given, takes the contraction's result c (the tiled pipeline:
// [B*H, Npad, Npad] in the operand type; the fp16 stages at tf32: fp32 rows [B, N, N, H]), which
// the backward then reads instead of computing it again; it stays empty on fused_small, which has
// no such tensor.
Tensor forward_run(const Tensor& x, const OptTensor& mask, const OptTensor* params, int64_t direction,
                   int64_t gate_input, double eps, int64_t precision, int64_t kernel, bool matmul_tf32,
                   std::optional<Tensor>* product) {
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  const cudaStream_t stream = check_and_stream(x, direction, precision);
  STD_TORCH_CHECK(kernel >= -1 && kernel <= 4, "trimul: bad kernel code ", kernel);
  STD_TORCH_CHECK(gate_input == 0 || gate_input == 1, "trimul: bad gate_input code ", gate_input);
  check_arguments(x, mask, params);
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const int64_t H = params[kParamWIn]->sizes()[0];
  if (B * N * N * P == 0) return torch::stable::new_empty(x, {B, N, N, P});

  const Precision prec = static_cast<Precision>(precision);
  const int device = x.get_device_index();
  const Plan chosen = plan(B, N, P, H, prec, dtype_of(x, "x"), device, kernel);
  if (chosen.path == Path::fused_small)
    return forward_fused_small(x, mask, params, direction == 0, gate_input == 1, eps, device, stream);

  if (prec == Precision::tf32 && dtype_of(x, "x") == DType::f32 && kernel == -1 && rows_vec16(x, 4))
    if (const std::optional<Plan> fp16 = range_plan(B, N, P, H, device))
      return forward_range(x, mask, params, direction, gate_input, eps, *fp16, device, stream, product);
  // fp16 operands: c's headroom (a product kept for the backward is c times 2^-2t, as either
  // backward computes it: the fused one through its pack, trimul/backward.py on scaled parameters)
  std::optional<Tensor> headroom;
  if (prec == Precision::fp16) headroom = c_headroom(x, mask, params, device, stream);
  const Staged s = stage_parameters(x, params, H, eps, prec, chosen, gate_input == 1, false, stream, nullptr,
                                    headroom ? static_cast<const RangeScales*>(headroom->const_data_ptr()) : nullptr);
  return tiled_forward(s, chosen, x, mask, direction, gate_input, prec, matmul_tf32, product, x.scalar_type(), stream);
}

Tensor forward_cuda(const Tensor& x, const OptTensor& mask, TRIMUL_PARAM_ARGS, int64_t direction, int64_t gate_input,
                    double eps, int64_t precision, int64_t kernel, bool matmul_tf32) {
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  return forward_run(x, mask, params, direction, gate_input, eps, precision, kernel, matmul_tf32, nullptr);
}

// The forward with its contraction's result for the backward (forward_run's `product`; an
// empty tensor where there is none to keep).
std::tuple<Tensor, Tensor> forward_keep_product_cuda(const Tensor& x, const OptTensor& mask, TRIMUL_PARAM_ARGS,
                                                     int64_t direction, int64_t gate_input, double eps,
                                                     int64_t precision, int64_t kernel, bool matmul_tf32) {
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  std::optional<Tensor> product;
  Tensor out = forward_run(x, mask, params, direction, gate_input, eps, precision, kernel, matmul_tf32, &product);
  return {out, product ? *product : torch::stable::new_empty(x, {0})};
}

// The parameters staged as the backward's recomputation of a and b and input_back take them:
// the tensor-core input stage, whatever the forward took. `for_input_back`: input_back reads
// them too (which adds w_in's unfolded copy where the input stage takes the folded one).
Staged stage_tiled_input(const Tensor& x, const OptTensor* params, int64_t H, double eps, Precision prec,
                         bool for_input_back, cudaStream_t stream, const RangeScales* headroom = nullptr) {
  const int64_t B = x.sizes()[0], N = x.sizes()[1], P = x.sizes()[3];
  const Plan chosen =
      plan(B, N, P, H, prec, dtype_of(x, "x"), x.get_device_index(), static_cast<int64_t>(Path::tiled_mma));
  // (the input stage does not read w_gate, so its folding does not matter here)
  return stage_parameters(x, params, H, eps, prec, chosen, false, for_input_back, stream, nullptr, headroom);
}

// What the backward's ops begin with: the device of x, x contiguous and checked with its stream
// (check_and_stream), the sizes (H from proj_a's weight) and the precision.
struct BackwardCall {
  torch::stable::accelerator::DeviceGuard guard;
  Tensor xk;
  cudaStream_t stream;
  int64_t B, N, P, H;
  Precision prec;
  BackwardCall(const Tensor& x, const Tensor& proj_a_weight, int64_t direction, int64_t precision)
      : guard(x.get_device_index()),
        xk(torch::stable::contiguous(x)),
        stream(check_and_stream(xk, direction, precision)),
        B(xk.sizes()[0]),
        N(xk.sizes()[1]),
        P(xk.sizes()[3]),
        H(proj_a_weight.sizes()[0]),
        prec(static_cast<Precision>(precision)) {}
};

// The backward's recomputation of a and b: the forward's input stage (the
// tiled one, whatever the forward took), [B*H][Npad][Npad] in the operand type;
// and every parameter in fp32 as the stages read them (PackedLayout: defaults
// filled in), which the backward takes its fp32 parameters from.
std::tuple<Tensor, Tensor, Tensor> input_products_cuda(const Tensor& x, const OptTensor& mask, TRIMUL_PARAM_ARGS,
                                                       int64_t direction, double eps, int64_t precision) {
  const BackwardCall call(x, proj_a_weight, direction, precision);
  const Tensor& xk = call.xk;
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  if (call.B * call.N * call.N * call.P == 0) {
    const ScalarType t = scalar_type_of(operand_dtype(call.prec));
    const int64_t Npad = padded_extent(call.N), BH = call.B * call.H;
    return {torch::stable::new_zeros(xk, {BH, Npad, Npad}, t), torch::stable::new_zeros(xk, {BH, Npad, Npad}, t),
            pack_parameters(xk, params, call.P, call.H, packed_layout(call.P, call.H), call.stream)};
  }
  const Staged s = stage_tiled_input(xk, params, call.H, eps, call.prec, false, call.stream);
  auto [a, b] = input_stage(s, input_params(s, xk, mask, direction), xk, call.stream);
  return {a, b, slice(s.workspace, 0, s.prob.layout.total)};
}

// c's headroom at fp16 operands for trimul/backward.py's stage-by-stage sequence: 2^-t, what the
// projections' weights and biases are multiplied by (a one-element fp32 tensor), from the same
// parameters and mask as the forward's (c_headroom), so the same t. The sequence then runs on the
// parameters so scaled, as the fused backward does through the pack.
Tensor fp16_headroom_cuda(const Tensor& x, const OptTensor& mask, TRIMUL_PARAM_ARGS) {
  const BackwardCall call(x, proj_a_weight, 0, static_cast<int64_t>(Precision::fp16));
  STD_TORCH_CHECK(call.B * call.N > 0, "trimul: _fp16_headroom_cuda takes a pair with positions");
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  Tensor scale = torch::stable::new_empty(call.xk, {1}, ScalarType::Float);
  c_headroom(call.xk, mask, params, x.get_device_index(), call.stream, static_cast<float*>(scale.mutable_data_ptr()));
  return scale;
}

Tensor pair_to_rows_cuda(const Tensor& t, int64_t N, bool swap) {
  STD_TORCH_CHECK(t.dim() == 4 && t.strides()[3] == 1 && t.sizes()[3] == t.sizes()[2] && N <= t.sizes()[2],
                  "trimul: _pair_to_rows takes a [B, H, S, S] tensor, last dim contiguous, S >= N");
  torch::stable::accelerator::DeviceGuard guard(t.get_device_index());
  Tensor out = torch::stable::new_empty(t, {t.sizes()[0], N, N, t.sizes()[1]});
  if (out.numel() > 0) run_pair_layout(t, out, N, swap, true);
  return out;
}

Tensor rows_to_pair_cuda(const Tensor& rows, int64_t S, bool swap) {
  STD_TORCH_CHECK(rows.dim() == 4 && rows.is_contiguous() && rows.sizes()[2] == rows.sizes()[1] &&
                      rows.sizes()[1] <= S,
                  "trimul: _rows_to_pair takes a contiguous [B, N, N, H] tensor, S >= N");
  const int64_t N = rows.sizes()[1];
  torch::stable::accelerator::DeviceGuard guard(rows.get_device_index());
  Tensor out = torch::stable::new_empty(rows, {rows.sizes()[0], rows.sizes()[3], S, S});
  if (out.numel() > 0) run_pair_layout(out, rows, N, swap, false);
  return out;
}

// ---- the tf32 backward's contraction gradients on fp16 operands (GradScale) ------
// (trimul._C.tf32_backward_on_fp16 says where: range_backward_takes_call)
// The recomputation of a and b on the fp16 stages (range_stage, then the input stage at fp16):
// [B*H][Npad][Npad] fp16 times 2^d (RangeScales), every parameter in fp32 as input_products_cuda
// returns them, and the scales (RangeScales, int32), which _rows_to_pair_fp16 reads.
std::tuple<Tensor, Tensor, Tensor, Tensor> input_products_fp16_cuda(const Tensor& x, const OptTensor& mask,
                                                                    TRIMUL_PARAM_ARGS, int64_t direction, double eps) {
  constexpr const char* kOp = "_input_products_fp16_cuda";
  const BackwardCall call(x, proj_a_weight, direction, static_cast<int64_t>(Precision::tf32));
  const int device = x.get_device_index();
  STD_TORCH_CHECK(dtype_of(call.xk, "x") == DType::f32 && call.B * call.N > 0, "trimul: ", kOp,
                  " takes a float32 pair with positions");
  const std::optional<Plan> fp16 = range_plan(call.B, call.N, call.P, call.H, device);
  STD_TORCH_CHECK(fp16.has_value(), "trimul: ", kOp,
                  ": the fp16 stages do not take this shape (trimul._C.tf32_backward_on_fp16)");
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  // (range_normalize reads x's rows in 16-byte pieces)
  const Tensor xk = rows_vec16(call.xk, 4) ? call.xk : torch::stable::clone(call.xk);
  const RangeStaged r = range_stage(xk, mask, params, true, false, eps, *fp16, device, call.stream);
  auto [a, b] = input_stage(r.s, input_params(r.s, r.xhat, mask, direction), r.xhat, call.stream);
  return {a, b, slice(r.s.workspace, 0, r.s.prob.layout.total), r.scales};
}

// The device struct S (RangeScales, GradScale) in the int32 tensor `t`, as the op `from` returns
// it, on `like`'s device (checked; `name`: the argument's, for the error).
template <typename S>
const S* device_struct(const Tensor& t, const Tensor& like, const char* op, const char* name, const char* from) {
  STD_TORCH_CHECK(t.is_contiguous() && t.scalar_type() == ScalarType::Int &&
                      t.numel() == static_cast<int64_t>(sizeof(S) / sizeof(int32_t)) &&
                      t.get_device_index() == like.get_device_index(),
                  "trimul: ", op, ": ", name, " must be what ", from, " returns, on the same device");
  return static_cast<const S*>(t.const_data_ptr());
}
const RangeScales* range_scales_of(const Tensor& scales, const Tensor& like, const char* op) {
  return device_struct<RangeScales>(scales, like, op, "scales", "_input_products_fp16_cuda");
}

// dc for the fp16 products: `rows` ([B, N, N, H] fp32, contiguous: the gradient of c as the output
// stage's backward leaves it) as the channel-first pair [B, H, S, S] (S >= N, padding zeroed) in fp16
// times 2^grad_log2, from its largest magnitude (range_grad_amax); and the GradScale (int32) whose
// `unscale` takes da = dc b and db = dc^T a, of a and b as _input_products_fp16_cuda leaves them
// (`scales`: its RangeScales) and accumulated in fp32, to their values (input_back reads it).
std::tuple<Tensor, Tensor> rows_to_pair_fp16_cuda(const Tensor& rows, int64_t S, const Tensor& scales) {
  constexpr const char* kOp = "_rows_to_pair_fp16";
  STD_TORCH_CHECK(rows.dim() == 4 && rows.is_contiguous() && rows.sizes()[2] == rows.sizes()[1] &&
                      rows.sizes()[1] <= S && dtype_of(rows, "rows") == DType::f32 && rows.sizes()[3] % 4 == 0,
                  "trimul: ", kOp, " takes a contiguous float32 [B, N, N, H] tensor, H a multiple of 4, S >= N");
  const RangeScales* range = range_scales_of(scales, rows, kOp);
  torch::stable::accelerator::DeviceGuard guard(rows.get_device_index());
  Tensor grad_t = torch::stable::new_zeros(rows, {sizeof(GradScale) / sizeof(int32_t)}, ScalarType::Int);
  GradScale* grad = static_cast<GradScale*>(grad_t.mutable_data_ptr());
  Tensor pair = torch::stable::new_empty(rows, {rows.sizes()[0], rows.sizes()[3], S, S}, ScalarType::Half);
  if (pair.numel() > 0) {
    check_cuda(launch_range_grad_amax(static_cast<const float*>(rows.const_data_ptr()), rows.numel(), grad,
                                      device_facts(rows.get_device_index())->sms, stream_of(rows)),
               "range_grad_amax");
    run_pair_layout(pair, rows, rows.sizes()[1], false, false, grad, range);
  }
  return {pair, grad_t};
}

// c as the fp16 stages compute it again where the forward did not keep it: `pair` ([B, H, S, S]
// fp16, times 2^range_c_log2 of `scales`, the RangeScales of _input_products_fp16_cuda) as fp32 rows
// [B, N, N, H] with the scale undone, as the forward keeps c (forward_range).
Tensor pair_to_rows_fp16_cuda(const Tensor& pair, int64_t N, const Tensor& scales) {
  constexpr const char* kOp = "_pair_to_rows_fp16";
  STD_TORCH_CHECK(pair.dim() == 4 && pair.strides()[3] == 1 && pair.sizes()[3] == pair.sizes()[2] &&
                      N <= pair.sizes()[2] && dtype_of(pair, "pair") == DType::f16,
                  "trimul: ", kOp, " takes a float16 [B, H, S, S] tensor, last dim contiguous, S >= N");
  const RangeScales* range = range_scales_of(scales, pair, kOp);
  torch::stable::accelerator::DeviceGuard guard(pair.get_device_index());
  Tensor rows = torch::stable::new_empty(pair, {pair.sizes()[0], N, N, pair.sizes()[1]}, ScalarType::Float);
  if (rows.numel() > 0) run_pair_layout(pair, rows, N, false, true, nullptr, range);
  return rows;
}

// ---- the backward's per-position elementwise work (backward_rows.cu) ---------
// Rows are 2-D contiguous (positions, values) tensors of f32, bf16 or f16, at
// most kMaxRowsLen values long; LayerNorm affines fp32. Column sums come back
// summed over the rows (fp32).

DType row_dtype(const Tensor& t, const char* name, int64_t cols) {
  STD_TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.sizes()[1] == cols, "trimul: ", name,
                  " must be a contiguous (rows, ", cols, ") tensor");
  const DType d = dtype_of(t, name);
  STD_TORCH_CHECK(is_stored_dtype(d), "trimul: ", name, " must be float32, bfloat16 or float16");
  return d;
}

const float* affine(const Tensor& t, int64_t len, const char* name) {
  STD_TORCH_CHECK(t.dim() == 1 && t.sizes()[0] == len && t.is_contiguous() && dtype_of(t, name) == DType::f32,
                  "trimul: ", name, " must be a contiguous float32 vector of ", len);
  return static_cast<const float*>(t.const_data_ptr());
}

// A DType code the row kernels store: f32, bf16, f16.
DType row_out_dtype(int64_t code) {
  const DType d = static_cast<DType>(code);
  STD_TORCH_CHECK(is_stored_dtype(d), "trimul: out_dtype code ", code,
                  " is not float32 (0), bfloat16 (2) or float16 (3)");
  return d;
}

bool aligned16(const void* ptr) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// The fp32 buffers of a deterministic column sum (launch_column_sums): the
// sums, and a row of partial sums per block of the kernel that feeds them.
struct ColumnSums {
  Tensor sums, partial;
  ColumnSums(const Tensor& like, int64_t blocks, int64_t cols)
      : sums(torch::stable::new_empty(like, {cols}, ScalarType::Float)),
        partial(torch::stable::new_empty(like, {cols > 0 ? blocks : 0, cols}, ScalarType::Float)) {}
  float* sums_ptr() { return static_cast<float*>(sums.mutable_data_ptr()); }
  float* partial_ptr() { return static_cast<float*>(partial.mutable_data_ptr()); }
};

// Runs p over its rows; returns the column sums (an empty tensor for layer_norm).
Tensor run_rows(RowsParams& p, const Tensor& like) {
  STD_TORCH_CHECK(p.len <= kMaxRowsLen, "trimul: the backward's row kernels take rows of at most ", kMaxRowsLen,
                  " values (got ", p.len, ")");
  p.vec = p.len % 4 == 0 && aligned16(p.src) && aligned16(p.src2) && aligned16(p.src3) && aligned16(p.out) &&
          aligned16(p.out2);
  const DeviceFacts* dev = device_facts(like.get_device_index());
  STD_TORCH_CHECK(dev != nullptr, "trimul: cannot query the device of the backward's rows");
  const int64_t blocks = backward_rows_blocks(p, dev->sms), cols = backward_rows_sum_cols(p);
  ColumnSums col(like, blocks, cols);
  p.partial = col.partial_ptr();
  p.sums = col.sums_ptr();
  check_cuda(launch_backward_rows(p, blocks, stream_of(like)), "backward_rows");
  return col.sums;
}

Tensor rows_layer_norm_cuda(const Tensor& src, const Tensor& w, const Tensor& b, double eps, int64_t out_dtype) {
  torch::stable::accelerator::DeviceGuard guard(src.get_device_index());
  const int64_t len = src.sizes()[src.dim() - 1];
  RowsParams p{};
  p.op = RowsOp::layer_norm;
  p.src_dtype = row_dtype(src, "src", len);
  p.rows = src.sizes()[0], p.len = len, p.eps = static_cast<float>(eps);
  p.src = src.const_data_ptr();
  p.w = affine(w, len, "w"), p.b = affine(b, len, "b");
  p.out_dtype = row_out_dtype(out_dtype);
  Tensor out = torch::stable::new_empty(src, {p.rows, len}, scalar_type_of(p.out_dtype));
  p.out = out.mutable_data_ptr();
  run_rows(p, src);
  return out;
}

std::tuple<Tensor, Tensor, Tensor> rows_gate_grads_cuda(const Tensor& y, const Tensor& gpre, const Tensor& G) {
  torch::stable::accelerator::DeviceGuard guard(y.get_device_index());
  const int64_t len = y.sizes()[y.dim() - 1];
  RowsParams p{};
  p.op = RowsOp::gate_grads;
  p.src_dtype = row_dtype(y, "y", len), p.src2_dtype = row_dtype(gpre, "gpre", len);
  p.src3_dtype = row_dtype(G, "G", len);
  p.rows = y.sizes()[0], p.len = len;
  STD_TORCH_CHECK(gpre.sizes()[0] == p.rows && G.sizes()[0] == p.rows, "trimul: _rows_gate_grads: row counts differ");
  p.src = y.const_data_ptr(), p.src2 = gpre.const_data_ptr(), p.src3 = G.const_data_ptr();
  p.out_dtype = p.src_dtype;
  Tensor dy = torch::stable::new_empty(y, {p.rows, len}), dgp = torch::stable::new_empty(y, {p.rows, len});
  p.out = dy.mutable_data_ptr(), p.out2 = dgp.mutable_data_ptr();
  Tensor sums = run_rows(p, y);
  return {dy, dgp, sums};
}

std::tuple<Tensor, Tensor> rows_gating_grads_cuda(const Tensor& pre, const Tensor& da, const Tensor& db,
                                                  const OptTensor& mask) {
  torch::stable::accelerator::DeviceGuard guard(pre.get_device_index());
  const int64_t len = da.sizes()[da.dim() - 1];
  RowsParams p{};
  p.op = RowsOp::gating_grads;
  p.src_dtype = row_dtype(pre, "pre", 4 * len), p.src2_dtype = row_dtype(da, "da", len);
  p.src3_dtype = row_dtype(db, "db", len);
  p.rows = pre.sizes()[0], p.len = len;
  STD_TORCH_CHECK(da.sizes()[0] == p.rows && db.sizes()[0] == p.rows, "trimul: _rows_gating_grads: row counts differ");
  p.src = pre.const_data_ptr(), p.src2 = da.const_data_ptr(), p.src3 = db.const_data_ptr();
  if (mask.has_value()) {
    STD_TORCH_CHECK(mask->numel() == p.rows && mask->is_contiguous() && dtype_of(*mask, "mask") == DType::f32,
                    "trimul: _rows_gating_grads: mask must be contiguous float32, one value per row");
    p.mask = static_cast<const float*>(mask->const_data_ptr());
  }
  p.out_dtype = p.src2_dtype;  // the operand type of the products that read dpre; pre may be wider
  Tensor dpre = torch::stable::new_empty(da, {p.rows, 4 * len});
  p.out = dpre.mutable_data_ptr();
  Tensor sums = run_rows(p, pre);
  return {dpre, sums};
}

// The gradient's rows go into `into` (its dtype), which may be src or the residual itself: a
// row's values are all read before it is written. Returns the column sums.
Tensor rows_layer_norm_back_into(const Tensor& src, const Tensor& g, const OptTensor& residual, const Tensor& w,
                                 double eps, int64_t residual_mode, const Tensor& into) {
  torch::stable::accelerator::DeviceGuard guard(src.get_device_index());
  const int64_t len = src.sizes()[src.dim() - 1];
  STD_TORCH_CHECK(residual_mode >= 0 && residual_mode <= 2 && (residual_mode == 0) != residual.has_value(),
                  "trimul: _rows_layer_norm_back: a residual goes with modes 1 and 2");
  RowsParams p{};
  p.op = RowsOp::layer_norm_back;
  p.src_dtype = row_dtype(src, "src", len), p.src2_dtype = row_dtype(g, "g", len);
  p.rows = src.sizes()[0], p.len = len, p.eps = static_cast<float>(eps);
  STD_TORCH_CHECK(g.sizes()[0] == p.rows, "trimul: _rows_layer_norm_back: row counts differ");
  p.src = src.const_data_ptr(), p.src2 = g.const_data_ptr();
  p.residual = static_cast<Residual>(residual_mode);
  if (residual.has_value()) {
    p.src3_dtype = row_dtype(*residual, "residual", len);
    STD_TORCH_CHECK(residual->sizes()[0] == p.rows, "trimul: _rows_layer_norm_back: row counts differ");
    p.src3 = residual->const_data_ptr();
  }
  p.w = affine(w, len, "w");
  p.out_dtype = row_dtype(into, "into", len);
  STD_TORCH_CHECK(into.sizes()[0] == p.rows, "trimul: _rows_layer_norm_back: row counts differ");
  p.out = into.mutable_data_ptr();
  return run_rows(p, src);
}

// ---- the output stage's backward in one kernel (out_stage_back.cu) -------------
// c: the contraction's result [B*H][Npad][Npad] in the 16-bit operand type,
// overwritten with dc; dx: written at the lines' positions. Returns chat, u,
// dy, dgp (position-major, the operand type; where the resident form runs, u a
// view of x's rows and, with the gate reading LayerNorm(x), dgp scaled by x's
// rstd: gate_centered) and the column sums (fp32, 2P).
struct OutBackResult {
  Tensor chat, u, dy, dgp, sums;
  bool gate_centered;  // dgp is q = rstd dgp: dL/dWg = (q^T x - m 1^T) diag(gamma_in) + sum(dgp) beta_in^T,
                       // m the row means of q^T x
};

// t's data, checked for the op `op`: contiguous, 16-byte aligned, of dtype `want` and this shape.
const void* kernel_tensor(const Tensor& t, DType want, std::initializer_list<int64_t> shape, const char* op,
                          const char* name) {
  STD_TORCH_CHECK(t.is_contiguous() && dtype_of(t, name) == want && aligned16(t.const_data_ptr()),
                  "trimul: ", op, ": ", name, " must be a contiguous, 16-byte aligned tensor of the ",
                  want == DType::f32 ? "float32" : want == DType::bf16 ? "bfloat16" : "float16", " type");
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  int d = 0;
  for (int64_t n : shape) same = same && t.sizes()[d++] == n;
  STD_TORCH_CHECK(same, "trimul: ", op, ": ", name, " has a wrong shape");
  return t.const_data_ptr();
}

OutBackResult out_stage_back_cuda(
    Tensor c, const Tensor& x, const Tensor& grad, const Tensor& wo_g, const Tensor& wg, const Tensor& s_out,
    const Tensor& t_out, const Tensor& b_gate, const Tensor& g_round, const Tensor& ln_in_w, const Tensor& ln_in_b,
    Tensor dx, int64_t line0, int64_t lines, double eps, bool gate_from_normalized, const RangeScales* headroom) {
  constexpr const char* kOp = "out_stage_back";
  torch::stable::accelerator::DeviceGuard guard(x.get_device_index());
  STD_TORCH_CHECK(x.dim() == 4 && c.dim() == 3 && wo_g.dim() == 2,
                  "trimul: out_stage_back: x must be (B, N, N, P), c (B*H, S, S), wo_g (P, H)");
  OutStageBackParams p{};
  p.B = x.sizes()[0], p.N = x.sizes()[1], p.P = x.sizes()[3], p.H = wo_g.sizes()[1], p.Npad = c.sizes()[1];
  STD_TORCH_CHECK(p.P % 16 == 0 && p.H % 16 == 0 && p.P <= kOutBackMaxWidth && p.H <= kOutBackMaxWidth,
                  "trimul: out_stage_back takes P and H multiples of 16 up to ", kOutBackMaxWidth);
  STD_TORCH_CHECK(line0 >= 0 && lines >= 0 && line0 + lines <= p.B * p.N, "trimul: out_stage_back: lines out of range");
  STD_TORCH_CHECK(line0 + lines < (int64_t{1} << 31) && lines * ceil_div(p.N, kOutBackTileRows) < (int64_t{1} << 31),
                  "trimul: out_stage_back: too many lines for its 32-bit tile indices");
  const DeviceFacts* dev = device_facts(x.get_device_index());
  STD_TORCH_CHECK(dev != nullptr, "trimul: out_stage_back: cannot query the device");
  p.sms = dev->sms, p.smem_optin = dev->max_smem, p.cc = dev->cc;
  p.wgmma = kBuiltSm90a && dev->cc == 90;
  p.op_dtype = dtype_of(c, "c");
  STD_TORCH_CHECK(p.op_dtype == DType::bf16 || p.op_dtype == DType::f16,
                  "trimul: out_stage_back takes 16-bit operands (bfloat16, float16)");
  p.x_dtype = dtype_of(x, "x");
  STD_TORCH_CHECK(is_stored_dtype(p.x_dtype), "trimul: out_stage_back: x must be float32, bfloat16 or float16");
  const auto B = p.B, N = p.N, P = p.P, H = p.H;
  p.c = const_cast<void*>(kernel_tensor(c, p.op_dtype, {B * H, p.Npad, p.Npad}, kOp, "c"));
  STD_TORCH_CHECK(p.Npad == padded_extent(N), "trimul: out_stage_back: c must be padded as the contraction pads");
  p.x = kernel_tensor(x, p.x_dtype, {B, N, N, P}, kOp, "x");
  p.grad = kernel_tensor(grad, p.x_dtype, {B, N, N, P}, kOp, "grad");
  p.dx = const_cast<void*>(kernel_tensor(dx, p.x_dtype, {B, N, N, P}, kOp, "dx"));
  p.wo_g = kernel_tensor(wo_g, p.op_dtype, {P, H}, kOp, "wo_g");
  p.wg = kernel_tensor(wg, p.op_dtype, {P, P}, kOp, "wg");
  p.s_out = affine(s_out, P, "s_out"), p.t_out = affine(t_out, P, "t_out"), p.b_gate = affine(b_gate, P, "b_gate");
  p.g_round = affine(g_round, P, "g_round");
  p.ln_in_w = affine(ln_in_w, P, "ln_in_w"), p.ln_in_b = affine(ln_in_b, P, "ln_in_b");
  STD_TORCH_CHECK(aligned16(p.ln_in_w) && aligned16(p.ln_in_b), "trimul: out_stage_back: LayerNorm affines unaligned");
  p.line0 = line0, p.lines = lines, p.eps = static_cast<float>(eps);
  p.gate_from_normalized = gate_from_normalized;
  p.headroom = headroom;
  const ScalarType op = scalar_type_of(p.op_dtype);
  const OutBackLaunch run = out_stage_back_launch(p);
  Tensor chat = torch::stable::new_empty(c, {lines * N, H}, op);
  // where the resident form runs (x in the operand type there), u is x's rows, handed back rather
  // than written
  Tensor u = run.resident ? slice(torch::stable::view(x, {B * N * N, P}), line0 * N, lines * N)
                          : torch::stable::new_empty(c, {lines * N, P}, op);
  Tensor dy = torch::stable::new_empty(c, {lines * N, P}, op);
  Tensor dgp = torch::stable::new_empty(c, {lines * N, P}, op);
  ColumnSums col(c, run.blocks * run.groups, 2 * P);
  p.chat = chat.mutable_data_ptr(), p.u = run.resident ? nullptr : u.mutable_data_ptr();
  p.dy = dy.mutable_data_ptr(), p.dgp = dgp.mutable_data_ptr();
  p.partial = col.partial_ptr();
  p.sums = col.sums_ptr();
  check_cuda(launch_out_stage_back(p, run, stream_of(x)), "out_stage_back");
  return {chat, u, dy, dgp, col.sums, run.gate_centered};
}

// ---- the input stage's backward, front half (ln_proj_gate_mma.cu, kBack) -----
// The chunk (batch entries [b0, b1), natural rows [lo, hi)): the forward's
// LayerNorm and products (on the parameters as stage_tiled_input staged
// them), and from da and db (the contraction's gradients, [B*H][Npad][Npad] in
// the 16-bit operand type) dpre [rows][4H] (PackedLayout's w_in row order),
// xn [rows][P] and the column sums of dpre (fp32, the same order); rows in the
// chunk's natural order. Where the launch finishes the stage's backward (input_back_finishes:
// the resident form at P = 128 with four weight chunks), also du = dpre W_in and LayerNorm's
// gradient into the chunk's rows of dx (x's shape and the operand type, as x; the gate input's
// gradient in, added to LayerNorm's output gradient where residual_before, else to its input
// gradient; the pair's out), the sums then followed by LayerNorm's (g xhat, g: 2P), `finished`
// true, dpre's rows rstd dpre and no xn (InputBackParams::dx).
struct InputBackResult {
  Tensor dpre;
  std::optional<Tensor> xn;
  Tensor sums;
  bool finished;
};
InputBackResult run_input_back(const Staged& s, const Tensor& x, const OptTensor& mask, const Tensor& da,
                               const Tensor& db, const Tensor& dx, bool residual_before, bool incoming, int64_t b0,
                               int64_t b1, int64_t lo, int64_t hi, cudaStream_t stream,
                               const GradScale* grad = nullptr) {
  constexpr const char* kOp = "input_back";
  const int64_t B = s.prob.B, N = s.prob.N, P = s.prob.P, H = s.prob.H, Npad = s.prob.Npad;
  const DType op = s.ab_dtype;
  STD_TORCH_CHECK(s.mma, "trimul: ", kOp, ": the tensor-core input stage does not take this call");
  STD_TORCH_CHECK(P % 8 == 0, "trimul: ", kOp, " takes P a multiple of 8");
  STD_TORCH_CHECK(0 <= b0 && b0 <= b1 && b1 <= B && 0 <= lo && lo <= hi && hi <= N,
                  "trimul: ", kOp, ": chunk out of range");
  STD_TORCH_CHECK(!incoming || lo % 8 == 0, "trimul: ", kOp, ": an incoming chunk starts at a multiple of 8 rows");
  const int64_t rows = (b1 - b0) * (hi - lo) * N;
  const ScalarType op_type = scalar_type_of(op);
  if (rows == 0)
    return {torch::stable::new_empty(x, {0, 4 * H}, op_type), torch::stable::new_empty(x, {0, P}, op_type),
            torch::stable::new_zeros(x, {4 * H}, ScalarType::Float), false};
  InputBackParams q{};
  q.in = input_params(s, x, mask, incoming ? 0 : 1);  // (direction 0: incoming; x_stats stays nullptr)
  q.da = kernel_tensor(da, op, {B * H, Npad, Npad}, kOp, "da");
  q.db = kernel_tensor(db, op, {B * H, Npad, Npad}, kOp, "db");
  Tensor dpre = torch::stable::new_empty(x, {rows, 4 * H}, op_type);
  q.dpre = dpre.mutable_data_ptr();
  q.b0 = b0, q.b1 = b1, q.lo = lo, q.hi = hi, q.incoming = incoming;
  q.grad = grad;
  const bool finish = input_back_finishes(q);
  std::optional<Tensor> xn;
  if (!finish) {
    xn = torch::stable::new_empty(x, {rows, P}, op_type);
    q.xn = xn->mutable_data_ptr();
  } else {
    STD_TORCH_CHECK(x.is_contiguous() && dx.is_contiguous() && dx.dim() == 4 && dx.sizes()[0] == B &&
                        dx.sizes()[1] == N && dx.sizes()[2] == N && dx.sizes()[3] == P && dtype_of(dx, "dx") == op,
                    "trimul: ", kOp, ": dx must be contiguous, of x's shape and the operand type, and x contiguous");
    q.dx = dx.mutable_data_ptr(), q.residual_before = residual_before;
  }
  const int64_t blocks = input_back_blocks(q), cols = 4 * H + (finish ? 2 * P : 0);
  ColumnSums col(x, blocks, cols);
  q.partial = col.partial_ptr();
  check_cuda(launch_input_back(q, stream), "input_back");
  check_cuda(launch_column_sums(q.partial, blocks, cols, col.sums_ptr(), stream), "input_back column sums");
  return {dpre, xn, col.sums, finish};
}

// ---- the input stage's backward over chunks of positions ------------------------
// A sum over chunks, in chunk order: the one part as it is, the sum of several in fp32 (the
// first part converted, exactly).
void accumulate(std::optional<Tensor>& total, const Tensor& part) {
  if (!total) {
    total = part;
    return;
  }
  total = add(torch::stable::to(*total, ScalarType::Float), part);
}

// The chunks of the per-position stages (trimul/backward.py: _chunks gives the same; trimul._C.chunks
// hands these to its test): whole batch entries where one holds fewer than `step` positions, else runs
// of a multiple of 8 rows (input_back reads an incoming chunk's da and db from its first row). As many
// chunks as `step` asks for, of even sizes: the last one is not a short tail that leaves the
// persistent kernels' SMs idle.
struct Chunk { int64_t b0, b1, i0, i1; };
std::vector<Chunk> chunks_of(int64_t B, int64_t N, int64_t step) {
  std::vector<Chunk> chunks;
  if (N * N <= step) {
    const int64_t n = ceil_div(B, step / (N * N));
    for (int64_t k = 0; k < n; ++k) chunks.push_back({k * B / n, (k + 1) * B / n, 0, N});
  } else {  // n runs of 8-row units each
    const int64_t units = ceil_div(N, 8), n = ceil_div(units, std::max<int64_t>(1, step / N / 8));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t k = 0; k < n; ++k)
        chunks.push_back({b, b + 1, 8 * (k * units / n), std::min(8 * ((k + 1) * units / n), N)});
  }
  return chunks;
}

// Positions [b0:b1, i0:i1] of a contiguous [B, N, N, C] tensor as (positions, C) rows (a view).
Tensor rows_of(Tensor t4, const Chunk& ch) {
  Tensor part = torch::stable::narrow(t4, 0, ch.b0, ch.b1 - ch.b0);
  part = torch::stable::narrow(part, 1, ch.i0, ch.i1 - ch.i0);
  return torch::stable::view(part, {(ch.b1 - ch.b0) * (ch.i1 - ch.i0) * t4.sizes()[2], t4.sizes()[3]});
}

// Whether input_back takes the backward of calls at (P, H): the tensor-core input stage (any operand
// type; P a multiple of 8) with its tiles and column sums in the device's shared memory, or its
// resident form (which plan() checks). (B and N do not enter: plan() forced onto the tiled
// pipeline decides on P and H.)
bool input_back_takes(int64_t P, int64_t H, Precision prec, DType x_dtype, int device) {
  const DeviceFacts* dev = device_facts(device);
  if (dev == nullptr || P % 8 != 0) return false;
  const Plan chosen = plan(1, 1, P, H, prec, x_dtype, device, static_cast<int64_t>(Path::tiled_mma));
  const DType operand = operand_dtype(prec);
  const int64_t raw_x_bytes = x_dtype == operand ? 0 : element_bytes(x_dtype);
  return chosen.path != Path::tiled_fp32 &&
         (chosen.resident || input_back_smem(P, element_bytes(operand), raw_x_bytes) <= static_cast<size_t>(dev->max_smem));
}

// The input stage's backward, chunk by chunk: input_back (LayerNorm, the products and the gating
// gradients, from da and db as the contraction leaves them), then du = dpre W_in and LayerNorm's
// gradient by the row kernel into dx's rows in place (dx holds the gate input's gradient, added to
// LayerNorm's output gradient where the gate reads the normalized input, else to its input
// gradient: the rows are LayerNorm's residual, each read before it is written), or both in
// input_back's launch where it finishes the stage (run_input_back). Returns the input
// LayerNorm's column sums (g xhat, g; 2P) and b_in's gradient, fp32, and w_in's (fp32: mm_f32),
// in the pack's interleaved row order
// (4h + {proj_a, gate_a, proj_b, gate_b}: [4H][P], [4H]). Where input_back finishes the stage
// (every chunk's launch or none: the form depends on the shape), w_in's is q^T x in fp32 instead and
// `centered` true: the gradient is (q^T x - m 1^T) diag(gamma_in) + sum(dpre) beta_in^T
// (InputBackParams::dx; param_grads or centered_rows forms it).
struct InputStageBack {
  Tensor in_sums, d_w_in, d_b_in;
  bool centered;
};
InputStageBack input_stage_back(const Staged& staged, const Tensor& xk, const OptTensor& mask, const Tensor& da,
                                const Tensor& db, const Tensor& dx, bool incoming, bool gate_from_normalized,
                                double eps, const std::vector<Chunk>& chunks, cudaStream_t stream,
                                const GradScale* grad = nullptr) {
  const int64_t P = staged.prob.P, H = staged.prob.H;
  const PackedLayout L = staged.prob.layout;
  const Tensor lnw_in = slice(staged.workspace, L.ln_in_w, P);
  // w_in in the pack's interleaved row order, dpre's, in the operand type: made for the first
  // chunk whose input_back does not finish the stage
  std::optional<Tensor> w_in_k;
  std::optional<Tensor> d_w_in, d_b_in, in_sums;
  bool centered = false;
  for (const Chunk& ch : chunks) {
    const auto [dpre, xn, sums, finished] = run_input_back(staged, xk, mask, da, db, dx, gate_from_normalized,
                                                           incoming, ch.b0, ch.b1, ch.i0, ch.i1, stream, grad);
    STD_TORCH_CHECK(!d_w_in || finished == centered, "trimul: input_back finished some chunks and not others");
    centered = finished;
    // (q^T x in fp32: its row means are subtracted, a difference of large sums where x's rows have
    // large means)
    accumulate(d_w_in, positions_product(dpre, finished ? rows_of(xk, ch) : *xn));
    if (finished) {
      accumulate(d_b_in, slice(sums, 0, 4 * H));
      accumulate(in_sums, slice(sums, 4 * H, 2 * P));
      continue;
    }
    accumulate(d_b_in, sums);
    if (!w_in_k)
      w_in_k = torch::stable::to(torch::stable::view(slice(staged.workspace, L.w_in, 4 * H * P), {4 * H, P}),
                                 scalar_type_of(staged.ab_dtype));
    const Tensor dx_rows = rows_of(dx, ch);
    accumulate(in_sums, rows_layer_norm_back_into(rows_of(xk, ch), mm(dpre, *w_in_k), dx_rows, lnw_in, eps,
                                                  gate_from_normalized ? 1 : 2, dx_rows));
  }
  return {*in_sums, *d_w_in, *d_b_in, centered};
}

// The input stage's backward as an op, for trimul/backward.py's stage-by-stage sequence (calls
// trimul::_backward_fused does not take): da and db as the contraction leaves them
// ([B*H, Npad, Npad], the operand type), dx ([B, N, N, P]: the gate input's gradient in, the
// pair's out; x's dtype where 16-bit, else fp32). Returns the input LayerNorm's column sums (2P),
// and w_in's and b_in's gradients in trimul.forward's order of the four projections
// (proj_a, gate_a, proj_b, gate_b: [4H][P], [4H]), fp32. `step` as _backward_fused's. `grad_scale`,
// where given: the GradScale of da and db from fp16 products (_rows_to_pair_fp16), read times its
// `unscale`.
std::tuple<Tensor, Tensor, Tensor> input_stage_back_cuda(const Tensor& x, const OptTensor& mask, TRIMUL_PARAM_ARGS,
                                                         const Tensor& da, const Tensor& db, const Tensor& dx,
                                                         int64_t direction, int64_t gate_input, double eps,
                                                         int64_t precision, int64_t step, const OptTensor& grad_scale) {
  constexpr const char* kOp = "_input_stage_back_cuda";
  const BackwardCall call(x, proj_a_weight, direction, precision);
  const auto& [device_guard, xk, stream, B, N, P, H, prec] = call;
  const DType x_dtype = dtype_of(x, "x");
  STD_TORCH_CHECK(B * N > 0 && step > 0, "trimul: ", kOp, ": no positions or a bad chunk size");
  STD_TORCH_CHECK(input_back_takes(P, H, prec, x_dtype, x.get_device_index()), "trimul: ", kOp,
                  ": the tensor-core input stage's backward does not take this call (trimul._C.input_back_takes)");
  STD_TORCH_CHECK(dx.dim() == 4 && dx.sizes()[0] == B && dx.sizes()[1] == N && dx.sizes()[2] == N &&
                      dx.sizes()[3] == P && dx.is_contiguous(),
                  "trimul: ", kOp, ": dx must be a contiguous tensor of x's shape");
  const GradScale* grad = grad_scale.has_value()
                              ? device_struct<GradScale>(*grad_scale, x, kOp, "grad_scale", "_rows_to_pair_fp16")
                              : nullptr;
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  const Staged staged = stage_tiled_input(xk, params, H, eps, prec, true, stream);
  const auto [in_sums, raw_w_in, d_b_in, centered] = input_stage_back(
      staged, xk, mask, da, db, dx, direction == 0, gate_input == 1, eps, chunks_of(B, N, step), stream, grad);
  Tensor d_w_in = raw_w_in;
  if (centered) {
    const PackedLayout L = staged.prob.layout;
    const float* pack = static_cast<const float*>(staged.workspace.const_data_ptr());
    d_w_in = torch::stable::new_empty(raw_w_in, {4 * H, P}, ScalarType::Float);
    check_cuda(launch_centered_rows(static_cast<const float*>(raw_w_in.const_data_ptr()), pack + L.ln_in_w,
                                    pack + L.ln_in_b, static_cast<const float*>(d_b_in.const_data_ptr()), 4 * H, P,
                                    static_cast<float*>(d_w_in.mutable_data_ptr()), stream),
               "centered_rows");
  }
  // ([H][4] -> [4][H])
  const Tensor w_blocks = torch::stable::contiguous(
      torch::stable::transpose(torch::stable::view(torch::stable::to(d_w_in, ScalarType::Float), {H, 4, P}), 0, 1));
  const Tensor b_blocks = torch::stable::contiguous(t2(torch::stable::view(d_b_in, {H, 4})));
  return {in_sums, torch::stable::view(w_blocks, {4 * H, P}), torch::stable::view(b_blocks, {4 * H})};
}

// ---- the backward where both stages' backward kernels take it, as one op -------
// The steps trimul/backward.py takes for other calls, around the two fused
// kernels, with the parameters staged once for the recomputation of a and b
// and every chunk of input_back, and c freed before the input stage. Taken at
// 16-bit operands with P and H multiples of 16 up to kOutBackMaxWidth
// (out_stage_back's limits). (Issuing the operators from here
// rather than from Python saves under a µs each: benchmarks/NOTES.md.)

// The gradients of x (in x's dtype when 16-bit, else fp32) and of the 16
// parameters, fp32, one after another in trimul.forward's order and shapes
// (defaults' gradients included). `step`: positions per chunk of the
// per-position stages (trimul/backward.py: _chunks gives the same chunks). `product`: the
// forward's contraction result (forward_keep_product_cuda) where it was kept, which becomes
// dc in place; else c is computed again.
std::tuple<Tensor, Tensor> backward_fused_cuda(const Tensor& grad, const Tensor& x, const OptTensor& mask,
                                               TRIMUL_PARAM_ARGS, int64_t direction, int64_t gate_input, double eps,
                                               int64_t precision, int64_t step, const OptTensor& product) {
  constexpr const char* kOp = "_backward_fused";
  const BackwardCall call(x, proj_a_weight, direction, precision);
  const auto& [device_guard, xk, stream, B, N, P, H, prec] = call;
  const DType op = operand_dtype(prec);
  STD_TORCH_CHECK(op == DType::bf16 || op == DType::f16, "trimul: ", kOp, " takes 16-bit operands");
  STD_TORCH_CHECK(P % 16 == 0 && H % 16 == 0 && P <= kOutBackMaxWidth && H <= kOutBackMaxWidth, "trimul: ", kOp,
                  " takes P and H multiples of 16 up to ", kOutBackMaxWidth);
  STD_TORCH_CHECK(B * N > 0 && step > 0, "trimul: ", kOp, ": no positions or a bad chunk size");
  STD_TORCH_CHECK(grad.dim() == 4 && grad.sizes()[0] == B && grad.sizes()[1] == N && grad.sizes()[2] == N &&
                      grad.sizes()[3] == P, "trimul: ", kOp, ": grad must have x's shape");
  const DType x_dtype = dtype_of(x, "x");
  const ScalarType op_type = scalar_type_of(op);
  const ScalarType dx_type = scalar_type_of(x_dtype == DType::f32 ? DType::f32 : x_dtype);
  const Tensor gk = torch::stable::contiguous(
      dtype_of(grad, "grad") == x_dtype ? grad : torch::stable::to(grad, scalar_type_of(x_dtype)));

  // a and b again, with every parameter in fp32 as the stages read them (one staging of the
  // parameters for this and every chunk of input_back); a, b and c held by optionals alone, so
  // that each is freed where trimul/backward.py frees it
  const OptTensor params[kParams] = TRIMUL_PARAM_LIST;
  // fp16 operands: c's headroom as the forward takes it, so that c (the kept one or computed below)
  // is c times 2^-2t and every product here is of the weights as the pack scaled them; param_grads
  // then scales the projections' gradients back
  std::optional<Tensor> headroom;
  if (op == DType::f16) headroom = c_headroom(xk, mask, params, xk.get_device_index(), stream);
  const RangeScales* const headroom_at =
      headroom ? static_cast<const RangeScales*>(headroom->const_data_ptr()) : nullptr;
  const Staged staged = stage_tiled_input(xk, params, H, eps, prec, true, stream, headroom_at);
  std::optional<Tensor> a, b;
  std::tie(a, b) = input_stage(staged, input_params(staged, xk, mask, direction), xk, stream);
  const Tensor& packed = staged.workspace;
  const PackedLayout L = packed_layout(P, H);
  const Tensor lnw_in = slice(packed, L.ln_in_w, P), lnb_in = slice(packed, L.ln_in_b, P);
  const Tensor bg32 = slice(packed, L.b_gate, P);
  const float* const pack = static_cast<const float*>(packed.const_data_ptr());

  const std::vector<Chunk> chunks = chunks_of(B, N, step);

  // output stage: c becomes dc; the gate input's gradient goes into dx. Its weights (one launch):
  // Wo' = Wo gamma_out with its row sums as stored, t = Wo beta_out + bo (y = rstd (c W'^T - mean s) + t),
  // and Wg with the row sums of its rounding (g_round)
  std::optional<Tensor> c;
  if (product.has_value()) {
    const Tensor& kept = *product;
    STD_TORCH_CHECK(kept.dim() == 3 && kept.sizes()[0] == B * H && kept.sizes()[1] == a->sizes()[1] &&
                        kept.sizes()[2] == a->sizes()[2] && kept.is_contiguous() && dtype_of(kept, "product") == op,
                    "trimul: ", kOp, ": product must be the forward's contraction result, [B*H, S, S] in the ",
                    "operand type");
    c = kept;
  } else {
    c = contraction(*a, *b, GemmForm::ab_t, prec, false, stream);
  }
  Tensor dx = torch::stable::new_empty(x, {B, N, N, P}, dx_type);
  const Tensor op_weights = torch::stable::new_empty(x, {P * H + P * P}, op_type);
  const Tensor out_sums = torch::stable::new_empty(x, {3 * P}, ScalarType::Float);
  const Tensor wo_g = torch::stable::view(slice(op_weights, 0, P * H), {P, H});
  const Tensor wg_op = torch::stable::view(slice(op_weights, P * H, P * P), {P, P});  // (16-byte aligned)
  const Tensor s_out = slice(out_sums, 0, P), t_out = slice(out_sums, P, P), g_round = slice(out_sums, 2 * P, P);
  OutBackWeightsParams ow{};
  ow.packed = pack, ow.layout = L, ow.P = P, ow.H = H, ow.op_dtype = op;
  ow.wo_g = op_weights.mutable_data_ptr();
  ow.wg = static_cast<char*>(ow.wo_g) + P * H * element_bytes(op);
  ow.s_out = static_cast<float*>(out_sums.mutable_data_ptr());
  ow.t_out = ow.s_out + P;
  ow.g_round = ow.s_out + 2 * P;
  check_cuda(launch_out_back_weights(ow, stream), "out_back_weights");
  std::optional<Tensor> m_wo, d_wg, gate_sums;  // m_wo: dy^T chat
  bool gate_centered = false;  // (every chunk's the same: the form depends on the shape alone)
  for (const Chunk& ch : chunks) {
    const OutBackResult r =
        out_stage_back_cuda(*c, xk, gk, wo_g, wg_op, s_out, t_out, bg32, g_round, lnw_in, lnb_in, dx,
                            ch.b0 * N + ch.i0, (ch.b1 - ch.b0) * (ch.i1 - ch.i0), eps, gate_input == 1, headroom_at);
    accumulate(m_wo, positions_product(r.dy, r.chat));
    // (where gate_centered, q^T x: param_grads subtracts its row means)
    accumulate(d_wg, positions_product(r.dgp, r.u));
    accumulate(gate_sums, r.sums);  // dy, dgp (P each)
    gate_centered = r.gate_centered;
  }
  // da needs b, db needs a: four N^2 H tensors at most
  const Tensor da = contraction(*c, *b, GemmForm::a_b, prec, false, stream);
  b.reset();
  const Tensor db = contraction(*c, *a, GemmForm::at_b, prec, false, stream);
  a.reset();
  // a kept product's memory goes now: the caller's reference to it would hold it to the end
  if (product.has_value()) aten_call<1>("aten::set_", "", {torch::stable::detail::from(*product)});
  c.reset();

  const auto [in_sums, d_w_in, d_b_in, in_centered] =
      input_stage_back(staged, xk, mask, da, db, dx, direction == 0, gate_input == 1, eps, chunks, stream);

  // the parameters' gradients in trimul.forward's order (one launch): w_in's and b_in's rows back
  // from the interleaved order; dL/dWo = dy^T (chat gamma + beta) = (dy^T chat) gamma + (sum dy) beta^T,
  // and the output LayerNorm's affine from the same products (dcn = dy Wo): dgamma = sum(dcn chat)
  // = sum_p Wo (dy^T chat), dbeta = sum(dcn) = Wo^T sum(dy)
  STD_TORCH_CHECK(d_w_in.is_contiguous() && m_wo->is_contiguous() && d_wg->is_contiguous(),
                  "trimul: ", kOp, ": the weight gradients' products are not contiguous");
  Tensor grads = torch::stable::new_empty(x, {param_grads_size(P, H)}, ScalarType::Float);
  ParamGradsParams pg{};
  pg.packed = pack, pg.layout = L, pg.P = P, pg.H = H;
  pg.in_sums = static_cast<const float*>(in_sums.const_data_ptr());
  pg.d_w_in = d_w_in.const_data_ptr(), pg.d_w_in_dtype = dtype_of(d_w_in, "d_w_in");
  pg.d_b_in = static_cast<const float*>(d_b_in.const_data_ptr());
  pg.m_wo = m_wo->const_data_ptr(), pg.m_wo_dtype = dtype_of(*m_wo, "m_wo");
  pg.d_wg = d_wg->const_data_ptr(), pg.d_wg_dtype = dtype_of(*d_wg, "d_wg");
  pg.gate_sums = static_cast<const float*>(gate_sums->const_data_ptr());
  pg.gate_centered = gate_centered;
  pg.in_centered = in_centered;
  pg.headroom = headroom_at;
  pg.grads = static_cast<float*>(grads.mutable_data_ptr());
  check_cuda(launch_param_grads(pg, stream), "param_grads");
  return {dx, grads};
}

// What plan() picks for a call, for trimul.info and the tests: a Path code, whether the input
// stage takes wgmma, whether its weights stay resident, and whether the output stage then runs
// its resident form (ln_out_proj_gate_resident_takes() for a contiguous x of this shape).
std::tuple<int64_t, bool, bool, bool> plan_query(int64_t B, int64_t N, int64_t P, int64_t H, int64_t precision,
                                                 int64_t x_dtype, int64_t device) {
  STD_TORCH_CHECK(precision >= 0 && precision <= 3, "trimul: bad precision code ", precision);
  const Precision prec = static_cast<Precision>(precision);
  const Plan chosen = plan(B, N, P, H, prec, static_cast<DType>(x_dtype), static_cast<int>(device));
  LnOutProjGateParams out{};
  out.B = B, out.N = N, out.P = P, out.H = H;
  out.x_dtype = static_cast<DType>(x_dtype);
  out.x_rows_vec16 = (P * element_bytes(out.x_dtype)) % 16 == 0;
  out.c_dtype = operand_dtype(prec);
  out.resident_blocks = chosen.out_resident ? 1 : 0;
  return {static_cast<int64_t>(chosen.path), chosen.wgmma, chosen.resident, ln_out_proj_gate_resident_takes(out)};
}

}  // namespace

bool input_back_takes_call(int64_t P, int64_t H, int64_t precision, int64_t x_dtype, int64_t device) {
  const DType x = static_cast<DType>(x_dtype);
  return precision >= 0 && precision <= 3 && is_stored_dtype(x) &&
         input_back_takes(P, H, static_cast<Precision>(precision), x, static_cast<int>(device));
}

bool range_takes_call(int64_t B, int64_t N, int64_t P, int64_t H, int64_t device) {
  return B >= 1 && N >= 1 && P >= 1 && H >= 1 && range_plan(B, N, P, H, static_cast<int>(device)).has_value();
}

// Where the fp16 stages take the forward (range_plan) at (P, H) on this device: their conditions
// past P, H and the device are 32-bit tile numbers, which no pair that fits in memory passes.
bool range_backward_takes_call(int64_t P, int64_t H, int64_t device) {
  return P >= 1 && H >= 1 && range_plan(1, 64, P, H, static_cast<int>(device)).has_value();
}

bool own_contraction_call(int64_t batch, int64_t N, int64_t precision, bool matmul_tf32) {
  return precision >= 0 && precision <= 3 &&
         own_contraction(GemmForm::ab_t, static_cast<Precision>(precision), batch, padded_extent(N), matmul_tf32);
}

bool timed_pick_call(int64_t batch, int64_t Npad) { return timed_pick(batch, Npad); }

std::vector<std::array<int64_t, 4>> chunks_call(int64_t B, int64_t N, int64_t step) {
  std::vector<std::array<int64_t, 4>> out;
  for (const Chunk& c : chunks_of(B, N, step)) out.push_back({c.b0, c.b1, c.i0, c.i1});
  return out;
}
}  // namespace trimul

STABLE_TORCH_LIBRARY_FRAGMENT(trimul, m) {
  m.def("_plan(int B, int N, int P, int H, int precision, int x_dtype, int device) -> (int, bool, bool, bool)");
  m.def(
      "_forward_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, int direction, int gate_input, float eps, "
      "int precision, int kernel, bool matmul_tf32) -> Tensor");
  m.def(
      "_forward_keep_product_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, int direction, int gate_input, float eps, "
      "int precision, int kernel, bool matmul_tf32) -> (Tensor, Tensor)");
  m.def(
      "_input_products_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, int direction, float eps, int precision) "
      "-> (Tensor, Tensor, Tensor)");
  // the input stage's backward for the stage-by-stage sequence: dx (the gate input's gradient)
  // becomes the pair's in place; returns the input LayerNorm's column sums, w_in's and b_in's gradients
  m.def(
      "_input_stage_back_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, Tensor da, Tensor db, Tensor(a!) dx, int direction, "
      "int gate_input, float eps, int precision, int step, Tensor? grad_scale=None) -> (Tensor, Tensor, Tensor)");
  // c's headroom at fp16 operands: 2^-t, the projections' scale (a one-element fp32 tensor)
  m.def(
      "_fp16_headroom_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias) -> Tensor");
  // the tf32 backward's contraction gradients on fp16 operands: a and b on the fp16 stages (with the
  // pack and the RangeScales), dc into an fp16 pair with its GradScale
  m.def(
      "_input_products_fp16_cuda(Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, int direction, float eps) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("_rows_to_pair_fp16(Tensor rows, int S, Tensor scales) -> (Tensor, Tensor)");
  m.def("_pair_to_rows_fp16(Tensor pair, int N, Tensor scales) -> Tensor");
  m.def("_pair_to_rows(Tensor t, int N, bool swap) -> Tensor");
  m.def("_rows_to_pair(Tensor rows, int S, bool swap) -> Tensor");
  // out_dtype: a DType code (0 float32, 2 bfloat16, 3 float16)
  m.def("_rows_layer_norm(Tensor src, Tensor w, Tensor b, float eps, int out_dtype) -> Tensor");
  m.def("_rows_gate_grads(Tensor y, Tensor gpre, Tensor G) -> (Tensor, Tensor, Tensor)");
  m.def("_rows_gating_grads(Tensor pre, Tensor da, Tensor db, Tensor? mask) -> (Tensor, Tensor)");
  // writes the gradient's rows into `into` (src or the residual may be it), returns the column sums
  m.def("_rows_layer_norm_back(Tensor src, Tensor g, Tensor? residual, Tensor w, float eps, int residual_mode, "
        "Tensor(a!) into) -> Tensor");
  m.def(
      "_backward_fused(Tensor grad, Tensor x, Tensor? mask, Tensor? ln_in_weight, Tensor? ln_in_bias, "
      "Tensor proj_a_weight, Tensor? proj_a_bias, Tensor gate_a_weight, Tensor? gate_a_bias, "
      "Tensor proj_b_weight, Tensor? proj_b_bias, Tensor gate_b_weight, Tensor? gate_b_bias, "
      "Tensor? ln_out_weight, Tensor? ln_out_bias, Tensor out_proj_weight, Tensor? out_proj_bias, "
      "Tensor out_gate_weight, Tensor? out_gate_bias, int direction, int gate_input, float eps, "
      "int precision, int step, Tensor(a!)? product=None) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(trimul, CUDA, m) {
  m.impl("_forward_cuda", TORCH_BOX(&trimul::forward_cuda));
  m.impl("_forward_keep_product_cuda", TORCH_BOX(&trimul::forward_keep_product_cuda));
  m.impl("_input_products_cuda", TORCH_BOX(&trimul::input_products_cuda));
  m.impl("_input_stage_back_cuda", TORCH_BOX(&trimul::input_stage_back_cuda));
  m.impl("_fp16_headroom_cuda", TORCH_BOX(&trimul::fp16_headroom_cuda));
  m.impl("_input_products_fp16_cuda", TORCH_BOX(&trimul::input_products_fp16_cuda));
  m.impl("_rows_to_pair_fp16", TORCH_BOX(&trimul::rows_to_pair_fp16_cuda));
  m.impl("_pair_to_rows_fp16", TORCH_BOX(&trimul::pair_to_rows_fp16_cuda));
  m.impl("_pair_to_rows", TORCH_BOX(&trimul::pair_to_rows_cuda));
  m.impl("_rows_to_pair", TORCH_BOX(&trimul::rows_to_pair_cuda));
  m.impl("_rows_layer_norm", TORCH_BOX(&trimul::rows_layer_norm_cuda));
  m.impl("_rows_gate_grads", TORCH_BOX(&trimul::rows_gate_grads_cuda));
  m.impl("_rows_gating_grads", TORCH_BOX(&trimul::rows_gating_grads_cuda));
  m.impl("_rows_layer_norm_back", TORCH_BOX(&trimul::rows_layer_norm_back_into));
  m.impl("_backward_fused", TORCH_BOX(&trimul::backward_fused_cuda));
}
STABLE_TORCH_LIBRARY_IMPL(trimul, CompositeExplicitAutograd, m) { m.impl("_plan", TORCH_BOX(&trimul::plan_query)); }
