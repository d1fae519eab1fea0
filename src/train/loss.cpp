#include "train/loss.h"

#include <c10/core/GradMode.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "kernels/cross_entropy.h"

namespace dflash::train {

HeadGrad parse_head_grad(const std::string& name, const std::string& what) {
  if (auto value = enum_value(kHeadGradNames, name)) return *value;
  fail("{}: unknown LM-head gradient precision '{}' (expected {})", what, name,
       enum_choices(kHeadGradNames));
}

HeadGrad resolve_head_grad(HeadGrad requested, at::Device device, int64_t vocab, int64_t hidden,
                           at::ScalarType dtype) {
  if (requested == HeadGrad::kCompute) return requested;
  if (!device.is_cuda()) return requested == HeadGrad::kAuto ? HeadGrad::kCompute : requested;
  std::string why = kernels::fp8_gemm_unsupported(device, dtype);
  if (why.empty() && (vocab % 16 != 0 || hidden % 16 != 0)) {
    why =
        fmt::format("the head [{}, {}] is not a multiple of 16 in both dimensions", vocab, hidden);
  }
  if (why.empty()) return HeadGrad::kFp8;
  if (requested == HeadGrad::kAuto) return HeadGrad::kCompute;
  fail("the fp8 LM-head gradient cannot run: {}; use --head-grad compute", why);
}

HeadGrad resolve_head_grad(HeadGrad requested, const at::Tensor& head, at::ScalarType dtype) {
  if (head.dim() != 2) fail("LM head: expected [vocab, hidden], got {}", head.sizes());
  return resolve_head_grad(requested, head.device(), head.size(0), head.size(1), dtype);
}

kernels::Fp8Rows head_grad_fp8(const at::Tensor& lm_head) {
  c10::NoGradGuard no_grad;
  if (lm_head.dim() != 2) fail("LM head: expected [vocab, hidden], got {}", lm_head.sizes());
  return kernels::quantize_columns_e4m3(lm_head);
}

HeadLoss chunked_head_loss(const at::Tensor& hidden, const at::Tensor& lm_head,
                           const at::Tensor& labels, const at::Tensor& weights,
                           const at::Tensor& label_k, int64_t block_size, double grad_scale,
                           int64_t chunk_rows, const kernels::Fp8Rows* head_t_fp8) {
  c10::NoGradGuard no_grad;
  const int64_t m = hidden.size(0);
  if (hidden.dim() != 2 || lm_head.dim() != 2 || hidden.size(1) != lm_head.size(1)) {
    fail("head loss: hidden {} and LM head {} do not fit", hidden.sizes(), lm_head.sizes());
  }
  if (chunk_rows < 1) fail("head loss: chunk_rows must be positive");
  if (head_t_fp8 != nullptr &&
      head_t_fp8->data.sizes() != at::IntArrayRef{lm_head.size(1), lm_head.size(0)}) {
    fail("head loss: the fp8 head is {}, expected the LM head {} transposed",
         head_t_fp8->data.sizes(), lm_head.sizes());
  }
  auto f32 = hidden.options().dtype(at::kFloat);
  HeadLoss out;
  out.weighted_ce = at::zeros({}, f32);
  out.correct = at::zeros({block_size}, f32);
  out.count = at::zeros({block_size}, f32);
  out.predictions = at::empty({m}, labels.options());
  out.grad_hidden = at::empty_like(hidden);
  const auto w_head = lm_head.to(hidden.scalar_type());
  // One logits buffer of chunk_rows rows serves every chunk, the last (shorter) one included:
  // the row count varies from step to step, the size the allocator sees does not.
  at::Tensor buffer;
  if (m > 0) buffer = at::empty({chunk_rows, lm_head.size(0)}, hidden.options());
  // FP8 input gradient: the loss kernel writes e4m3 rows here, the logits stay as they are.
  kernels::Fp8Rows grad8;
  if (m > 0 && head_t_fp8 != nullptr) {
    grad8 = {at::empty({chunk_rows, lm_head.size(0)}, hidden.options().dtype(at::kFloat8_e4m3fn)),
             at::empty({chunk_rows}, f32)};
  }
  for (int64_t start = 0; start < m; start += chunk_rows) {
    const int64_t n = std::min(chunk_rows, m - start);
    auto h = hidden.narrow(0, start, n);
    auto y = labels.narrow(0, start, n);
    auto w = weights.narrow(0, start, n);
    auto k = label_k.narrow(0, start, n);
    auto logits = buffer.narrow(0, 0, n);  // [n, V] in the compute dtype, this chunk only
    at::mm_out(logits, h, w_head.t());
    // The fused kernel turns the logits into d(grad_scale * weighted CE)/d(logits): in place,
    // or as e4m3 rows into grad8.
    kernels::Fp8Rows g;
    if (head_t_fp8 != nullptr) g = {grad8.data.narrow(0, 0, n), grad8.scale.narrow(0, 0, n)};
    auto r = head_t_fp8 != nullptr ? kernels::cross_entropy_rows_fp8(logits, y, w * grad_scale, g)
                                   : kernels::cross_entropy_rows_(logits, y, w * grad_scale);
    out.weighted_ce.add_((r.loss * w).sum());
    out.predictions.narrow(0, start, n).copy_(r.argmax);
    out.correct.index_add_(0, k, r.argmax.eq(y).to(at::kFloat));
    out.count.index_add_(0, k, at::ones({n}, f32));
    auto grad_rows = out.grad_hidden.narrow(0, start, n);
    if (head_t_fp8 != nullptr) {
      kernels::mm_fp8_rows_out(grad_rows, g, *head_t_fp8);
    } else {
      at::mm_out(grad_rows, logits, w_head);
    }
  }
  return out;
}

}  // namespace dflash::train
