#include "kernels/cudnn_attention.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <compare>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

// cuDNN calls through dlsym (no link-time libcudnn: LibTorch loads it), and none of the
// frontend's JSON serialisation.
#define NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING
#define CUDNN_FRONTEND_SKIP_JSON_LIB
#include <cudnn_frontend.h>

#include "common/error.h"

// The frontend's dynamic loading resolves every cuDNN call through this handle (its shim
// declares it; the program defines it).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}

namespace dflash::kernels {
namespace {

namespace fe = cudnn_frontend;
using GraphTensor = std::shared_ptr<fe::graph::Tensor_attributes>;

// LibTorch's CUDA library already has libcudnn loaded; dlopen by soname returns that copy.
bool open_cudnn() {
  static const bool opened = [] {
    for (const char* name : {"libcudnn.so.9", "libcudnn.so"}) {
      fe::cudnn_dlhandle = ::dlopen(name, RTLD_NOW | RTLD_GLOBAL);
      if (fe::cudnn_dlhandle != nullptr) break;
    }
    if (fe::cudnn_dlhandle == nullptr) return false;
    using GetVersion = size_t (*)();
    auto version = reinterpret_cast<GetVersion>(::dlsym(fe::cudnn_dlhandle, "cudnnGetVersion"));
    return version != nullptr && version() >= 90000;
  }();
  return opened;
}

// The variant pack's tensor ids.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kDO,
  kStats,
  kScale,
  kSeqLenQ,
  kSeqLenKv,
  kRaggedQ,
  kRaggedKv,
  kRaggedStats,
  kDQ,
  kDK,
  kDV,
};

struct GraphKey {
  bool forward;  // the forward (output and log-sum-exp) or the backward
  int device;
  fe::DataType_t dtype;
  int64_t batches, heads, kv_heads, head_dim, nominal_q, nominal_kv;
  auto operator<=>(const GraphKey&) const = default;
};

void check(fe::error_t status, const char* what, const GraphKey& key) {
  if (status.is_good()) return;
  fail("cudnn attention {}: {} failed for {} sequences, {} / {} heads of {}: {}",
       key.forward ? "forward" : "backward", what, key.batches, key.heads, key.kv_heads,
       key.head_dim, status.get_message());
}

// A graph with `dtype` inputs and outputs and fp32 intermediates and compute.
std::shared_ptr<fe::graph::Graph> new_graph(fe::DataType_t dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

// The softmax scale, an fp32 scalar passed by value.
GraphTensor attention_scale(fe::graph::Graph& graph) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_uid(kScale)
                          .set_name("scale")
                          .set_dim({1, 1, 1, 1})
                          .set_stride({1, 1, 1, 1})
                          .set_is_pass_by_value(true)
                          .set_data_type(fe::DataType_t::FLOAT));
}

