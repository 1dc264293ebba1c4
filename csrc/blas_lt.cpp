// The 16-bit contraction and its gradients through cuBLASLt (csrc/blas_lt.h).
//
// torch's bmm reaches cuBLAS through its own heuristic, which at N = 512 to 1024 picks a kernel
// slower than others cuBLASLt offers for the same call (benchmarks/NOTES.md, "Power" and "The
// contraction's kernel timed per size"): 192 x 192 tiles at N = 768 where a 128 x 128 one is 8 %
// faster, 256 x 128 at N = 1024 where 176 x 128 is 5 % faster, each giving the same bits; at
// N = 256 its own kernel is as fast as any. So each form times torch's bmm against cuBLASLt's
// candidates once per size (up to the binding's limit: csrc/trimul.cpp, kTimedPickMaxFmas) and
// keeps a candidate only where it also gave bmm's bits on the call's operands.
// cuBLASLt comes from the library the process already has (torch's), opened by name at the first
// call, its C interface declared below as cublasLt.h of CUDA 12 and 13 has it (the build's
// toolkit ships no cuBLAS headers).
#include "blas_lt.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace trimul {
namespace {

// At most this many of cuBLASLt's heuristic candidates are timed.
constexpr int kLtCandidates = 8;
// A candidate is kept where its time is below this share of the other way's, and candidates timed
// within the same share of the fastest count as equally fast, cuBLASLt's order deciding among them
// (timing noise between kernels of equal speed would otherwise pick at random, and differently from
// one process to the next).
constexpr float kLtPickMargin = 0.98f;
// Each way (torch's bmm, each candidate) warms up, then is timed this many times, interleaved;
// its best time counts. A time is that of back-to-back calls spanning about kLtTimedSpanMs (at
// most kLtMaxCalls calls), the count set by the other way's warm-up time, so that small planes'
// kernels of ~10 us are not measured by one event pair each.
constexpr int kLtTimedRounds = 3;
constexpr float kLtTimedSpanMs = 0.5f;
constexpr int kLtMaxCalls = 32;

// cuBLASLt's types and codes (cublasLt.h, cublas_api.h, library_types.h).
using LtStatus = int;  // cublasStatus_t
constexpr LtStatus kLtSuccess = 0;
struct LtAlgo {  // cublasLtMatmulAlgo_t
  uint64_t data[8];
};
struct LtHeuristic {  // cublasLtMatmulHeuristicResult_t
  LtAlgo algo;
  size_t workspace_size;
  LtStatus state;
  float waves;
  int reserved[4];
};
constexpr int kOpN = 0, kOpT = 1;                  // cublasOperation_t
constexpr int kCompute32F = 68;                    // cublasComputeType_t CUBLAS_COMPUTE_32F
constexpr int kTypeF32 = 0, kTypeF16 = 2, kTypeBF16 = 14;  // cudaDataType_t
constexpr int kDescTransA = 3, kDescTransB = 4;    // cublasLtMatmulDescAttributes_t
constexpr int kLayoutBatchCount = 5, kLayoutBatchStride = 6;  // cublasLtMatrixLayoutAttribute_t
constexpr int kPrefMaxWorkspace = 1;               // cublasLtMatmulPreferenceAttributes_t
constexpr int kAlgoSplitK = 2;                     // cublasLtMatmulAlgoConfigAttributes_t

struct LtApi {
  LtStatus (*create)(void** handle);
  LtStatus (*desc_create)(void** desc, int compute, int scale_type);
  LtStatus (*desc_destroy)(void* desc);
  LtStatus (*desc_set)(void* desc, int attr, const void* buf, size_t size);
  LtStatus (*layout_create)(void** layout, int type, uint64_t rows, uint64_t cols, int64_t ld);
  LtStatus (*layout_set)(void* layout, int attr, const void* buf, size_t size);
  LtStatus (*layout_destroy)(void* layout);
  LtStatus (*pref_create)(void** pref);
  LtStatus (*pref_set)(void* pref, int attr, const void* buf, size_t size);
  LtStatus (*pref_destroy)(void* pref);
  LtStatus (*heuristic)(void* handle, void* desc, void* a, void* b, void* c, void* d, void* pref, int requested,
                        LtHeuristic* results, int* returned);
  LtStatus (*algo_config_get)(const LtAlgo* algo, int attr, void* buf, size_t size, size_t* written);
  LtStatus (*matmul)(void* handle, void* desc, const void* alpha, const void* a, void* a_layout, const void* b,
                     void* b_layout, const void* beta, const void* c, void* c_layout, void* d, void* d_layout,
                     const LtAlgo* algo, void* workspace, size_t workspace_size, cudaStream_t stream);
};

template <typename Fn>
bool resolve(void* lib, const char* name, Fn*& fn) {
  fn = reinterpret_cast<Fn*>(dlsym(lib, name));
  return fn != nullptr;
}

// The process's cuBLASLt (torch's, already loaded where torch runs on CUDA), or nullptr.
const LtApi* lt_api() {
  static const LtApi* const api = []() -> const LtApi* {
    const char* off = std::getenv("TRIMUL_BLASLT");
    if (off != nullptr && std::strcmp(off, "0") == 0) return nullptr;
    static const char* const kNames[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
    void* lib = nullptr;
    for (int flags : {RTLD_NOW | RTLD_NOLOAD, RTLD_NOW})
      for (const char* name : kNames)
        if (lib == nullptr) lib = dlopen(name, flags);
    if (lib == nullptr) return nullptr;
    static LtApi loaded{};
    const bool ok = resolve(lib, "cublasLtCreate", loaded.create) &&
                     resolve(lib, "cublasLtMatmulDescCreate", loaded.desc_create) &&
                     resolve(lib, "cublasLtMatmulDescDestroy", loaded.desc_destroy) &&
                     resolve(lib, "cublasLtMatmulDescSetAttribute", loaded.desc_set) &&
                     resolve(lib, "cublasLtMatrixLayoutCreate", loaded.layout_create) &&
                     resolve(lib, "cublasLtMatrixLayoutSetAttribute", loaded.layout_set) &&
                     resolve(lib, "cublasLtMatrixLayoutDestroy", loaded.layout_destroy) &&
                     resolve(lib, "cublasLtMatmulPreferenceCreate", loaded.pref_create) &&
                     resolve(lib, "cublasLtMatmulPreferenceSetAttribute", loaded.pref_set) &&
                     resolve(lib, "cublasLtMatmulPreferenceDestroy", loaded.pref_destroy) &&
                     resolve(lib, "cublasLtMatmulAlgoGetHeuristic", loaded.heuristic) &&
                     resolve(lib, "cublasLtMatmulAlgoConfigGetAttribute", loaded.algo_config_get) &&
                     resolve(lib, "cublasLtMatmul", loaded.matmul);
    return ok ? &loaded : nullptr;
  }();
  return api;
}

// One size's call: its descriptors (kept for the process, a few hundred bytes) and its pick.
struct LtCall {
  void* handle = nullptr;
  void* desc = nullptr;
  void* ab_layout = nullptr;  // a and b: Npad x Npad, ld Npad, `batch` planes apart by Npad^2
  void* c_layout = nullptr;
  LtPick pick;
  LtAlgo algo{};
  bool use_lt = false;  // false: the other way, every time
};

using LtKey = std::tuple<int, int64_t, int64_t, bool, GemmForm>;  // device, batch, Npad, fp16, form
std::mutex lt_mutex;
std::map<LtKey, LtCall> lt_calls;  // guarded by lt_mutex

void* lt_handle(const LtApi& api, int device) {
  static std::map<int, void*> handles;  // guarded by lt_mutex
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  void* h = nullptr;
  if (api.create(&h) != kLtSuccess) h = nullptr;
  handles[device] = h;
  return h;
}

// The descriptors of a size that takes the other way (the handle stays the device's).
void release(const LtApi& api, LtCall& call) {
  if (call.desc != nullptr) api.desc_destroy(call.desc);
  for (void* layout : {call.ab_layout, call.c_layout})
    if (layout != nullptr) api.layout_destroy(layout);
  call.desc = call.ab_layout = call.c_layout = nullptr;
  call.use_lt = false;
}

LtStatus run(const LtApi& api, const LtCall& call, const LtAlgo& algo, const LtContraction& g, void* c) {
  const float one = 1.0f, zero = 0.0f;
  // column-major, as cuBLASLt sees row-major planes: A = b, B = a, with the form's transposes
  // (describe)
  return api.matmul(call.handle, call.desc, &one, g.b, call.ab_layout, g.a, call.ab_layout, &zero, c,
                    call.c_layout, c, call.c_layout, &algo, nullptr, 0, g.stream);
}

// CUDA events, destroyed with their owner (also where the other way throws during a pick).
struct Events {
  std::vector<cudaEvent_t> marks;
  explicit Events(size_t n) : marks(n, nullptr) {}
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    for (cudaEvent_t e : marks)
      if (e != nullptr) cudaEventDestroy(e);
  }
  bool create() {
    for (cudaEvent_t& e : marks)
      if (cudaEventCreate(&e) != cudaSuccess) return false;
    return true;
  }
};

// The descriptors and cuBLASLt's candidates of one size (at most kLtCandidates, none needing a
// workspace or splitting k: each adds its k in order, as bmm's kernels do, so that they may give
// bmm's bits; the pick checks that they do).
std::vector<LtAlgo> describe(const LtApi& api, LtCall& call, const LtContraction& g) {
  std::vector<LtAlgo> out;
  call.handle = lt_handle(api, g.device);
  if (call.handle == nullptr) return out;
  const int type = g.fp16 ? kTypeF16 : kTypeBF16;
  const int32_t batch = static_cast<int32_t>(g.batch);
  const int64_t stride = g.Npad * g.Npad;
  const uint64_t n = static_cast<uint64_t>(g.Npad);
  // A = b, B = a, each seen transposed (row-major planes): c = a b^T is c^T = b a^T (A transposed),
  // c = a b is c^T = b^T a^T, c = a^T b is c^T = b^T a (B transposed)
  const int op_a = g.form == GemmForm::ab_t ? kOpT : kOpN, op_b = g.form == GemmForm::at_b ? kOpT : kOpN;
  bool ok = api.desc_create(&call.desc, kCompute32F, kTypeF32) == kLtSuccess &&
            api.desc_set(call.desc, kDescTransA, &op_a, sizeof(op_a)) == kLtSuccess &&
            api.desc_set(call.desc, kDescTransB, &op_b, sizeof(op_b)) == kLtSuccess;
  for (void** layout : {&call.ab_layout, &call.c_layout})
    ok = ok && api.layout_create(layout, type, n, n, g.Npad) == kLtSuccess &&
         api.layout_set(*layout, kLayoutBatchCount, &batch, sizeof(batch)) == kLtSuccess &&
         api.layout_set(*layout, kLayoutBatchStride, &stride, sizeof(stride)) == kLtSuccess;
  void* pref = nullptr;
  const uint64_t no_workspace = 0;
  ok = ok && api.pref_create(&pref) == kLtSuccess &&
       api.pref_set(pref, kPrefMaxWorkspace, &no_workspace, sizeof(no_workspace)) == kLtSuccess;
  std::array<LtHeuristic, kLtCandidates> found{};
  int returned = 0;
  ok = ok && api.heuristic(call.handle, call.desc, call.ab_layout, call.ab_layout, call.c_layout, call.c_layout,
                           pref, kLtCandidates, found.data(), &returned) == kLtSuccess;
  if (pref != nullptr) api.pref_destroy(pref);
  for (int i = 0; ok && i < returned; ++i) {
    int32_t splits = 0;
    size_t written = 0;
    if (found[i].state != kLtSuccess || found[i].workspace_size != 0 ||
        api.algo_config_get(&found[i].algo, kAlgoSplitK, &splits, sizeof(splits), &written) != kLtSuccess ||
        splits > 1)
      continue;
    out.push_back(found[i].algo);
  }
  return out;
}

// Times the other way (way n) and the candidates (ways 0 to n - 1) on the call's operands, the
// candidates writing c, and sets call.pick, call.use_lt and call.algo (left as they are where a CUDA
// event call failed): of the candidates that beat the other way by kLtPickMargin (those tied with
// the fastest in cuBLASLt's order, then the others fastest first), the first whose result has the
// other way's bits.
void pick(const LtApi& api, LtCall& call, const std::vector<LtAlgo>& candidates, const LtContraction& g, void* c,
          const LtWays& ways) {
  const int n = static_cast<int>(candidates.size());
  auto launch = [&](int way) {
    if (way < n) return run(api, call, candidates[way], g, c) == kLtSuccess;
    ways.other();
    return true;
  };
  Events events(2 * (n + 1));
  const std::vector<cudaEvent_t>& marks = events.marks;
  bool ok = events.create();
  std::vector<float> best(n + 1, -1.0f);  // -1: failed
  int calls = 1;
  // round -1: the warm-up, two calls each, the second timed (the other way's sets `calls`)
  for (int round = -1; ok && round < kLtTimedRounds; ++round) {
    for (int way = n; ok && way >= 0; --way) {
      if (round >= 0 && best[way] < 0) continue;
      bool ran = round >= 0 || launch(way);  // (the warm-up's timed call is its second)
      ok = cudaEventRecord(marks[2 * way], g.stream) == cudaSuccess;
      for (int i = 0; ok && ran && i < calls; ++i) ran = launch(way);
      ok = ok && cudaEventRecord(marks[2 * way + 1], g.stream) == cudaSuccess;
      if (!ran) best[way] = -1.0f;
      else if (round < 0) best[way] = 1e30f;
    }
    ok = ok && cudaStreamSynchronize(g.stream) == cudaSuccess;
    if (ok && round < 0) {  // (of the warm-up only the other way's time is read)
      float warm = 0;
      ok = cudaEventElapsedTime(&warm, marks[2 * n], marks[2 * n + 1]) == cudaSuccess;
      calls = std::clamp(static_cast<int>(kLtTimedSpanMs / std::max(warm, 1e-3f)), 1, kLtMaxCalls);
      continue;
    }
    for (int way = 0; ok && way <= n; ++way) {
      float ms = 0;
      if (best[way] < 0) continue;
      ok = cudaEventElapsedTime(&ms, marks[2 * way], marks[2 * way + 1]) == cudaSuccess;
      best[way] = std::min(best[way], ms / calls);
    }
  }
  if (!ok) return;
  // the candidates that beat the other way: those as fast as the fastest in cuBLASLt's order, then
  // the others fastest first
  std::vector<int> faster;
  float fastest = best[n];
  for (int way = 0; way < n; ++way)
    if (best[way] >= 0 && best[way] <= kLtPickMargin * best[n]) {
      faster.push_back(way);
      fastest = std::min(fastest, best[way]);
    }
  auto tied = [&](int way) { return kLtPickMargin * best[way] <= fastest; };
  std::sort(faster.begin(), faster.end(), [&](int u, int v) {
    if (tied(u) != tied(v)) return tied(u);
    return tied(u) ? u < v : best[u] < best[v];
  });
  int chosen = -1, differed = 0;
  for (int way : faster) {
    ways.other();
    if (launch(way) && ways.same()) {
      chosen = way;
      break;
    }
    ++differed;
  }
  call.use_lt = chosen >= 0;
  if (call.use_lt) call.algo = candidates[chosen];
  call.pick = LtPick{true, chosen, n, differed};
}

}  // namespace

