// kernel_bench: kernels/cross_entropy, the LM-head loss over one chunk of the training step's
// rows (train::StepOptions' head_chunk_rows, 1024) at the target's vocabulary, in place as the
// step runs it (ATen's path casts to fp32 and makes about ten passes; kernels::
// cross_entropy_rows_reference_ is that path and the validation's oracle): the kernel reads
// each row twice (the second time mostly from L2) and writes it once. Bytes: the logits read
// once and written once, the least any version moves. Then its fp8 variant (--head-grad fp8)
// and the head's input-gradient GEMM in bf16 against FP8 (kernels/fp8_rows).
#include <fmt/format.h>

#include "kernel_bench/bench.h"
#include "kernels/cross_entropy.h"
#include "kernels/fp8_rows.h"
#include "train/loss.h"

namespace dflash::kernel_bench {
namespace {

// The loss kernels against their references on copies of the same logits.
void check_head_loss(const Bench& b, const at::Tensor& logits, const at::Tensor& labels,
                     const at::Tensor& coef) {
  auto ours = logits.clone(), want = logits.clone();
  const auto r = kernels::cross_entropy_rows_(ours, labels, coef);
  const auto r_want = kernels::cross_entropy_rows_reference_(want, labels, coef);
  // fp32 reductions in another order.
  b.check("cross_entropy_rows_ loss", r.loss, r_want.loss, 1e-5);
  b.check("cross_entropy_rows_ argmax", r.argmax, r_want.argmax, kBitwise);
  b.check("cross_entropy_rows_ gradient", ours, want, kRoundedOnce);
  const auto rows = logits.size(0), vocab = logits.size(1);
  kernels::Fp8Rows g8{at::empty({rows, vocab}, logits.options().dtype(at::kFloat8_e4m3fn)),
                      at::empty({rows}, logits.options().dtype(at::kFloat))};
  kernels::Fp8Rows g8_want{at::empty_like(g8.data), at::empty_like(g8.scale)};
  kernels::cross_entropy_rows_fp8(logits, labels, coef, g8);
  kernels::cross_entropy_rows_fp8_reference(logits, labels, coef, g8_want);
  // e4m3 keeps 3 mantissa bits: one e4m3 ulp is up to 1/8 of a value, so 1/8 of the largest.
  b.check("cross_entropy_rows_fp8 gradient (dequantised)", kernels::dequantize_rows(g8),
          kernels::dequantize_rows(g8_want), 1.0 / 8);
}

// The head's input gradient over that chunk, d(hidden) = d(logits) x head: the bf16 GEMM
// against the FP8 one of e4m3 rows (the loss kernel's output and the head transposed). The
// validation runs both on the gradient of the same logits; FP8 rounds both operands to 3
// mantissa bits, so they agree to within 1/8 of the largest.
void bench_head_input_grad(const Bench& b, const at::Tensor& logits, const at::Tensor& labels,
                           const at::Tensor& coef, const kernels::Fp8Rows& grad8) {
  const at::TensorOptions opts = b.opts;
  const int64_t rows = logits.size(0), vocab = logits.size(1), h = b.config.hidden_size;
  auto head = at::randn({vocab, h}, opts) * 0.02;
  auto head_t8 = train::head_grad_fp8(head);
  auto dh = at::empty({rows, h}, opts);
  {
    auto grad = logits.clone();
    kernels::cross_entropy_rows_(grad, labels, coef);
    kernels::Fp8Rows g8{at::empty_like(grad8.data), at::empty_like(grad8.scale)};
    kernels::cross_entropy_rows_fp8(logits, labels, coef, g8);
    auto dh8 = at::empty_like(dh);
    kernels::mm_fp8_rows_out(dh8, g8, head_t8);
    b.check("LM-head input grad, fp8 GEMM vs bf16", dh8, at::mm(grad, head), 1.0 / 8);
  }
  const double flops = 2.0 * rows * vocab * h;
  const double us_bf16 = b.graph_us([&](int) { at::mm_out(dh, logits, head); });
  const double us_fp8 = b.graph_us([&](int) { kernels::mm_fp8_rows_out(dh, grad8, head_t8); });
  b.report("LM-head input grad, bf16 GEMM", rows, h, vocab, us_bf16,
           2.0 * (rows * vocab + vocab * h + rows * h));
  b.report("LM-head input grad, fp8 GEMM", rows, h, vocab, us_fp8,
           1.0 * (rows * vocab + vocab * h) + 2.0 * rows * h);
  fmt::print("LM-head input grad: {:.1f} TFLOP/s bf16, {:.1f} TFLOP/s fp8\n", flops / us_bf16 / 1e6,
             flops / us_fp8 / 1e6);
}

}  // namespace

void bench_head_loss(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t rows = 1024, vocab = c.vocab_size;
  auto logits = at::randn({rows, vocab}, opts);
  auto labels = at::randint(vocab, {rows}, opts.dtype(at::kLong));
  auto coef = at::rand({rows}, opts.dtype(at::kFloat));
  check_head_loss(b, logits, labels, coef);
  b.report("cross_entropy_rows_ (LM head chunk)", rows, vocab, 0,
           b.graph_us([&](int) { kernels::cross_entropy_rows_(logits, labels, coef); }),
           2.0 * 2.0 * rows * vocab);
  // The fp8 variant (--head-grad fp8): the same reads, the gradient written as e4m3.
  kernels::Fp8Rows grad8{at::empty({rows, vocab}, opts.dtype(at::kFloat8_e4m3fn)),
                         at::empty({rows}, opts.dtype(at::kFloat))};
  b.report("cross_entropy_rows_fp8 (same chunk)", rows, vocab, 0,
           b.graph_us([&](int) { kernels::cross_entropy_rows_fp8(logits, labels, coef, grad8); }),
           3.0 * rows * vocab);
  if (kernels::fp8_gemm_supported(b.device)) bench_head_input_grad(b, logits, labels, coef, grad8);
}

}  // namespace dflash::kernel_bench