std::shared_ptr<fe::graph::Graph> build_graph(const GraphKey& key, cudnnHandle_t handle) {
  const int64_t b = key.batches, h = key.heads, hk = key.kv_heads, d = key.head_dim;
  const int64_t sq = key.nominal_q, skv = key.nominal_kv;
  auto graph = new_graph(key.dtype);
  auto scalar_per_batch = [&](Uid uid, const char* name, int64_t n) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_uid(uid)
                             .set_name(name)
                             .set_dim({n, 1, 1, 1})
                             .set_stride({1, 1, 1, 1})
                             .set_data_type(fe::DataType_t::INT32));
  };
  auto ragged_q = scalar_per_batch(kRaggedQ, "ragged_q", b + 1);
  auto ragged_kv = scalar_per_batch(kRaggedKv, "ragged_kv", b + 1);
  auto ragged_stats = scalar_per_batch(kRaggedStats, "ragged_stats", b + 1);
  // Packed rows ([rows, heads, D]) seen as [b, heads, nominal length, D]: a sequence's rows
  // start at its ragged offset (in elements), its length comes from the padding mask.
  auto packed = [&](Uid uid, const char* name, int64_t heads, int64_t s,
                    const GraphTensor& ragged) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_uid(uid)
                             .set_name(name)
                             .set_dim({b, heads, s, d})
                             .set_stride({s * heads * d, d, heads * d, 1})
                             .set_ragged_offset(ragged));
  };
  auto q = packed(kQ, "q", h, sq, ragged_q);
  auto k = packed(kK, "k", hk, skv, ragged_kv);
  auto v = packed(kV, "v", hk, skv, ragged_kv);
  auto scale = attention_scale(*graph);
  auto seq_len_q = scalar_per_batch(kSeqLenQ, "seq_len_q", b);
  auto seq_len_kv = scalar_per_batch(kSeqLenKv, "seq_len_kv", b);
  // The log-sum-exp, row-major [rows, heads] (flash's [heads, rows] transposed).
  auto stats_layout = [&](GraphTensor& t) -> fe::graph::Tensor_attributes& {
    return t->set_uid(kStats)
        .set_dim({b, h, sq, 1})
        .set_stride({sq * h, 1, h, 1})
        .set_data_type(fe::DataType_t::FLOAT)
        .set_ragged_offset(ragged_stats);
  };
  auto output = [&](GraphTensor& t, Uid uid, int64_t heads, int64_t s, const GraphTensor& ragged) {
    t->set_output(true)
        .set_uid(uid)
        .set_dim({b, heads, s, d})
        .set_stride({s * heads * d, d, heads * d, 1})
        .set_ragged_offset(ragged);
  };
  if (key.forward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("dflash_varlen_forward")
                       .set_generate_stats(true)
                       .set_attn_scale(scale)
                       .set_padding_mask(true)
                       .set_seq_len_q(seq_len_q)
                       .set_seq_len_kv(seq_len_kv);
    auto [o, stats] = graph->sdpa(q, k, v, options);
    output(o, kO, h, sq, ragged_q);
    stats_layout(stats).set_output(true);
  } else {
    auto o = packed(kO, "o", h, sq, ragged_q);
    auto dout = packed(kDO, "do", h, sq, ragged_q);
    auto stats = graph->tensor(fe::graph::Tensor_attributes().set_name("stats"));
    stats_layout(stats);
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("dflash_varlen_backward")
                       .set_attn_scale(scale)
                       .set_padding_mask(true)
                       .set_seq_len_q(seq_len_q)
                       .set_seq_len_kv(seq_len_kv);
    auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, o, dout, stats, options);
    output(dq, kDQ, h, sq, ragged_q);
    output(dk, kDK, hk, skv, ragged_kv);
    output(dv, kDV, hk, skv, ragged_kv);
  }
  check(graph->validate(), "validate", key);
  check(graph->build_operation_graph(handle), "build_operation_graph", key);
  check(graph->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", key);
  check(graph->check_support(handle), "check_support", key);
  check(graph->build_plans(handle), "build_plans", key);
  return graph;
}

// One handle per thread and device (cuDNN handles are not to be shared between threads), on
// the caller's current stream.
cudnnHandle_t handle_for(int device, cudaStream_t stream) {
  thread_local std::map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it == handles.end()) {
    cudnnHandle_t handle = nullptr;
    if (fe::detail::create_handle(&handle) != CUDNN_STATUS_SUCCESS) {
      fail("cudnn attention: cudnnCreate failed on cuda:{}", device);
    }
    it = handles.emplace(device, handle).first;
  }
  if (fe::detail::set_stream(it->second, stream) != CUDNN_STATUS_SUCCESS) {
    fail("cudnn attention: cudnnSetStream failed on cuda:{}", device);
  }
  return it->second;
}

int64_t nominal(int64_t length) {
  return static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(length, 64))));
}

// The checks every call shares: CUDA bf16/fp16, [rows, heads, D] q/k/v on one device with H a
// multiple of Hk, D a multiple of 8 and at most 256.
void check_qkv(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  if (!q.is_cuda() || (q.scalar_type() != at::kBFloat16 && q.scalar_type() != at::kHalf)) {
    fail("cudnn attention {}: needs CUDA bf16/fp16, got {} {}", who, q.device().str(),
         c10::toString(q.scalar_type()));
  }
  if (!cudnn_attention_available()) {
    fail("cudnn attention {}: libcudnn (9.0 or newer) could not be opened", who);
  }
  if (q.dim() != 3 || k.dim() != 3 || k.sizes() != v.sizes() || k.size(2) != q.size(2) ||
      q.size(1) % k.size(1) != 0 || q.size(2) % 8 != 0 || q.size(2) > 256 ||
      k.device() != q.device() || v.device() != q.device() || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type()) {
    fail(
        "cudnn attention {}: q {}, k {}, v {} do not fit [Tq, H, D] / [Tk, Hk, D] of one dtype "
        "on one device (D a multiple of 8, at most 256)",
        who, q.sizes(), k.sizes(), v.sizes());
  }
}