bool lt_contraction(const LtContraction& g, const LtWays& ways) {
  const LtApi* api = lt_api();
  if (api == nullptr || g.batch > INT32_MAX) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(g.stream, &capture) != cudaSuccess) return false;
  std::lock_guard<std::mutex> lock(lt_mutex);
  const LtKey key{g.device, g.batch, g.Npad, g.fp16, g.form};
  auto it = lt_calls.find(key);
  if (it == lt_calls.end()) {
    if (capture != cudaStreamCaptureStatusNone) return false;  // picked at the first call outside capture
    LtCall call;
    try {
      const std::vector<LtAlgo> candidates = describe(*api, call, g);
      if (!candidates.empty()) pick(*api, call, candidates, g, ways.output(), ways);
    } catch (...) {  // (the other way failed: nothing is kept, the next call picks again)
      release(*api, call);
      throw;
    }
    if (!call.use_lt) release(*api, call);
    call.pick.picked = true;  // (declined for good where the pick could not be made)
    lt_calls.emplace(key, call);
    return call.use_lt;  // (the kept candidate's check left its result in ways.output())
  }
  return it->second.use_lt && run(*api, it->second, it->second.algo, g, ways.output()) == kLtSuccess;
}

bool lt_available() { return lt_api() != nullptr; }

LtPick lt_pick(int device, int64_t batch, int64_t Npad, bool fp16, GemmForm form) {
  std::lock_guard<std::mutex> lock(lt_mutex);
  auto it = lt_calls.find(LtKey{device, batch, Npad, fp16, form});
  return it != lt_calls.end() ? it->second.pick : LtPick{};
}

}  // namespace trimul
