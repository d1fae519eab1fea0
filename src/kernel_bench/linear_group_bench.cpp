// kernel_bench: models::linear_group, the drafter's attention-input projections at the step's
// shape (q over 8,192 block rows, k and v over them and over the 2,048 context rows), forward
// and backward: one node, gradient sums inside the GEMMs, against five at::linear under
// autograd (what it replaces: an add kernel per extra reader of h and ctx, two gradients per
// k/v weight summed apart), and with --drafter-gemms fp8; validated against the five
// at::linear, outputs and gradients. Then kernels/fp8_rows' quantizers on those gradients,
// the SwiGLU activations and the stacked weights, against what they replace.
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>

#include "kernel_bench/bench.h"
#include "kernels/fp8_rows.h"
#include "models/linear_group.h"

namespace dflash::kernel_bench {
namespace {

using Group = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&,
                                                    const std::vector<at::Tensor>&)>;

// The row quantizer alone on the q/k/v output gradients side by side (one scale a row of the
// three) and on the SwiGLU activations: bytes read once (the second read is meant to hit L2)
// and written once in e4m3. Then the stacked q/k/v weights' columns as rows (the block rows'
// input gradient's second operand): the column quantizer against what it replaced, the stack
// transposed by ATen and then quantized by rows. Bytes: the weights read twice, written once in
// e4m3. Each validated against the ATen composition it replaces, bit for bit.
void bench_quantizers(const Bench& b, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& qkv_weights) {
  const models::ModelConfig& c = b.config;
  const int64_t rows = grads[0].size(0), n = grads[0].size(1) + 2 * grads[1].size(1);
  const int64_t h = qkv_weights[0].size(1);
  b.check("quantize_rows_e4m3 (q/k/v grads side by side, dequantised)",
          kernels::dequantize_rows(kernels::quantize_rows_e4m3(grads)),
          kernels::dequantize_rows(kernels::quantize_rows_e4m3_reference(at::cat(grads, 1))),
          kBitwise);
  b.report("quantize_rows_e4m3 (q/k/v grads)", rows, n, 0,
           b.graph_us([&](int) { kernels::quantize_rows_e4m3(grads); }), 3.0 * rows * n);
  auto act = at::randn({rows, c.intermediate_size}, b.opts);
  b.report("quantize_rows_e4m3 (SwiGLU act)", rows, c.intermediate_size, 0,
           b.graph_us([&](int) { kernels::quantize_rows_e4m3(act); }),
           3.0 * rows * c.intermediate_size);
  auto stacked_rows = [&] {
    return kernels::quantize_rows_e4m3(at::cat(qkv_weights, 0).t().contiguous());
  };
  b.check("quantize_columns_e4m3 (q/k/v weights, dequantised)",
          kernels::dequantize_rows(kernels::quantize_columns_e4m3(qkv_weights)),
          kernels::dequantize_rows(stacked_rows()), kBitwise);
  const double weight_bytes = 5.0 * n * h;
  b.report("quantize_columns_e4m3 (q/k/v weights)", h, n, 0,
           b.graph_us([&](int) { kernels::quantize_columns_e4m3(qkv_weights); }), weight_bytes);
  b.report("cat + t().contiguous() + quantize_rows_e4m3", h, n, 0,
           b.graph_us([&](int) { stacked_rows(); }), weight_bytes);
}

}  // namespace

