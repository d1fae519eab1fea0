// The target's incremental forward over a KV cache against its full packed forward (fp32,
// CPU): logits and every layer's output for prefill-then-decode, chunked prefill, several
// slots at different lengths, crop-then-reextend; and a cached greedy loop against a loop
// that re-runs the full forward at each step. gpt-oss among the models: its sliding windows
// (5 positions) are shorter than most sequences here, its sinks join every cached softmax; and
// again with its sliding layers in window rings (WindowRings, span 4: rings of 8 rows a slot,
// so prompts, chunks and crops wrap around them).
#include "models/kv_cache.h"

#include <gtest/gtest.h>

#include "common/error.h"
#include "decode_test_util.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::AppendBatch;
using models::ForwardResult;
using models::KVCache;
using models::Logits;
using models::ModelConfig;
using models::PackedBatch;
using models::TargetModel;

struct Variant {
  std::string name;
  ModelConfig config;
  int64_t window_span = 0;  // TargetModel::make_cache's
};

// CTest names each case by this (GoogleTest would print the struct's bytes).
void PrintTo(const Variant& c, std::ostream* os) { *os << c.name; }

std::vector<Variant> variants() {
  using models::Architecture;
  return {{"Qwen3QkNormGqa", testing::tiny_target_config(Architecture::kQwen3)},
          {"Qwen3MoeSparse", testing::tiny_target_config(Architecture::kQwen3Moe)},
          {"Qwen2BiasMha", testing::tiny_target_config(Architecture::kQwen2)},
          {"Llama3ScaledMqa", testing::tiny_target_config(Architecture::kLlama)},
          {"GptOssSinksWindow", testing::tiny_target_config(Architecture::kGptOss)},
          {"GptOssWindowRings", testing::tiny_target_config(Architecture::kGptOss), 4}};
}

class KVCacheParity : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    model_.emplace(testing::peaked_target(GetParam().config, at::kCPU, at::kFloat, 7));
    const int64_t layers = GetParam().config.num_layers;
    for (int64_t i = 0; i < layers; ++i) request_.tap_layers.push_back(i);
    request_.logits = Logits::kAll;
  }
  at::Tensor tokens(int64_t n, uint64_t seed) const {
    return at::randint(GetParam().config.vocab_size, {n}, models::seeded_generator(at::kCPU, seed),
                       at::kLong);
  }
  // The full packed forward over whole sequences: the reference.
  ForwardResult full(const std::vector<at::Tensor>& seqs) const {
    std::vector<int64_t> lengths;
    for (const auto& s : seqs) lengths.push_back(s.size(0));
    return model_->forward(at::cat(seqs), PackedBatch::from_lengths(lengths, at::kCPU), request_);
  }
  ForwardResult append(KVCache& cache, const std::vector<int64_t>& slots,
                       const std::vector<at::Tensor>& chunks) const {
    std::vector<int64_t> counts;
    for (const auto& c : chunks) counts.push_back(c.size(0));
    return model_->forward_cached(at::cat(chunks), AppendBatch::make(cache, slots, counts), cache,
                                  request_);
  }
  KVCache cache(int64_t slots, int64_t capacity) const {
    return model_->make_cache(slots, capacity, GetParam().window_span);
  }
  static void expect_rows(const ForwardResult& got, const ForwardResult& want, int64_t start,
                          int64_t n) {
    EXPECT_CLOSE(got.logits, want.logits.narrow(0, start, n), 1e-5);
    ASSERT_EQ(got.taps.size(), want.taps.size());
    for (size_t i = 0; i < got.taps.size(); ++i) {
      SCOPED_TRACE("layer " + std::to_string(i));
      EXPECT_CLOSE(got.taps[i], want.taps[i].narrow(0, start, n), 1e-5);
    }
  }

  std::optional<TargetModel> model_;
  models::ForwardRequest request_;
};

