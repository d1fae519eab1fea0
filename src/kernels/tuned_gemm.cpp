#include "kernels/tuned_gemm.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <compare>
#include <map>
#include <mutex>
#include <type_traits>

#include "common/error.h"
#include "kernels/autograd_records.h"

namespace dflash::kernels {
namespace {

// cuBLASLt through dlsym, as cuDNN: LibTorch's CUDA library has it loaded already, and linking
// the toolkit's copy could put a second, different build of it beside LibTorch's.
struct LtApi {
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulAlgoConfigGetAttribute) config_get = nullptr;
  bool ok = false;
};

const LtApi& lt_api() {
  static const LtApi api = [] {
    LtApi a;
    void* lib = nullptr;
    for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
      lib = ::dlopen(name, RTLD_NOW | RTLD_NOLOAD);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) return a;
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      return fn != nullptr;
    };
    a.ok = load(a.desc_create, "cublasLtMatmulDescCreate") &&
           load(a.desc_set, "cublasLtMatmulDescSetAttribute") &&
           load(a.desc_destroy, "cublasLtMatmulDescDestroy") &&
           load(a.layout_create, "cublasLtMatrixLayoutCreate") &&
           load(a.layout_destroy, "cublasLtMatrixLayoutDestroy") &&
           load(a.pref_create, "cublasLtMatmulPreferenceCreate") &&
           load(a.pref_destroy, "cublasLtMatmulPreferenceDestroy") &&
           load(a.pref_set, "cublasLtMatmulPreferenceSetAttribute") &&
           load(a.heuristic, "cublasLtMatmulAlgoGetHeuristic") &&
           load(a.matmul, "cublasLtMatmul") &&
           load(a.config_get, "cublasLtMatmulAlgoConfigGetAttribute");
    return a;
  }();
  return api;
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    fail("tuned_gemm: {} failed (cuBLAS status {})", what, static_cast<int>(status));
  }
}

// Tuning costs a few hundred milliseconds and a device synchronisation per shape, so it is
// for the few large fixed shapes of training's prefill; rarer shapes (prompts of every length
// in evaluation) stay on at::linear, which computes the same bits.
constexpr int64_t kMinTunedRows = 512;
constexpr int kCandidates = 16;
constexpr int kRounds = 3;
constexpr int kRunsPerRound = 5;
// Between timed runs a buffer larger than the H200's 50 MB L2 is written, so every candidate
// reads its weights from memory as in the prefill, where each layer's are new (timed back to
// back, a 32 MB weight stays in L2 and the ranking favours what will not happen).
constexpr int64_t kL2FlushBytes = 128 << 20;

uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

struct Key {
  int device;
  int64_t m, n, k, ldx;
  at::ScalarType dtype;
  uint32_t align_x, align_w;
  auto operator<=>(const Key&) const = default;
};

// One shape's descriptors (read-only once built, so shared by every thread) and choice.
struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t w = nullptr, x = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  GemmTuning tuning;
};

std::mutex plans_mutex;
// Never destroyed: descriptors outlive nothing that could free them at exit.
auto& plans = *new std::map<Key, Plan>();

