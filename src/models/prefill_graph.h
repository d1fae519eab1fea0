// models: the frozen target's no-grad prefill replayed from CUDA graphs for batch shapes that
// repeat (a fixed sequence length, packed micro-batches of one shape). A 2048-token Qwen3-8B
// prefill is ~450 kernels; as a graph they leave the launch queue in one call and run with
// shorter gaps between them. Shapes that do not repeat run eagerly, exactly as
// TargetModel::forward.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "models/target.h"

namespace dflash::models {

class PrefillGraphs {
 public:
  // `request` is fixed for the object's life (taps, logits, attention; grad must be false).
  // At most `max_graphs` shapes are captured (each keeps its static inputs and its outputs;
  // their intermediates share one memory pool).
  PrefillGraphs(const TargetModel& target, ForwardRequest request, int max_graphs = 4);
  ~PrefillGraphs();
  PrefillGraphs(const PrefillGraphs&) = delete;
  PrefillGraphs& operator=(const PrefillGraphs&) = delete;

  // target.forward(tokens, batch, request). A shape (batch.lengths) is captured the second
  // time it is seen, on CUDA, and replayed from then on. A replay's tensors are the graphs'
  // memory: they hold until the next call (any shape's replay may write there), so a caller
  // keeping them longer copies them (target_features' concatenation does).
  ForwardResult forward(const at::Tensor& tokens, const PackedBatch& batch);

  int64_t captured() const { return static_cast<int64_t>(graphs_.size()); }
  int64_t replays() const { return replays_; }

 private:
  struct Graph;
  Graph* capture(const at::Tensor& tokens, const PackedBatch& batch);

  const TargetModel& target_;
  ForwardRequest request_;
  int max_graphs_;
  std::map<std::vector<int64_t>, int> seen_;  // shapes run eagerly, and how often
  std::map<std::vector<int64_t>, std::unique_ptr<Graph>> graphs_;
  // The memory pool the graphs share: their replays never overlap, as they run on one stream,
  // so one graph's intermediates may reuse another's.
  std::optional<c10::MempoolId_t> pool_id_;
  int64_t replays_ = 0;
};

}  // namespace dflash::models