// The varlen calls' checks: those above, int32 [b + 1] query offsets on q's device, element
// counts within int32 offsets.
void check_inputs(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cu_q) {
  check_qkv(who, q, k, v);
  if (cu_q.numel() < 2 || cu_q.scalar_type() != at::kInt || cu_q.device() != q.device()) {
    fail("cudnn attention {}: cu_q {} must be int32 [b + 1] on q's device", who, cu_q.sizes());
  }
  // The ragged offsets are int32 element counts.
  if (q.numel() >= (int64_t{1} << 31) || k.numel() >= (int64_t{1} << 31)) {
    fail("cudnn attention {}: {} query or {} key elements overflow int32 offsets", who, q.numel(),
         k.numel());
  }
}

// The variant pack's device-side sizes: the ragged element offsets of q (and o, dq), k/v and
// the stats, and the per-sequence lengths.
struct RaggedSizes {
  at::Tensor q, kv, stats, seq_q, seq_kv;
};

RaggedSizes ragged_sizes(const at::Tensor& cu_q, const at::Tensor& k_start, const at::Tensor& k_len,
                         int64_t heads, int64_t kv_heads, int64_t d) {
  return {(cu_q * static_cast<int32_t>(heads * d)).to(at::kInt),
          (k_start * static_cast<int32_t>(kv_heads * d)).to(at::kInt),
          (cu_q * static_cast<int32_t>(heads)).to(at::kInt),
          at::diff(cu_q).to(at::kInt).contiguous(), k_len.to(at::kInt).contiguous()};
}

// Runs key's graph (built on the first call with that key, then cached) on the current stream.
void execute(const GraphKey& key, std::unordered_map<int64_t, void*>& pack, const RaggedSizes& r,
             float scale, const at::Tensor& like) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key.device).stream();
  cudnnHandle_t handle = handle_for(key.device, stream);
  thread_local std::map<GraphKey, std::shared_ptr<fe::graph::Graph>> graphs;
  auto& graph = graphs[key];
  if (!graph) graph = build_graph(key, handle);
  pack[kScale] = &scale;
  pack[kSeqLenQ] = r.seq_q.data_ptr();
  pack[kSeqLenKv] = r.seq_kv.data_ptr();
  pack[kRaggedQ] = r.q.data_ptr();
  pack[kRaggedKv] = r.kv.data_ptr();
  pack[kRaggedStats] = r.stats.data_ptr();
  const int64_t workspace_bytes = graph->get_workspace_size();
  auto workspace =
      at::empty({std::max<int64_t>(workspace_bytes, 1)}, like.options().dtype(at::kByte));
  check(graph->execute(handle, pack, workspace.data_ptr()), "execute", key);
}

GraphKey graph_key(bool forward, const at::Tensor& q, const at::Tensor& k, int64_t batches,
                   int64_t max_q, int64_t max_k) {
  return {forward,
          q.get_device(),
          q.scalar_type() == at::kBFloat16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF,
          batches,
          q.size(1),
          k.size(1),
          q.size(2),
          nominal(max_q),
          nominal(max_k)};
}

// The prefill's causal graph: dense equal-length sequences, q/k/v at their own strides.
struct CausalKey {
  int device;
  fe::DataType_t dtype;
  int64_t batches, length, heads, kv_heads, head_dim;
  std::array<int64_t, 6> strides;  // row and head strides of q, k, v
  auto operator<=>(const CausalKey&) const = default;
};

void check(fe::error_t status, const char* what, const CausalKey& key) {
  if (status.is_good()) return;
  fail("cudnn causal attention: {} failed for {} x {} rows, {} / {} heads of {}: {}", what,
       key.batches, key.length, key.heads, key.kv_heads, key.head_dim, status.get_message());
}

std::shared_ptr<fe::graph::Graph> build_causal_graph(const CausalKey& key) {
  const int64_t b = key.batches, l = key.length, h = key.heads, d = key.head_dim;
  auto graph = new_graph(key.dtype);
  // Rows [T, heads, D] at (row, head) strides seen as [b, heads, l, D].
  auto rows = [&](Uid uid, const char* name, int64_t heads, int64_t row, int64_t head) {
    return graph->tensor(fe::graph::Tensor_attributes()
                             .set_uid(uid)
                             .set_name(name)
                             .set_dim({b, heads, l, d})
                             .set_stride({l * row, head, row, 1}));
  };
  const auto& s = key.strides;
  auto q = rows(kQ, "q", h, s[0], s[1]);
  auto k = rows(kK, "k", key.kv_heads, s[2], s[3]);
  auto v = rows(kV, "v", key.kv_heads, s[4], s[5]);
  auto scale = attention_scale(*graph);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("dflash_causal_forward")
                     .set_generate_stats(false)
                     .set_attn_scale(scale)
                     .set_causal_mask(true);
  auto [o, stats] = graph->sdpa(q, k, v, options);
  o->set_output(true).set_uid(kO).set_dim({b, h, l, d}).set_stride({l * h * d, d, h * d, 1});
  check(graph->validate(), "validate", key);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key.device).stream();
  check(graph->build_operation_graph(handle_for(key.device, stream)), "build_operation_graph", key);
  check(graph->create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", key);
  check(graph->check_support(), "check_support", key);
  check(graph->build_plans(), "build_plans", key);
  return graph;
}

