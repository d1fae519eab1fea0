// kernel_bench: kernels/swiglu, the drafter's SwiGLU over a training step's block rows (512
// anchors x 16): the fused forward and backward against ATen's silu and mul and the three
// passes of their backward (what they replace), validated against the fp32 references.
#include "kernel_bench/bench.h"
#include "kernels/swiglu.h"

namespace dflash::kernel_bench {

void bench_swiglu(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t rows = 512 * 16, f = c.intermediate_size;
  auto gate = at::randn({rows, f}, opts), up = at::randn({rows, f}, opts);
  auto dy = at::randn({rows, f}, opts);
  {
    b.check("swiglu forward", kernels::swiglu_forward(gate, up),
            kernels::swiglu_forward_reference(gate, up), kRoundedOnce);
    const auto [d_gate, d_up] = kernels::swiglu_backward(dy, gate, up);
    const auto [d_gate_want, d_up_want] = kernels::swiglu_backward_reference(dy, gate, up);
    b.check("swiglu backward d(gate)", d_gate, d_gate_want, kRoundedOnce);
    b.check("swiglu backward d(up)", d_up, d_up_want, kRoundedOnce);
  }
  const double tensor_bytes = 2.0 * rows * f;
  b.report("swiglu forward", rows, f, 0,
           b.graph_us([&](int) { kernels::swiglu_forward(gate, up); }), 3 * tensor_bytes);
  b.report("at::silu * up", rows, f, 0, b.graph_us([&](int) { at::silu(gate) * up; }),
           5 * tensor_bytes);
  b.report("swiglu backward", rows, f, 0,
           b.graph_us([&](int) { kernels::swiglu_backward(dy, gate, up); }), 5 * tensor_bytes);
  // What autograd runs for silu(gate) * up: d(up) = dy * silu(gate) (saved), d(silu) = dy * up,
  // then silu's backward.
  auto silu = at::silu(gate);
  b.report("ATen backward of silu * up", rows, f, 0, b.graph_us([&](int) {
    auto grad_up = dy * silu;
    at::silu_backward(dy * up, gate);
  }),
           9 * tensor_bytes);
}

}  // namespace dflash::kernel_bench