void bench_linear_group(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t h = c.hidden_size;
  const int64_t d = c.head_dim;
  const int64_t q = c.num_heads * c.head_dim;
  const int64_t rows = 512 * 16, ctx_rows = 2048, kv = c.num_kv_heads * d;
  auto hx = at::randn({rows, h}, opts), cx = at::randn({ctx_rows, h}, opts);
  auto wq = at::randn({q, h}, opts) * 0.02, wk = at::randn({kv, h}, opts) * 0.02,
       wv = at::randn({kv, h}, opts) * 0.02;
  std::vector<at::Tensor> dys = {at::randn({rows, q}, opts), at::randn({rows, kv}, opts),
                                 at::randn({rows, kv}, opts), at::randn({ctx_rows, kv}, opts),
                                 at::randn({ctx_rows, kv}, opts)};
  // Runs `each` on leaves copied from the inputs and weights, under autograd.
  auto with_leaves = [&](const auto& each) {
    const c10::AutoGradMode grad_mode(true);
    std::vector<at::Tensor> xs = {hx.detach().requires_grad_(true),
                                  cx.detach().requires_grad_(true)};
    std::vector<at::Tensor> ws = {wq.detach().requires_grad_(true),
                                  wk.detach().requires_grad_(true),
                                  wv.detach().requires_grad_(true)};
    return each(xs, ws);
  };
  auto time_group = [&](const Group& forward) {
    return with_leaves([&](std::vector<at::Tensor>& xs, std::vector<at::Tensor>& ws) {
      return b.eager_us([&] {
        torch::autograd::backward(forward(xs, ws), dys);
        for (auto* list : {&xs, &ws}) {
          for (auto& t : *list) t.mutable_grad() = at::Tensor();
        }
      });
    });
  };
  const std::vector<models::LinearProduct> products = {{0, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 2}};
  const Group group = [&](const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
    return models::linear_group(xs, ws, products);
  };
  const Group linears = [&](const std::vector<at::Tensor>& xs, const std::vector<at::Tensor>& ws) {
    std::vector<at::Tensor> out;
    for (const auto& p : products) out.push_back(at::linear(xs[p.input], ws[p.weight]));
    return out;
  };
  const Group group_fp8 = [&](const std::vector<at::Tensor>& xs,
                              const std::vector<at::Tensor>& ws) {
    return models::linear_group(xs, ws, products, /*fp8=*/true);
  };
  {
    // Outputs, then the gradients of the inputs and weights, against the five at::linear's.
    auto outputs_and_grads = [&](const Group& forward) {
      return with_leaves([&](std::vector<at::Tensor>& xs, std::vector<at::Tensor>& ws) {
        auto out = forward(xs, ws);
        torch::autograd::backward(out, dys);
        for (const auto& t : xs) out.push_back(t.grad());
        for (const auto& t : ws) out.push_back(t.grad());
        return out;
      });
    };
    const auto want = outputs_and_grads(linears);
    const char* names[] = {"q",    "k",      "v",      "k (context)", "v (context)",
                           "d(h)", "d(ctx)", "d(w_q)", "d(w_k)",      "d(w_v)"};
    auto compare = [&](const std::string& what, const Group& forward, double rtol) {
      const auto got = outputs_and_grads(forward);
      for (size_t i = 0; i < got.size(); ++i) {
        b.check(fmt::format("{} {}", what, names[i]), got[i], want[i], rtol);
      }
    };
    // Autograd rounds each product's gradient to bf16 and adds them in bf16; linear_group sums
    // them inside its GEMMs: a few bf16 ulps of the largest apart.
    compare("linear_group", group, 1.0 / 16);
    // FP8 GEMMs: both operands of the forward and the input gradients rounded to 3 mantissa bits.
    if (kernels::fp8_gemm_supported(b.device)) compare("linear_group fp8", group_fp8, 1.0 / 8);
  }
  const double gemm_bytes = 2.0 * ((rows + ctx_rows) * h * 3 + (q + 2 * kv) * h * 3);
  const double us_group = time_group(group);
  const double us_linears = time_group(linears);
  b.report("linear_group q/k/v fwd + bwd", rows, q + 2 * kv, h, us_group, gemm_bytes);
  b.report("5 x at::linear fwd + bwd (autograd)", rows, q + 2 * kv, h, us_linears, gemm_bytes);
  const double flops = 3 * 2.0 * h * (rows * (q + 2.0 * kv) + ctx_rows * 2.0 * kv);
  fmt::print(
      "q/k/v projections fwd + bwd: {:.1f} TFLOP/s linear_group, {:.1f} TFLOP/s at::linear\n",
      flops / us_group / 1e6, flops / us_linears / 1e6);
  // The same node with --drafter-gemms fp8: forward and input gradients as FP8 GEMMs, the
  // quantizer and the stacked weights' transposes included.
  if (kernels::fp8_gemm_supported(b.device)) {
    const double us_fp8 = time_group(group_fp8);
    b.report("linear_group q/k/v fwd + bwd, fp8", rows, q + 2 * kv, h, us_fp8, gemm_bytes);
    fmt::print("q/k/v projections fwd + bwd: {:.1f} TFLOP/s (bf16-equivalent) with fp8 GEMMs\n",
               flops / us_fp8 / 1e6);
  }
  bench_quantizers(b, {dys[0], dys[1], dys[2]}, {wq, wk, wv});
}

}  // namespace dflash::kernel_bench
