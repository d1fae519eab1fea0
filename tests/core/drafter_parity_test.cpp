// The C++ DFlash training step against the plain-PyTorch reference (tests/python/
// dflash_reference.py) on tiny Qwen3 targets (tied, untied, and a drafter with sliding-window
// layers whose window is shorter than most sequences), several sequences with
// different lengths and loss masks, the same anchors: loss, per-position accuracy,
// predictions and every drafter parameter gradient, in fp32, for both attention paths.
#include <gtest/gtest.h>

#include "drafter_test_util.h"
#include "train/trainer.h"

namespace dflash {
namespace {

using models::DrafterAttention;
using testing::DflashCase;

struct ParityParam {
  std::string fixture;
  DrafterAttention attention;
};
void PrintTo(const ParityParam& p, std::ostream* os) {
  *os << p.fixture << (p.attention == DrafterAttention::kDense ? "/dense" : "/gathered");
}

class DrafterParity : public ::testing::TestWithParam<ParityParam> {};

TEST_P(DrafterParity, TapsAreHiddenStatesOfLayerIdPlusOne) {
  DflashCase c(GetParam().fixture);
  // The reference's features are transformers' hidden_states[id + 1] (output of layer id).
  EXPECT_CLOSE(c.input.features, c.tensor("features"), 1e-5);
}

TEST_P(DrafterParity, StepMatchesReference) {
  DflashCase c(GetParam().fixture);
  ASSERT_DOUBLE_EQ(c.drafter->config().gamma, c.tensor("gamma").item<double>());
  train::StepOptions options;
  options.attention = GetParam().attention;
  auto r = train::forward_backward(*c.drafter, models::TargetHead::of(*c.target), c.input,
                                   c.anchors, /*grad_scale=*/1.0, options);
  ASSERT_GT(r.weight_sum, 0);
  const double loss = r.weighted_ce.item<double>() / r.weight_sum;
  const double ref_loss = c.tensor("loss").item<double>();
  EXPECT_NEAR(loss, ref_loss, 1e-4 * std::abs(ref_loss));

  // Predictions where the reference's top-2 margin leaves no room for rounding to flip them.
  auto pred = r.predictions, ref_pred = c.tensor("predictions");
  ASSERT_EQ(pred.sizes(), ref_pred.sizes());
  auto clear = c.tensor("margin") > 1e-3;
  EXPECT_TRUE(pred.masked_select(clear).equal(ref_pred.masked_select(clear)));
  auto acc = (r.correct / r.count.clamp_min(1)).narrow(0, 1, c.drafter->config().block_size - 1);
  EXPECT_TRUE(at::allclose(acc.to(at::kDouble), c.tensor("accuracy"), 0, 1e-6))
      << acc << c.tensor("accuracy");

  int checked = 0;
  for (const auto& [name, p] : c.drafter->named_parameters()) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(p.grad().defined());
    EXPECT_CLOSE(p.grad() / r.weight_sum, c.tensor("grad/" + name), 1e-4);
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(c.drafter->named_parameters().size()));
  EXPECT_GT(checked, 10);
}

INSTANTIATE_TEST_SUITE_P(Cases, DrafterParity,
                         ::testing::Values(ParityParam{"tied", DrafterAttention::kDense},
                                           ParityParam{"tied", DrafterAttention::kGathered},
                                           ParityParam{"untied", DrafterAttention::kDense},
                                           ParityParam{"untied", DrafterAttention::kGathered},
                                           ParityParam{"sliding", DrafterAttention::kDense},
                                           ParityParam{"sliding", DrafterAttention::kGathered}),
                         [](const auto& info) {
                           return info.param.fixture +
                                  (info.param.attention == DrafterAttention::kDense ? "_dense"
                                                                                    : "_gathered");
                         });

}  // namespace
}  // namespace dflash
