// The gate kernel is one warp: it ORs the gate's entries, sets the IF condition, and when none
// is set marks `skipped`. The graph plumbing is the CUDA runtime's graph API.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/error.h"
#include "kernels/gated_graph.h"

namespace dflash::kernels {
namespace {

__global__ void gate_kernel(cudaGraphConditionalHandle handle, const int64_t* __restrict__ gate,
                            int64_t n, int64_t* __restrict__ skipped, int64_t n_skipped) {
  bool any = false;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) any = any || gate[i] != 0;
  any = __any_sync(0xffffffffu, any);
  if (!any) {
    for (int64_t i = threadIdx.x; i < n_skipped; i += blockDim.x) skipped[i] = -1;
  }
  if (threadIdx.x == 0) cudaGraphSetConditional(handle, any ? 1u : 0u);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // clear it: the caller falls back and goes on
    fail("gated graph: {} failed: {}", what, cudaGetErrorString(e));
  }
}

}  // namespace

struct GatedGraph::Impl {
  cudaGraph_t parent = nullptr;
  cudaGraphExec_t exec = nullptr;
  at::Tensor gate, skipped;  // held: the kernel node points at them
  c10::DeviceIndex device = 0;
  ~Impl() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    if (parent != nullptr) cudaGraphDestroy(parent);
  }
};

GatedGraph::GatedGraph(at::cuda::CUDAGraph& body, const at::Tensor& gate, const at::Tensor& skipped)
    : impl_(std::make_unique<Impl>()) {
  if (!gate.is_cuda() || gate.scalar_type() != at::kLong || !gate.is_contiguous() ||
      !skipped.is_cuda() || skipped.scalar_type() != at::kLong || !skipped.is_contiguous()) {
    fail("gated graph: gate and skipped must be contiguous int64 CUDA tensors");
  }
  const c10::cuda::CUDAGuard guard(gate.device());
  Impl& g = *impl_;
  g.gate = gate;
  g.skipped = skipped;
  g.device = gate.device().index();
  check(cudaGraphCreate(&g.parent, 0), "cudaGraphCreate");
  cudaGraphConditionalHandle handle;
  check(cudaGraphConditionalHandleCreate(&handle, g.parent, 0, 0),
        "cudaGraphConditionalHandleCreate");
  const int64_t* gate_ptr = gate.data_ptr<int64_t>();
  int64_t n = gate.numel(), n_skipped = skipped.numel();
  int64_t* skipped_ptr = skipped.data_ptr<int64_t>();
  void* args[] = {&handle, &gate_ptr, &n, &skipped_ptr, &n_skipped};
  cudaKernelNodeParams kernel{};
  kernel.func = reinterpret_cast<void*>(gate_kernel);
  kernel.gridDim = dim3(1);
  kernel.blockDim = dim3(32);
  kernel.kernelParams = args;
  cudaGraphNode_t gate_node, if_node, child;
  check(cudaGraphAddKernelNode(&gate_node, g.parent, nullptr, 0, &kernel), "the gate kernel node");
  cudaGraphNodeParams cond{};
  cond.type = cudaGraphNodeTypeConditional;
  cond.conditional.handle = handle;
  cond.conditional.type = cudaGraphCondTypeIf;
  cond.conditional.size = 1;
  check(cudaGraphAddNode(&if_node, g.parent, &gate_node, nullptr, 1, &cond), "the IF node");
  check(cudaGraphAddChildGraphNode(&child, cond.conditional.phGraph_out[0], nullptr, 0,
                                   body.raw_cuda_graph()),
        "the body's child graph node");
  check(cudaGraphInstantiate(&g.exec, g.parent, 0), "cudaGraphInstantiate");
}

GatedGraph::~GatedGraph() = default;

void GatedGraph::launch() const {
  const auto stream = c10::cuda::getCurrentCUDAStream(impl_->device);
  C10_CUDA_CHECK(cudaGraphLaunch(impl_->exec, stream));
}

}  // namespace dflash::kernels
