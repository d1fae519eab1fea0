// AdamW that writes the compute-dtype weights in its pass (kernels::adamw_cast_) and the
// drafter reading those copies: on the CPU a bf16 training step with copies (gradients on the
// masters or on the copies) is bitwise the step without them (casts in the forward); on the
// GPU the kernel, with fp32 and bf16 gradients, against at::_fused_adamw_ + cast.
#include "kernels/adamw_cast.h"

#include <gtest/gtest.h>

#include "drafter_test_util.h"
#include "train/optim.h"
#include "train/step.h"

namespace dflash {
namespace {

using testing::DflashCase;

TEST(AdamWCast, DrafterStepWithCopiesEqualsCastsInTheForward) {
  // Three drafters from one seed: casts in the forward, copies with the gradients cast onto the
  // fp32 masters, copies that hold their own bf16 gradients (no cast pass): the same steps.
  DflashCase plain("tied"), copied("tied"), leaves("tied");
  const auto head_plain = models::TargetHead::of(*plain.target);
  const auto head_copied = models::TargetHead::of(*copied.target);
  const auto head_leaves = models::TargetHead::of(*leaves.target);
  train::AdamWOptions ao;
  ao.weight_decay = 0.01;
  auto params_plain = plain.drafter->parameters(), params_copied = copied.drafter->parameters(),
       params_leaves = leaves.drafter->parameters();
  train::AdamW opt_plain(params_plain, ao), opt_copied(params_copied, ao),
      opt_leaves(params_leaves, ao);
  const auto& copies = copied.drafter->compute_copies(at::kBFloat16);
  opt_copied.set_compute_copies(copies);
  const auto& leaf_copies =
      leaves.drafter->compute_copies(at::kBFloat16, /*gradients_on_copies=*/true);
  opt_leaves.set_compute_copies(leaf_copies);
  train::StepOptions so;
  so.dtype = at::kBFloat16;
  so.attention = models::DrafterAttention::kDense;
  auto step = [&](DflashCase& c, const models::TargetHead& head, train::AdamW& opt,
                  double found_inf) {
    auto r = train::forward_backward(*c.drafter, head, c.input, c.anchors, 0.5, so);
    const auto grads_now = opt.gradients();
    auto norm = train::grad_norm(grads_now);
    std::vector<at::Tensor> grads;  // fp32 copies: the reference divides fp32 ones in place
    int64_t bf16_grads = 0;
    for (const auto& g : grads_now) {
      grads.push_back(g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
      bf16_grads += g.scalar_type() == at::kBFloat16;
    }
    opt.step(1e-2, train::clip_divisor(norm, 0.1), at::full({}, found_inf));
    opt.clear_gradients();
    // Every weight but the one each layer reads twice (k_norm) keeps its gradient on its copy
    // in the third drafter; none does in the others.
    const int64_t layers = c.drafter->config().layers.num_layers;
    EXPECT_EQ(bf16_grads, &c == &leaves ? static_cast<int64_t>(grads.size()) - layers : 0);
    return std::tuple{r.weighted_ce.item<double>(), grads, norm.item<float>()};
  };
  auto expect_same_steps = [&](double found_inf) {
    auto [loss_plain, grads_plain, norm_plain] = step(plain, head_plain, opt_plain, found_inf);
    auto [loss_copied, grads_copied, norm_copied] =
        step(copied, head_copied, opt_copied, found_inf);
    auto [loss_leaves, grads_leaves, norm_leaves] =
        step(leaves, head_leaves, opt_leaves, found_inf);
    EXPECT_EQ(loss_plain, loss_copied);
    EXPECT_EQ(loss_plain, loss_leaves);
    EXPECT_EQ(norm_plain, norm_copied);
    EXPECT_EQ(norm_plain, norm_leaves);
    for (size_t i = 0; i < params_plain.size(); ++i) {
      SCOPED_TRACE(copied.drafter->named_parameters()[i].first);
      EXPECT_EQ(leaf_copies[i].grad().defined() ? 1 : 0, 0);  // cleared after the step
      EXPECT_FALSE(params_leaves[i].grad().defined());        // never on the master
      EXPECT_TRUE(at::equal(grads_plain[i], grads_copied[i]));
      EXPECT_TRUE(at::equal(grads_plain[i], grads_leaves[i]));
      EXPECT_TRUE(at::equal(params_plain[i], params_copied[i]));
      EXPECT_TRUE(at::equal(params_plain[i], params_leaves[i]));
      EXPECT_TRUE(at::equal(copies[i], params_copied[i].to(at::kBFloat16)));
      EXPECT_TRUE(at::equal(leaf_copies[i], params_leaves[i].to(at::kBFloat16)));
    }
  };
  // The third step is skipped as a non-finite one would be: nothing may move.
  for (double found_inf : {0.0, 0.0, 1.0, 0.0}) {
    SCOPED_TRACE(found_inf);
    expect_same_steps(found_inf);
  }
  // Masters written outside the optimizer (a resume) are cast again before the next forward.
  std::vector<std::pair<std::string, at::Tensor>> values;
  for (const auto& [name, p] : plain.drafter->named_parameters()) {
    values.push_back({name, p.detach() * 1.5});
  }
  for (auto* c : {&plain, &copied, &leaves}) c->drafter->assign(values, "test");
  SCOPED_TRACE("after assign");
  expect_same_steps(0.0);
}

TEST(AdamWCast, CudaMatchesFusedAdamWAndCast) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  // A tensor over two kernel chunks (65,536 elements each) with a ragged end, small ones, and
  // one whose weights start 4 bytes into a buffer (a view into a flat buffer: no vector access).
  const std::vector<std::vector<int64_t>> shapes = {{2 * 65536 + 37}, {3, 5}, {128}, {1}, {1001}};
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
  p.back() = at::empty({1002}, f32).narrow(0, 1, 1001).copy_(p.back());
  auto step = at::zeros({}, f32);
  // fp32 gradients, then bf16 ones (read as they are: the reference widens them first).
  const std::vector<double> skips = {0.0, 0.0, 1.0, 0.0, 0.0, 0.0};
  for (size_t k = 0; k < skips.size(); ++k) {
    const double found_inf = skips[k];
    SCOPED_TRACE(k);
    if (k == 4) {
      for (auto& t : g) t = t.to(at::kBFloat16);
    }
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
  // Gradients in a dtype other than fp32 and the copies'.
  EXPECT_THROW(kernels::adamw_cast_({p}, {p.to(at::kHalf)}, {p.clone()}, {p.clone()}, {c}, step,
                                    1e-3, 0.9, 0.999, 0, 1e-8, std::nullopt, std::nullopt),
               Error);
}

}  // namespace
}  // namespace dflash