// Row-major out[M, N] = x[M, K] @ w[N, K]^T is column-major out^T = w^T(op T) @ x^T.
void build(Plan& p, const Key& key) {
  const LtApi& api = lt_api();
  const cudaDataType_t type = key.dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  check(api.desc_create(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t transpose = CUBLAS_OP_T, keep = CUBLAS_OP_N;
  check(api.desc_set(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)),
        "set TRANSA");
  check(api.desc_set(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &keep, sizeof(keep)), "set TRANSB");
  check(api.layout_create(&p.w, type, key.k, key.n, key.k), "cublasLtMatrixLayoutCreate");
  check(api.layout_create(&p.x, type, key.k, key.m, key.ldx), "cublasLtMatrixLayoutCreate");
  check(api.layout_create(&p.out, type, key.n, key.m, key.n), "cublasLtMatrixLayoutCreate");
}

// out: fresh from the caching allocator (its alignment is the allocator's, >= 256 bytes).
cublasStatus_t run(const Plan& p, const cublasLtMatmulAlgo_t& algo, const at::Tensor& x,
                   const at::Tensor& w, at::Tensor& out) {
  const float alpha = 1.0f, beta = 0.0f;
  return lt_api().matmul(at::cuda::getCurrentCUDABlasLtHandle(), p.op, &alpha, w.data_ptr(), p.w,
                         x.data_ptr(), p.x, &beta, out.data_ptr(), p.out, out.data_ptr(), p.out,
                         &algo, at::cuda::getCUDABlasLtWorkspace(),
                         at::cuda::getCUDABlasLtWorkspaceSize(), at::cuda::getCurrentCUDAStream());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// "algo 66 tile 24 stages 35 cluster 3": what a configuration is, for logs.
std::string describe(const cublasLtMatmulAlgo_t& algo) {
  const LtApi& api = lt_api();
  int32_t id = 0;
  uint32_t tile = 0, stages = 0;
  uint16_t cluster = 0;
  size_t written = 0;
  api.config_get(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &written);
  api.config_get(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
  api.config_get(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &written);
  api.config_get(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &written);
  return fmt::format("algo {} tile {} stages {} cluster {}", id, tile, stages, cluster);
}

// Offers the heuristic's candidates, keeps those reproducing at::linear's output, and times
// them against at::linear in interleaved rounds (so a clock change hits every one alike).
void tune(Plan& p, const Key& key, const at::Tensor& x, const at::Tensor& w) {
  const auto started = std::chrono::steady_clock::now();
  const LtApi& api = lt_api();
  cublasLtMatmulPreference_t pref = nullptr;
  check(api.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  const uint64_t workspace = at::cuda::getCUDABlasLtWorkspaceSize();
  const uint32_t align_out = 256;
  api.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &key.align_w, sizeof(uint32_t));
  api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &key.align_x, sizeof(uint32_t));
  api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_out, sizeof(uint32_t));
  api.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_out, sizeof(uint32_t));
  std::vector<cublasLtMatmulHeuristicResult_t> offered(kCandidates);
  int returned = 0;
  const cublasStatus_t status =
      api.heuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.op, p.w, p.x, p.out, p.out, pref,
                    kCandidates, offered.data(), &returned);
  api.pref_destroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS) returned = 0;

  const at::Tensor reference = at::linear(x, w);
  at::Tensor out = at::empty_like(reference);
  struct Candidate {
    cublasLtMatmulAlgo_t algo;
    bool equal;
    std::vector<double> us;
  };
  std::vector<Candidate> candidates;
  for (int i = 0; i < returned; ++i) {
    if (offered[i].state != CUBLAS_STATUS_SUCCESS) continue;
    out.zero_();
    if (run(p, offered[i].algo, x, w, out) != CUBLAS_STATUS_SUCCESS) continue;
    candidates.push_back({offered[i].algo, at::equal(out, reference), {}});
  }

  at::Tensor flush = at::empty({kL2FlushBytes}, x.options().dtype(at::kByte));
  auto time_us = [&](auto&& fn) {
    fn();
    std::vector<at::cuda::CUDAEvent> starts, stops;
    for (int r = 0; r < kRunsPerRound; ++r) {
      starts.emplace_back(cudaEventDefault);
      stops.emplace_back(cudaEventDefault);
    }
    for (int r = 0; r < kRunsPerRound; ++r) {
      flush.zero_();
      starts[r].record();
      fn();
      stops[r].record();
    }
    stops.back().synchronize();
    double total = 0;
    for (int r = 0; r < kRunsPerRound; ++r) total += starts[r].elapsed_time(stops[r]);
    return total * 1e3 / kRunsPerRound;
  };
  std::vector<double> aten_us;
  for (int round = 0; round < kRounds; ++round) {
    aten_us.push_back(time_us([&] { at::mm_out(out, x, w.t()); }));
    for (auto& c : candidates) {
      c.us.push_back(time_us([&] { check(run(p, c.algo, x, w, out), "cublasLtMatmul"); }));
    }
  }

  GemmTuning& t = p.tuning;
  t.shape = fmt::format("{}x{}x{} {}", key.m, key.n, key.k, c10::toString(key.dtype));
  t.candidates = static_cast<int>(candidates.size());
  t.aten_us = median(aten_us);
  for (const auto& c : candidates) {
    const double us = median(c.us);
    if (t.best_any_us == 0 || us < t.best_any_us) t.best_any_us = us;
    if (!c.equal) continue;
    ++t.equal;
    if (t.best_equal_us == 0 || us < t.best_equal_us) {
      t.best_equal_us = us;
      t.chosen_config = describe(c.algo);
      p.algo = c.algo;
    }
  }
  t.uses_lt = t.equal > 0 && t.best_equal_us < t.aten_us;
  t.tuning_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
}

