#include "models/prefill_graph.h"

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <exception>

#include "common/error.h"

namespace dflash::models {
namespace {

// Shapes run eagerly are counted until this many are known, then forgotten: data of many
// lengths would otherwise grow the map without bound, and such data has no shape to capture.
constexpr size_t kMaxSeenShapes = 4096;

// A sparse layer routes tokens with host-visible counts, which a graph cannot capture.
bool capturable(const TargetModel& target) {
  if (!target.device().is_cuda()) return false;
  for (const auto& layer : target.layers()) {
    if (layer.router.defined()) return false;
  }
  return true;
}

}  // namespace

struct PrefillGraphs::Graph {
  at::cuda::CUDAGraph graph;
  at::Tensor tokens;  // static input: each call's tokens are copied here before a replay
  PackedBatch batch;  // the shape's positions and offsets, owned by the graph
  ForwardResult out;  // written by every replay
};

PrefillGraphs::PrefillGraphs(const TargetModel& target, ForwardRequest request, int max_graphs)
    : target_(target), request_(std::move(request)), max_graphs_(max_graphs) {
  if (request_.grad) fail("PrefillGraphs: a prefill recording autograd history has no graph");
  if (!capturable(target_)) max_graphs_ = 0;
}

PrefillGraphs::~PrefillGraphs() = default;

PrefillGraphs::Graph* PrefillGraphs::capture(const at::Tensor& tokens, const PackedBatch& batch) {
  const at::Device device = target_.device();
  c10::cuda::CUDAGuard device_guard(device);
  auto g = std::make_unique<Graph>();
  g->tokens = tokens.to(device, /*non_blocking=*/false, /*copy=*/true);
  g->batch = PackedBatch::from_lengths(batch.lengths, device);
  if (!pool_id_) pool_id_ = at::cuda::graph_pool_handle();
  // Captured on a stream of its own (a capture cannot run on the legacy default stream), after
  // the work queued so far, with a warm-up there first: cuBLAS and cuDNN set up per-stream
  // state on first use, which must not happen inside the capture. Thread-local capture mode,
  // so that other threads' CUDA calls (pinned-memory copies of the next batches) stay legal.
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  at::cuda::CUDAEvent queued;
  queued.record(current);
  queued.block(side);
  try {
    c10::cuda::CUDAStreamGuard on_side(side);
    target_.forward(g->tokens, g->batch, request_);
    g->graph.capture_begin(*pool_id_, cudaStreamCaptureModeThreadLocal);
    try {
      g->out = target_.forward(g->tokens, g->batch, request_);
    } catch (...) {
      try {
        g->graph.capture_end();
      } catch (...) {
      }
      throw;
    }
    g->graph.capture_end();
  } catch (const std::exception& e) {
    (void)cudaGetLastError();
    fmt::print(stderr,
               "warning: the target prefill could not be captured as a CUDA graph ({}); "
               "it runs eagerly from now on\n",
               e.what());
    max_graphs_ = 0;
    return nullptr;
  }
  at::cuda::CUDAEvent captured;
  captured.record(side);
  captured.block(current);
  auto* raw = g.get();
  graphs_.emplace(batch.lengths, std::move(g));
  seen_.erase(batch.lengths);
  return raw;
}

ForwardResult PrefillGraphs::forward(const at::Tensor& tokens, const PackedBatch& batch) {
  Graph* graph = nullptr;
  if (auto it = graphs_.find(batch.lengths); it != graphs_.end()) {
    graph = it->second.get();
  } else if (static_cast<int>(graphs_.size()) < max_graphs_) {
    if (seen_.size() >= kMaxSeenShapes) seen_.clear();
    if (++seen_[batch.lengths] >= 2) graph = capture(tokens, batch);
  }
  if (graph == nullptr) return target_.forward(tokens, batch, request_);
  if (tokens.sizes() != graph->tokens.sizes()) {
    fail("PrefillGraphs: tokens must be [{}] (the packed batch), got [{}]", batch.total,
         fmt::join(tokens.sizes(), ", "));
  }
  graph->tokens.copy_(tokens, /*non_blocking=*/true);
  graph->graph.replay();
  ++replays_;
  return graph->out;
}

}  // namespace dflash::models