CausalKey causal_key(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     int64_t batches) {
  check_qkv("causal forward", q, k, v);
  if (batches < 1 || q.size(0) % batches != 0 || k.size(0) != q.size(0) || q.stride(2) != 1 ||
      k.stride(2) != 1 || v.stride(2) != 1) {
    fail("cudnn causal attention: q {} / k {} must hold {} sequences of one length, D contiguous",
         q.sizes(), k.sizes(), batches);
  }
  return {q.get_device(),
          q.scalar_type() == at::kBFloat16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF,
          batches,
          q.size(0) / batches,
          q.size(1),
          k.size(1),
          q.size(2),
          {q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)}};
}

fe::graph::Graph& causal_graph(const CausalKey& key) {
  // Samples of many lengths each build a graph; past this many the cache starts over rather
  // than growing for the whole run.
  constexpr size_t kMaxCausalGraphs = 256;
  thread_local std::map<CausalKey, std::shared_ptr<fe::graph::Graph>> graphs;
  if (graphs.size() >= kMaxCausalGraphs && !graphs.contains(key)) graphs.clear();
  auto& graph = graphs[key];
  if (!graph) graph = build_causal_graph(key);
  return *graph;
}

}  // namespace

at::Tensor cudnn_causal_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, int64_t batches, double scale) {
  const c10::cuda::CUDAGuard on_device(q.device());
  const auto key = causal_key(q, k, v, batches);
  auto& graph = causal_graph(key);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key.device).stream();
  cudnnHandle_t handle = handle_for(key.device, stream);
  int64_t workspace_bytes = 0;
  check(graph.get_workspace_size(workspace_bytes), "get_workspace_size", key);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto workspace = at::empty({std::max<int64_t>(workspace_bytes, 1)}, q.options().dtype(at::kByte));
  float scale_value = static_cast<float>(scale);
  std::unordered_map<int64_t, void*> pack = {{kQ, q.data_ptr()},
                                             {kK, k.data_ptr()},
                                             {kV, v.data_ptr()},
                                             {kO, out.data_ptr()},
                                             {kScale, &scale_value}};
  check(graph.execute(handle, pack, workspace.data_ptr()), "execute", key);
  return out;
}

bool cudnn_attention_available() { return at::hasCUDA() && open_cudnn(); }

bool cudnn_attention_supported(at::Device device) {
  if (!device.is_cuda() || !cudnn_attention_available()) return false;
  static std::mutex mutex;
  static std::map<int, bool> known;
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = known.find(index); it != known.end()) return it->second;
  std::string reason;
  const auto* props = at::cuda::getDeviceProperties(index);
  if (props->major < 9) {
    reason = fmt::format("compute capability {}.{}, ragged offsets need 9.0", props->major,
                         props->minor);
  } else {
    try {
      // Two query segments over overlapping key rows [0, 48) and [0, 80), GQA 2/1, D 128, then
      // the backward over the keys laid out apart; deterministic values (no RNG draw).
      const c10::cuda::CUDAGuard guard(index);
      const auto bf16 =
          at::TensorOptions().device(at::Device(at::kCUDA, index)).dtype(at::kBFloat16);
      auto ramp = [&](int64_t rows, int64_t heads) {
        return at::sin(at::arange(rows * heads * 128, bf16.dtype(at::kFloat)))
            .to(at::kBFloat16)
            .view({rows, heads, 128});
      };
      auto i32 = [&](std::vector<int32_t> v) { return at::tensor(v, at::kInt).to(bf16.device()); };
      const auto q = ramp(96, 2), k = ramp(80, 1), v = ramp(80, 1).neg();
      const double scale = 1.0 / std::sqrt(128.0);
      auto f = cudnn_varlen_attention_forward(q, k, v, i32({0, 64, 96}), i32({0, 0, 80}),
                                              i32({48, 80}), 64, 80, scale);
      auto kk = at::cat({k.narrow(0, 0, 48), k}), vv = at::cat({v.narrow(0, 0, 48), v});
      auto g = cudnn_varlen_attention_backward(f.out, q, kk, vv, f.out, f.lse, i32({0, 64, 96}),
                                               i32({0, 48, 128}), 64, 80, scale);
      const bool finite =
          at::isfinite(f.out).all().item<bool>() && at::isfinite(f.lse).all().item<bool>() &&
          at::isfinite(g.dq).all().item<bool>() && at::isfinite(g.dk).all().item<bool>();
      if (!finite) reason = "a probe returned non-finite values";
    } catch (const std::exception& e) {
      reason = e.what();
    }
  }
  if (!reason.empty()) {
    fmt::print(stderr,
               "cudnn attention: not used on cuda:{} ({}); `auto` attention takes flash's "
               "kernels there\n",
               index, reason);
  }
  return known[index] = reason.empty();
}

