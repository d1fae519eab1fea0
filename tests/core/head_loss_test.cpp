// The chunked LM-head loss against full logits and autograd: loss, predictions, per-position
// counts and d(loss)/d(hidden), with a row count that leaves the last chunk short (the rows of a
// step vary; the chunks reuse one buffer).
// Also train::select_unique_rows, which picks the labelled rows the loss reads.
#include <gtest/gtest.h>

#include <vector>

#include "train/loss.h"
#include "train/step.h"

namespace dflash {
namespace {

// The labelled rows' selection: index_select's values and gradient (the rows do not repeat, so
// writing each gradient to its row is adding it to zero), in fp32 and bf16.
TEST(SelectUniqueRows, MatchesIndexSelectValuesAndGradients) {
  at::manual_seed(5);
  const auto rows = at::tensor(std::vector<int64_t>{0, 2, 3, 7, 8}, at::kLong);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto x = at::randn({10, 6}).to(dtype).requires_grad_(true);
    auto ref = x.detach().clone().requires_grad_(true);
    auto dy = at::randn({5, 6}).to(dtype);
    auto got = train::select_unique_rows(x, rows);
    auto want = ref.index_select(0, rows);
    EXPECT_TRUE(at::equal(got, want));
    got.backward(dy);
    want.backward(dy);
    EXPECT_TRUE(at::equal(x.grad(), ref.grad()));
  }
}

TEST(HeadLoss, ChunksMatchFullLogitsAndAutograd) {
  at::manual_seed(3);
  const int64_t m = 11, h = 8, vocab = 50, block_size = 5;
  auto hidden = at::randn({m, h});
  auto lm_head = at::randn({vocab, h});
  auto labels = at::randint(vocab, {m}, at::TensorOptions().dtype(at::kLong));
  auto label_k = at::randint(1, block_size, {m}, at::TensorOptions().dtype(at::kLong));
  auto weights = at::rand({m}) + 0.1;
  const double grad_scale = 0.25;

  auto ref_hidden = hidden.to(at::kDouble).requires_grad_(true);
  auto logits = ref_hidden.mm(lm_head.to(at::kDouble).t());
  auto ce = at::logsumexp(logits, {1}) - logits.gather(1, labels.unsqueeze(1)).squeeze(1);
  auto weighted = (weights.to(at::kDouble) * ce).sum();
  (weighted * grad_scale).backward();
  auto ref_pred = logits.detach().argmax(1);

  for (int64_t chunk : {4, 11, 64}) {
    SCOPED_TRACE(chunk);
    auto r = train::chunked_head_loss(hidden, lm_head, labels, weights, label_k, block_size,
                                      grad_scale, chunk);
    EXPECT_NEAR(r.weighted_ce.item<double>(), weighted.item<double>(), 1e-4);
    EXPECT_TRUE(at::allclose(r.grad_hidden.to(at::kDouble), ref_hidden.grad(), 1e-5, 1e-5));
    EXPECT_TRUE(at::equal(r.predictions, ref_pred));
    auto correct = at::zeros({block_size}), count = at::zeros({block_size});
    for (int64_t i = 0; i < m; ++i) {
      const int64_t k = label_k[i].item<int64_t>();
      count[k] += 1;
      if (ref_pred[i].item<int64_t>() == labels[i].item<int64_t>()) correct[k] += 1;
    }
    EXPECT_TRUE(at::equal(r.count, count));
    EXPECT_TRUE(at::equal(r.correct, correct));
  }
}

}  // namespace
}  // namespace dflash