Key key_of(const at::Tensor& x, const at::Tensor& weight) {
  return {x.get_device(), x.size(0),       weight.size(0),          x.size(1),
          x.stride(0),    x.scalar_type(), alignment(x.data_ptr()), alignment(weight.data_ptr())};
}

// Any rows: the shape checks of linear_tuned without its floor.
bool tunable(const at::Tensor& x, const at::Tensor& weight) {
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  return x.is_cuda() && half && x.dim() == 2 && weight.dim() == 2 &&
         x.scalar_type() == weight.scalar_type() && x.size(1) == weight.size(1) &&
         x.stride(1) == 1 && x.stride(0) >= x.size(1) && weight.is_contiguous() &&
         weight.device() == x.device() && !autograd_records({x, weight}) && lt_api().ok;
}

}  // namespace

GemmTuning time_gemm_candidates(const at::Tensor& x, const at::Tensor& weight) {
  if (!tunable(x, weight)) {
    fail("tuned_gemm: cannot time cuBLASLt on x {} {} and weight {} {}", x.sizes(),
         c10::toString(x.scalar_type()), weight.sizes(), c10::toString(weight.scalar_type()));
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const Key key = key_of(x, weight);
  Plan p;
  build(p, key);
  tune(p, key, x, weight);
  const LtApi& api = lt_api();
  api.layout_destroy(p.out);
  api.layout_destroy(p.x);
  api.layout_destroy(p.w);
  api.desc_destroy(p.op);
  return p.tuning;
}

at::Tensor linear_tuned(const at::Tensor& x, const at::Tensor& weight) {
  if (!tunable(x, weight) || x.size(0) < kMinTunedRows) return at::linear(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  const Key key = key_of(x, weight);
  const Plan* plan = nullptr;
  {
    std::lock_guard lock(plans_mutex);
    auto it = plans.find(key);
    if (it == plans.end()) {
      // Tuning synchronises: never inside a CUDA graph's capture.
      if (plans.size() >= static_cast<size_t>(kMaxTunedShapes) ||
          c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
        return at::linear(x, weight);
      }
      it = plans.emplace(key, Plan{}).first;
      build(it->second, key);
      tune(it->second, key, x, weight);
      // The tuning's buffers (the L2 flush, a reference output) would otherwise stay reserved
      // in the caching allocator for the whole run: 0.4-0.5 GiB more held on the H200.
      c10::cuda::CUDACachingAllocator::emptyCache();
    }
    plan = &it->second;
  }
  if (!plan->tuning.uses_lt) return at::linear(x, weight);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  check(run(*plan, plan->algo, x, weight, out), "cublasLtMatmul");
  return out;
}

std::vector<GemmTuning> gemm_tunings() {
  std::lock_guard lock(plans_mutex);
  std::vector<GemmTuning> out;
  for (const auto& [key, plan] : plans) out.push_back(plan.tuning);
  return out;
}

std::string describe(const GemmTuning& t) {
  return fmt::format(
      "{}: at::linear {:.1f} us, {} of {} cuBLASLt candidates equal to it, fastest of those "
      "{:.1f} us ({}), fastest of all {:.1f} us -> {}; tuned in {:.0f} ms",
      t.shape, t.aten_us, t.equal, t.candidates, t.best_equal_us, t.chosen_config, t.best_any_us,
      t.uses_lt ? "cuBLASLt" : "at::linear", t.tuning_ms);
}

}  // namespace dflash::kernels