TEST_P(KVCacheParity, PrefillThenDecode) {
  auto seq = tokens(12, 1);
  auto want = full({seq});
  auto kv = cache(1, 16);
  expect_rows(append(kv, {0}, {seq.narrow(0, 0, 5)}), want, 0, 5);
  for (int64_t p = 5; p < 12; ++p) {
    SCOPED_TRACE("position " + std::to_string(p));
    expect_rows(append(kv, {0}, {seq.narrow(0, p, 1)}), want, p, 1);
  }
  EXPECT_EQ(kv.length(0), 12);
}

TEST_P(KVCacheParity, ChunkedPrefill) {
  auto seq = tokens(12, 2);
  auto want = full({seq});
  auto kv = cache(1, 12);  // exactly full at the end
  int64_t start = 0;
  for (int64_t n : {3, 4, 5}) {
    expect_rows(append(kv, {0}, {seq.narrow(0, start, n)}), want, start, n);
    start += n;
  }
}

TEST_P(KVCacheParity, SeveralSlotsAtDifferentLengths) {
  std::vector<at::Tensor> seqs = {tokens(9, 3), tokens(4, 4), tokens(7, 5)};
  auto want = full(seqs);
  // Slots out of order, one left empty; first a prefill of different lengths, then uneven
  // continuations (a decode step for one entry, chunks for the others), then single tokens.
  const std::vector<int64_t> slots = {2, 0, 3};
  auto kv = cache(4, 10);
  auto first = append(kv, slots,
                      {seqs[0].narrow(0, 0, 5), seqs[1].narrow(0, 0, 3), seqs[2].narrow(0, 0, 1)});
  ForwardResult want_first;
  want_first.logits = at::cat(
      {want.logits.narrow(0, 0, 5), want.logits.narrow(0, 9, 3), want.logits.narrow(0, 13, 1)});
  for (const auto& t : want.taps) {
    want_first.taps.push_back(at::cat({t.narrow(0, 0, 5), t.narrow(0, 9, 3), t.narrow(0, 13, 1)}));
  }
  expect_rows(first, want_first, 0, 9);
  auto second = append(kv, slots,
                       {seqs[0].narrow(0, 5, 2), seqs[1].narrow(0, 3, 1), seqs[2].narrow(0, 1, 6)});
  EXPECT_CLOSE(second.logits.narrow(0, 0, 2), want.logits.narrow(0, 5, 2), 1e-5);
  EXPECT_CLOSE(second.logits.narrow(0, 2, 1), want.logits.narrow(0, 12, 1), 1e-5);
  EXPECT_CLOSE(second.logits.narrow(0, 3, 6), want.logits.narrow(0, 14, 6), 1e-5);
  EXPECT_CLOSE(second.taps[1].narrow(0, 3, 6), want.taps[1].narrow(0, 14, 6), 1e-5);
  // Only the first sequence continues: the others' rows are untouched.
  expect_rows(append(kv, {2}, {seqs[0].narrow(0, 7, 2)}), want, 7, 2);
  EXPECT_EQ(kv.lengths(), (std::vector<int64_t>{4, 0, 9, 7}));
}

TEST_P(KVCacheParity, CropThenReextend) {
  auto a = tokens(8, 6), b = tokens(4, 7);
  auto kv = cache(2, 12);
  append(kv, {1}, {a});
  kv.crop(1, 5);  // the last three were a rejected draft
  auto want = full({at::cat({a.narrow(0, 0, 5), b})});
  expect_rows(append(kv, {1}, {b}), want, 5, 4);
  // A reset slot starts a new sequence over the stale rows.
  kv.reset(1);
  expect_rows(append(kv, {1}, {b}), full({b}), 0, 4);
}

TEST_P(KVCacheParity, LastLogitsPerEntry) {
  std::vector<at::Tensor> seqs = {tokens(6, 8), tokens(3, 9)};
  auto want = full(seqs);
  auto kv = cache(2, 8);
  request_.logits = Logits::kLast;
  auto out = append(kv, {1, 0}, seqs);
  EXPECT_CLOSE(out.logits, at::stack({want.logits[5], want.logits[8]}), 1e-5);
}

