// AdamW that writes the compute-dtype weights in its pass (kernels::adamw_cast_) and the
// drafter reading those copies: on the CPU a bf16 training step with copies is bitwise the step
// without them (casts in the forward); on the GPU the kernel against at::_fused_adamw_ + cast.
#include "kernels/adamw_cast.h"

#include <gtest/gtest.h>

#include "drafter_test_util.h"
#include "train/optim.h"
#include "train/step.h"

namespace dflash {
namespace {

using testing::DflashCase;

TEST(AdamWCast, DrafterStepWithCopiesEqualsCastsInTheForward) {
  DflashCase plain("tied"), copied("tied");
  const auto head_plain = models::TargetHead::of(*plain.target);
  const auto head_copied = models::TargetHead::of(*copied.target);
  train::AdamWOptions ao;
  ao.weight_decay = 0.01;
  auto params_plain = plain.drafter->parameters(), params_copied = copied.drafter->parameters();
  train::AdamW opt_plain(params_plain, ao), opt_copied(params_copied, ao);
  const auto& copies = copied.drafter->compute_copies(at::kBFloat16);
  opt_copied.set_compute_copies(copies);
  train::StepOptions so;
  so.dtype = at::kBFloat16;
  so.attention = models::DrafterAttention::kDense;
  auto step = [&](DflashCase& c, const models::TargetHead& head, train::AdamW& opt,
                  std::vector<at::Tensor>& params, double found_inf) {
    auto r = train::forward_backward(*c.drafter, head, c.input, c.anchors, 0.5, so);
    auto norm = train::grad_norm(params);
    std::vector<at::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().clone());
    opt.step(1e-2, train::clip_divisor(norm, 0.1), at::full({}, found_inf));
    for (auto& p : params) p.mutable_grad() = at::Tensor();
    return std::pair{r.weighted_ce.item<double>(), grads};
  };
  // The third step is skipped as a non-finite one would be: nothing may move.
  for (double found_inf : {0.0, 0.0, 1.0, 0.0}) {
    SCOPED_TRACE(found_inf);
    auto [loss_plain, grads_plain] = step(plain, head_plain, opt_plain, params_plain, found_inf);
    auto [loss_copied, grads_copied] =
        step(copied, head_copied, opt_copied, params_copied, found_inf);
    EXPECT_EQ(loss_plain, loss_copied);
    for (size_t i = 0; i < params_plain.size(); ++i) {
      SCOPED_TRACE(copied.drafter->named_parameters()[i].first);
      EXPECT_TRUE(at::equal(grads_plain[i], grads_copied[i]));
      EXPECT_TRUE(at::equal(params_plain[i], params_copied[i]));
      EXPECT_TRUE(at::equal(copies[i], params_copied[i].to(at::kBFloat16)));
    }
  }
  // Masters written outside the optimizer (a resume) are cast again before the next forward.
  std::vector<std::pair<std::string, at::Tensor>> values;
  for (const auto& [name, p] : plain.drafter->named_parameters()) {
    values.push_back({name, p.detach() * 1.5});
  }
  plain.drafter->assign(values, "test");
  copied.drafter->assign(values, "test");
  auto [loss_plain, grads_plain] = step(plain, head_plain, opt_plain, params_plain, 0.0);
  auto [loss_copied, grads_copied] = step(copied, head_copied, opt_copied, params_copied, 0.0);
  EXPECT_EQ(loss_plain, loss_copied);
  for (size_t i = 0; i < params_plain.size(); ++i) {
    EXPECT_TRUE(at::equal(grads_plain[i], grads_copied[i]));
  }
}

TEST(AdamWCast, CudaMatchesFusedAdamWAndCast) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  // A tensor over two kernel chunks (65,536 elements each) with a ragged end, and small ones.
  const std::vector<std::vector<int64_t>> shapes = {{2 * 65536 + 37}, {3, 5}, {128}, {1}};
  auto f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  std::vector<at::Tensor> p_ref, g, m_ref, v_ref, c_ref, p, m, v, c;
  for (const auto& s : shapes) {
    p_ref.push_back(at::randn(s, f32));
    g.push_back(at::randn(s, f32));
    m_ref.push_back(at::randn(s, f32) * 0.1);
    v_ref.push_back(at::rand(s, f32) * 0.01);
    c_ref.push_back(at::empty(s, f32.dtype(at::kBFloat16)));
    p.push_back(p_ref.back().clone());
    m.push_back(m_ref.back().clone());
    v.push_back(v_ref.back().clone());
    c.push_back(at::empty(s, f32.dtype(at::kBFloat16)));
  }
  auto step = at::zeros({}, f32);
  for (double found_inf : {0.0, 0.0, 1.0, 0.0}) {
    SCOPED_TRACE(found_inf);
    step.add_(1.0 - found_inf);
    const auto divisor = at::full({}, 2.5, f32), inf = at::full({}, found_inf, f32);
    auto grads_before = g;
    for (auto& t : grads_before) t = t.clone();
    auto p_before = p;
    for (auto& t : p_before) t = t.clone();
    // The reference divides the gradients in place; give it its own.
    std::vector<at::Tensor> g_ref;
    for (auto& t : g) g_ref.push_back(t.clone());
    kernels::adamw_cast_reference_(p_ref, g_ref, m_ref, v_ref, c_ref, step, 1e-3, 0.9, 0.999, 0.01,
                                   1e-8, divisor, inf);
    kernels::adamw_cast_(p, g, m, v, c, step, 1e-3, 0.9, 0.999, 0.01, 1e-8, divisor, inf);
    for (size_t i = 0; i < shapes.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_TRUE(at::allclose(p[i], p_ref[i], 1e-6, 1e-7))
          << (p[i] - p_ref[i]).abs().max().item<double>();
      EXPECT_TRUE(at::allclose(m[i], m_ref[i], 1e-6, 1e-8));
      EXPECT_TRUE(at::allclose(v[i], v_ref[i], 1e-6, 1e-10));
      EXPECT_TRUE(at::equal(c[i], p[i].to(at::kBFloat16)));
      EXPECT_TRUE(at::equal(g[i], grads_before[i]));  // only read
      if (found_inf == 1.0) {
        EXPECT_TRUE(at::equal(p[i], p_before[i]));
      }
    }
  }
}

TEST(AdamWCast, MismatchedListsAreNamed) {
  auto p = at::zeros({4});
  auto bad = at::zeros({3});
  auto c = at::zeros({4}, at::kBFloat16);
  auto step = at::ones({});
  EXPECT_THROW(kernels::adamw_cast_({p}, {bad}, {p.clone()}, {p.clone()}, {c}, step, 1e-3, 0.9,
                                    0.999, 0, 1e-8, std::nullopt, std::nullopt),
               Error);
  EXPECT_THROW(kernels::adamw_cast_({p}, {p.clone()}, {p.clone()}, {p.clone()}, {}, step, 1e-3, 0.9,
                                    0.999, 0, 1e-8, std::nullopt, std::nullopt),
               Error);
}

}  // namespace
}  // namespace dflash
