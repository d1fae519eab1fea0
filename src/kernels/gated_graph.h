// gated_graph: a captured CUDA graph launched behind a gate the device sets, so that a step the
// device already knows to be empty costs one small kernel instead of the whole graph. The
// speculative decoder reads verdicts one step late: when a batch-1 sequence ends in step k, the
// host has launched step k + 1 before it knows, a whole wasted step per request (~4% of a GSM8K
// request at batch 1). With the step's verdicts deactivating the slots they finish
// (kernels::greedy_verdicts' room and stops), the next step's gate finds none active and skips.
// Built as a parent graph of two nodes: a one-thread kernel that sets a conditional handle from
// the gate, and a CUDA conditional IF node whose body holds the captured graph as a child graph
// (CUDA 12.4+; a driver that refuses makes the constructor throw, and callers replay the graph
// itself).
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>

namespace at::cuda {
struct CUDAGraph;
}  // namespace at::cuda

namespace dflash::kernels {

class GatedGraph {
 public:
  // body: captured with keep_graph (its cudaGraph_t is cloned here; body may then be
  // destroyed). gate: int64 [n] on the device: the body runs when any entry is nonzero; else
  // the gate kernel writes -1 to every entry of `skipped` (int64, contiguous) so that a reader
  // of the body's outputs can tell the step did not run.
  GatedGraph(at::cuda::CUDAGraph& body, const at::Tensor& gate, const at::Tensor& skipped);
  ~GatedGraph();
  GatedGraph(const GatedGraph&) = delete;
  GatedGraph& operator=(const GatedGraph&) = delete;

  // On the current stream of the gate's device.
  void launch() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::kernels