AttentionOutput cudnn_varlen_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& cu_q,
                                               const at::Tensor& k_start, const at::Tensor& k_len,
                                               int64_t max_q, int64_t max_k, double scale) {
  check_inputs("forward", q, k, v, cu_q);
  const int64_t b = cu_q.numel() - 1;
  if (k_start.numel() != b + 1 || k_len.numel() != b || k_start.scalar_type() != at::kInt ||
      k_len.scalar_type() != at::kInt || k_start.device() != q.device() ||
      k_len.device() != q.device()) {
    fail(
        "cudnn attention forward: k_start {} and k_len {} must be int32 [{}] and [{}] on q's "
        "device",
        k_start.sizes(), k_len.sizes(), b + 1, b);
  }
  const c10::cuda::CUDAGuard on_device(q.device());
  const auto key = graph_key(true, q, k, b, max_q, max_k);
  const auto q_c = q.contiguous(), k_c = k.contiguous(), v_c = v.contiguous();
  auto out = at::empty_like(q_c);
  auto stats = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));  // [Tq, H]
  std::unordered_map<int64_t, void*> pack = {{kQ, q_c.data_ptr()},
                                             {kK, k_c.data_ptr()},
                                             {kV, v_c.data_ptr()},
                                             {kO, out.data_ptr()},
                                             {kStats, stats.data_ptr()}};
  execute(key, pack, ragged_sizes(cu_q, k_start, k_len, q.size(1), k.size(1), q.size(2)),
          static_cast<float>(scale), q);
  return {out, stats.t().contiguous()};
}

AttentionGrads cudnn_varlen_attention_backward(const at::Tensor& dout, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& out, const at::Tensor& lse,
                                               const at::Tensor& cu_q, const at::Tensor& cu_k,
                                               int64_t max_q, int64_t max_k, double scale) {
  check_inputs("backward", q, k, v, cu_q);
  const int64_t h = q.size(1), b = cu_q.numel() - 1;
  if (out.sizes() != q.sizes() || dout.sizes() != q.sizes() || lse.dim() != 2 || lse.size(0) != h ||
      lse.size(1) != q.size(0) || lse.scalar_type() != at::kFloat || cu_k.numel() != b + 1 ||
      cu_k.scalar_type() != at::kInt || cu_k.device() != q.device()) {
    fail(
        "cudnn attention backward: q {}, out {}, dout {}, lse {} ({}), cu_k {} do not fit "
        "[Tq, H, D] / fp32 [H, Tq] / int32 [b + 1] on q's device",
        q.sizes(), out.sizes(), dout.sizes(), lse.sizes(), c10::toString(lse.scalar_type()),
        cu_k.sizes());
  }
  const c10::cuda::CUDAGuard on_device(q.device());
  const auto key = graph_key(false, q, k, b, max_q, max_k);
  auto rows = [](const at::Tensor& x) { return x.contiguous(); };
  const auto q_c = rows(q), k_c = rows(k), v_c = rows(v), o_c = rows(out), do_c = rows(dout);
  const auto stats = lse.t().contiguous();  // [Tq, H]
  AttentionGrads g{at::empty_like(q_c), at::empty_like(k_c), at::empty_like(v_c)};
  std::unordered_map<int64_t, void*> pack = {
      {kQ, q_c.data_ptr()},   {kK, k_c.data_ptr()},   {kV, v_c.data_ptr()},
      {kO, o_c.data_ptr()},   {kDO, do_c.data_ptr()}, {kStats, stats.data_ptr()},
      {kDQ, g.dq.data_ptr()}, {kDK, g.dk.data_ptr()}, {kDV, g.dv.data_ptr()},
  };
  execute(key, pack, ragged_sizes(cu_q, cu_k, at::diff(cu_k), h, k.size(1), q.size(2)),
          static_cast<float>(scale), q);
  return g;
}

}  // namespace dflash::kernels