TEST_P(KVCacheParity, GreedyLoopMatchesFullRecompute) {
  request_ = {{}, Logits::kLast};
  auto prompt = tokens(5, 10);
  const int64_t steps = 12;
  // Reference: re-run the whole sequence each step.
  std::vector<int64_t> ref(prompt.data_ptr<int64_t>(), prompt.data_ptr<int64_t>() + 5);
  for (int64_t s = 0; s < steps; ++s) {
    auto seq = at::tensor(ref, at::kLong);
    auto out = model_->forward(seq, PackedBatch::from_lengths({seq.size(0)}, at::kCPU), request_);
    ref.push_back(out.logits.argmax(-1).item<int64_t>());
  }
  auto kv = cache(1, 32);
  std::vector<int64_t> got(ref.begin(), ref.begin() + 5);
  auto next = prompt;
  for (int64_t s = 0; s < steps; ++s) {
    auto out = append(kv, {0}, {next});
    next = out.logits.argmax(-1);
    got.push_back(next.item<int64_t>());
  }
  EXPECT_EQ(got, ref);
}

INSTANTIATE_TEST_SUITE_P(Models, KVCacheParity, ::testing::ValuesIn(variants()),
                         [](const auto& info) { return info.param.name; });

TEST(KVCache, RejectsOverflowRepeatsAndStaleStarts) {
  auto config = testing::tiny_target_config(models::Architecture::kQwen3);
  KVCache kv(config, 2, 4, at::kCPU, at::kFloat);
  EXPECT_THROW(AppendBatch::make(kv, {0}, {5}), Error);
  EXPECT_THROW(AppendBatch::make(kv, {1, 1}, {1, 1}), Error);
  EXPECT_THROW(AppendBatch::make(kv, {2}, {1}), Error);
  EXPECT_THROW(kv.crop(0, 1), Error);
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 1);
  auto batch = AppendBatch::make(kv, {0}, {2});
  model.forward_cached(at::zeros({2}, at::kLong), batch, kv, {});
  // The same batch again would overwrite the rows it was planned for.
  EXPECT_THROW(model.forward_cached(at::zeros({2}, at::kLong), batch, kv, {}), Error);
  KVCache other(testing::tiny_target_config(models::Architecture::kLlama), 1, 4, at::kCPU,
                at::kDouble);
  EXPECT_THROW(model.forward_cached(at::zeros({1}, at::kLong), AppendBatch::make(other, {0}, {1}),
                                    other, {}),
               Error);
}

// gpt-oss' sliding layers (0 and 2 of the tiny config's three, window 5) in rings of
// window - 1 + span rows a slot: a crop back by the span is kept, one further fails.
TEST(KVCache, WindowRingsKeepCropsWithinTheirSpan) {
  auto config = testing::tiny_target_config(models::Architecture::kGptOss);
  auto model = TargetModel::random(config, at::kCPU, at::kFloat, 1);
  auto kv = model.make_cache(2, 32, /*window_span=*/2);
  EXPECT_EQ(kv.ring_window(), 5);
  EXPECT_EQ(kv.ring_rows(0), 6);
  EXPECT_EQ(kv.ring_rows(1), 0);
  EXPECT_EQ(kv.keys(0).size(0), 2 * 6 + 1);
  EXPECT_EQ(kv.keys(1).size(0), 2 * 32);
  model.forward_cached(at::zeros({10}, at::kLong), AppendBatch::make(kv, {1}, {10}), kv, {});
  kv.crop(1, 8);
  EXPECT_THROW(kv.crop(1, 7), Error);
  kv.reset(1);
  // A ring no smaller than the capacity is not made.
  EXPECT_FALSE(model.make_cache(1, 6, 2).has_rings());
  EXPECT_FALSE(model.make_cache(1, 32, 0).has_rings());
}

}  // namespace
}  // namespace dflash
