// Decoding the hybrid targets (Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next; CPU, fp32): the
// cached forward's conv and recurrent states against the prefill of the whole sequence (which
// TargetParity holds exact against transformers), in the recurrent form (decode steps, verify
// blocks, slots in and out of order) and the chunked one (prefill, continued from a state);
// the speculative pitfall: after a verify block of which only the first k drafts are right,
// the state is that of the accepted prefix only, for every k; Generator and SpeculativeDecoder
// give the plain greedy loop's tokens.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>
#include <span>

#include "common/error.h"
#include "decode_test_util.h"
#include "eval/generator.h"
#include "eval/speculative.h"
#include "models/kv_cache.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::AppendBatch;
using models::KVCache;
using models::Logits;
using models::PackedBatch;
using models::TargetModel;
using testing::fixture;

// The three architectures, as transformers wrote them (tests/python/fixtures_qwen35.py).
const std::vector<std::string> kFixtures = {"qwen3_5_multimodal", "qwen3_5_moe_text", "qwen3_next"};

TargetModel load(const std::string& name) {
  return TargetModel::load(fixture("qwen35/" + name), at::kCPU, at::kFloat);
}

// Every position's logits of the whole sequence in one prefill (on the CPU in fp32): the
// reference.
at::Tensor full_logits(const TargetModel& model, const std::vector<int64_t>& seq) {
  const auto n = static_cast<int64_t>(seq.size());
  return model
      .forward(at::tensor(seq, at::kLong).to(model.device()),
               PackedBatch::from_lengths({n}, model.device()), {{}, Logits::kAll})
      .logits.cpu()
      .to(at::kFloat);
}

// Appends tokens[s][pos[s] .. pos[s] + counts[i]) to slots[i] in one cached forward (`verify`:
// keeping block states) and checks the logits of the first `checked[i]` of them (all by
// default) against `ref[s]` within `tol`.
void append(const TargetModel& model, KVCache& cache,
            const std::vector<std::vector<int64_t>>& tokens, const std::vector<int64_t>& pos,
            const std::vector<int64_t>& slots, const std::vector<int64_t>& counts,
            const std::vector<at::Tensor>& ref, std::vector<int64_t> checked = {},
            double tol = 1e-4, bool verify = false) {
  if (checked.empty()) checked = counts;
  std::vector<int64_t> flat;
  for (size_t i = 0; i < slots.size(); ++i) {
    const auto& t = tokens[slots[i]];
    flat.insert(flat.end(), t.begin() + pos[slots[i]], t.begin() + pos[slots[i]] + counts[i]);
  }
  auto batch = AppendBatch::make(cache, slots, counts);
  auto logits =
      model
          .forward_cached(at::tensor(flat, at::kLong).to(model.device()), batch, cache,
                          {.tap_layers = {}, .logits = Logits::kAll, .keep_block_states = verify})
          .logits.cpu()
          .to(at::kFloat);
  int64_t row = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    SCOPED_TRACE("slot " + std::to_string(slots[i]) + " at " + std::to_string(pos[slots[i]]));
    EXPECT_CLOSE(logits.narrow(0, row, checked[i]),
                 ref[slots[i]].narrow(0, pos[slots[i]], checked[i]), tol);
    row += counts[i];
  }
}

// Prefill of two prompts (one longer than a delta-rule chunk) packed into slots 0 and 1, then
// decode steps of one token for both slots, one slot alone (gathered state), both out of order
// with three tokens each (the recurrent form over several tokens), a chunked continuation of
// unequal counts from the cached states, and one more step.
TEST(HybridDecode, CachedDecodeEqualsPrefillOfTheWholeSequence) {
  for (const auto& name : kFixtures) {
    SCOPED_TRACE(name);
    auto model = load(name);
    auto seqs = testing::random_prompts(model.config().vocab_size, {70 + 9, 9 + 9}, 11);
    std::vector<at::Tensor> ref = {full_logits(model, seqs[0]), full_logits(model, seqs[1])};
    KVCache cache(model.config(), 3, 96, at::kCPU, at::kFloat);
    std::vector<int64_t> pos = {0, 0};
    auto step = [&](const std::vector<int64_t>& slots, const std::vector<int64_t>& counts) {
      append(model, cache, seqs, pos, slots, counts, ref);
      for (size_t i = 0; i < slots.size(); ++i) pos[slots[i]] += counts[i];
    };
    step({0, 1}, {70, 9});
    step({0, 1}, {1, 1});
    step({1}, {1});
    step({1, 0}, {3, 3});
    step({0, 1}, {2, 1});
    step({0, 1}, {1, 1});
    EXPECT_EQ(pos, (std::vector<int64_t>{77, 16}));
    EXPECT_EQ(cache.length(0), 77);
    EXPECT_EQ(cache.length(1), 16);
    // A refilled slot starts from zero state: slot 1 again from its first token.
    cache.reset(1);
    pos[1] = 0;
    step({1}, {9});
    step({0, 1}, {1, 1});
  }
}

// Prefill of two prompts (6 and 11 tokens) into slots 0 and 1, two verify rounds of `block`
// tokens whose first right[i] + 1 are the true sequence's (slots in order: the block buffers
// written in place; out of order: gathered and scattered), each cropped to that accepted
// prefix, then a decode step; every logit fed right inputs is checked against `ref`, the
// prefill of the true sequences (each at least 11 + 2 * block + 1 tokens).
void verify_rounds(const TargetModel& model, int64_t block,
                   const std::vector<std::vector<int64_t>>& truth,
                   const std::vector<at::Tensor>& ref, const std::vector<int64_t>& right1,
                   const std::vector<int64_t>& right2, double tol) {
  const int64_t vocab = model.config().vocab_size;
  KVCache cache(model.config(), 2, 64, model.device(), model.dtype());
  cache.keep_block_states(block);
  std::vector<int64_t> pos = {0, 0};
  append(model, cache, truth, pos, {0, 1}, {6, 11}, ref, {}, tol);
  pos = {6, 11};
  auto verify = [&](const std::vector<int64_t>& slots, const std::vector<int64_t>& right) {
    // The blocks: the true tokens, the drafts after the first right[i] wrong.
    auto blocks = truth;
    std::vector<int64_t> checked;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto& b = blocks[slots[i]];
      for (int64_t j = right[i] + 1; j < block; ++j) {
        b[pos[slots[i]] + j] = (b[pos[slots[i]] + j] + 1) % vocab;
      }
      checked.push_back(right[i] + 1);
    }
    append(model, cache, blocks, pos, slots, std::vector<int64_t>(slots.size(), block), ref,
           checked, tol, /*verify=*/true);
    for (size_t i = 0; i < slots.size(); ++i) {
      EXPECT_EQ(cache.length(slots[i]), pos[slots[i]] + block);
      pos[slots[i]] += right[i] + 1;
      cache.crop(slots[i], pos[slots[i]]);
    }
  };
  verify({0, 1}, right1);
  verify({1, 0}, right2);
  append(model, cache, truth, pos, {0, 1}, {1, 1}, ref, {}, tol);
}

// verify_rounds for every k in 0..block-1: the first round's slots accept k and block-1-k
// drafts, the second's k+1 and k+2 (mod block), on random true sequences.
void verify_every_k(const TargetModel& model, int64_t block, double tol) {
  auto truth =
      testing::random_prompts(model.config().vocab_size, {6 + 3 * block, 11 + 3 * block}, 12);
  std::vector<at::Tensor> ref = {full_logits(model, truth[0]), full_logits(model, truth[1])};
  for (int64_t k = 0; k < block; ++k) {
    SCOPED_TRACE("drafts right: " + std::to_string(k));
    verify_rounds(model, block, truth, ref, {k, block - 1 - k}, {(k + 1) % block, (k + 2) % block},
                  tol);
  }
}

// The pitfall of speculative decoding on a recurrent target: a verify block [last token, B-1
// drafts] of which the first k drafts are right advances the state over all B tokens; after
// the crop to the accepted prefix the state must be the one after exactly those k + 1 tokens,
// or the next step's logits drift. Every k in 0..B-1, the two slots accepting different
// lengths in each round.
TEST(HybridDecode, VerifyKeepsTheStateOfTheAcceptedPrefixOnly) {
  for (const auto& name : kFixtures) {
    SCOPED_TRACE(name);
    verify_every_k(load(name), 4, 1e-4);
  }
}

// A hybrid slot's linear state goes back only within a verify block it holds: to any length
// from the block's start (the state before it, what bench-decode's passes take) to its end,
// once (the crop commits it); a block must be committed before the next forward; reset
// zeroes the state.
TEST(HybridDecode, CropsCommitAHeldBlockOnly) {
  auto model = load("qwen3_5_multimodal");
  KVCache cache(model.config(), 1, 32, at::kCPU, at::kFloat);
  cache.keep_block_states(4);
  EXPECT_EQ(cache.block_tokens(), 4);
  EXPECT_TRUE(cache.has_linear_state());
  auto run = [&](int64_t count, bool keep) {
    auto batch = AppendBatch::make(cache, {0}, {count});
    model.forward_cached(at::arange(count, at::kLong), batch, cache,
                         {.tap_layers = {}, .logits = Logits::kLast, .keep_block_states = keep});
  };
  auto state = [&] { return cache.linear_state(0).recurrent[0].clone(); };
  auto expect_error = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error, expected " << what;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), ::testing::HasSubstr(what));
    }
  };
  run(5, false);  // the chunked form: no block
  expect_error([&] { cache.crop(0, 4); }, "states for its last 0 only");
  const auto after5 = state();
  run(4, true);
  EXPECT_TRUE(cache.holds_block(0));
  EXPECT_TRUE(at::equal(state(), after5));  // the pre-block state until a crop commits
  expect_error([&] { run(1, false); }, "slot 0 holds an uncommitted verify block");
  expect_error([&] { cache.crop(0, 4); }, "states for its last 4 only");
  cache.crop(0, 5);  // the block's start
  EXPECT_FALSE(cache.holds_block(0));
  EXPECT_TRUE(at::equal(state(), after5));
  run(4, true);
  cache.crop(0, 7);
  EXPECT_FALSE(at::equal(state(), after5));
  expect_error([&] { cache.crop(0, 6); }, "states for its last 0 only");
  expect_error([&] { run(5, true); }, "equal blocks of at most 4 tokens");
  cache.reset(0);
  EXPECT_EQ(cache.length(0), 0);
  EXPECT_EQ(state().abs().sum().item<double>(), 0.0);
  EXPECT_THROW(cache.linear_state(1), Error);  // a full-attention layer (layers 1 and 4)
}

// Tiny peaked targets (clear greedy choices) of the three architectures: the presets and the
// Qwen3-Next fixture, untied (a tied random head repeats its input token).
std::vector<std::pair<std::string, TargetModel>> peaked_targets() {
  std::vector<std::pair<std::string, TargetModel>> out;
  for (const char* name : {"tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    auto c = models::preset_config(name);
    c.tie_word_embeddings = false;
    out.emplace_back(name, testing::peaked_target(c, at::kCPU, at::kFloat, 4));
  }
  auto next = load("qwen3_next");
  next.final_norm().mul_(30.0);
  out.emplace_back("qwen3_next", std::move(next));
  return out;
}

// Drafts the known greedy continuation of each slot's sequence right for exactly `right`
// tokens of every block, then wrong: every verify commits right + 1 tokens (but at the end).
class PrefixDrafter final : public eval::DraftSource {
 public:
  PrefixDrafter(int64_t block_size, std::vector<std::vector<int64_t>> references, int64_t right,
                int64_t vocab)
      : block_size_(block_size), references_(std::move(references)), right_(right), vocab_(vocab) {}
  int64_t block_size() const override { return block_size_; }
  std::vector<int64_t> tap_layers() const override { return {}; }
  void start(int64_t slots, int64_t) override { committed_.assign(slots, {}); }
  void reset(int64_t slot) override { committed_[slot].clear(); }
  void extend(const std::vector<int64_t>& slots,
              const std::vector<std::span<const int64_t>>& tokens, const at::Tensor&) override {
    for (size_t i = 0; i < slots.size(); ++i) {
      committed_[slots[i]].insert(committed_[slots[i]].end(), tokens[i].begin(), tokens[i].end());
    }
  }
  at::Tensor draft(const std::vector<int64_t>& slots, const std::vector<int64_t>& last) override {
    std::vector<int64_t> out;
    for (size_t i = 0; i < slots.size(); ++i) {
      auto seq = committed_[slots[i]];
      seq.push_back(last[i]);
      const auto& r = reference(seq);
      for (int64_t j = 0; j + 1 < block_size_; ++j) {
        const size_t p = seq.size() + j;
        const int64_t token = p < r.size() ? r[p] : 0;
        out.push_back(j < right_ ? token : (token + 1) % vocab_);
      }
    }
    return at::tensor(out, at::kLong).view({static_cast<int64_t>(slots.size()), block_size_ - 1});
  }

 private:
  const std::vector<int64_t>& reference(const std::vector<int64_t>& seq) const {
    for (const auto& r : references_) {
      if (r.size() >= seq.size() && std::equal(seq.begin(), seq.end(), r.begin())) return r;
    }
    ADD_FAILURE() << "a committed sequence left every greedy reference";
    return references_[0];
  }

  int64_t block_size_;
  std::vector<std::vector<int64_t>> references_;
  int64_t right_, vocab_;
  std::vector<std::vector<int64_t>> committed_;
};

// Generator (one token a step, several slots refilled) and SpeculativeDecoder with a drafter
// right for exactly k tokens a block, every k, equal the greedy loop over whole-sequence
// prefills; each verify commits k + 1 tokens except where a limit cuts it.
TEST(HybridDecode, GenerateAndSpeculativeEqualTheGreedyLoop) {
  constexpr int64_t kBlock = 4, kMaxNew = 11, kContext = 40;
  for (auto& [name, model] : peaked_targets()) {
    SCOPED_TRACE(name);
    const int64_t vocab = model.config().vocab_size;
    auto prompts = testing::random_prompts(vocab, {5, 12, 3, 30}, 13);
    std::vector<eval::Completion> want;
    std::vector<std::vector<int64_t>> refs;
    for (const auto& p : prompts) {
      want.push_back(testing::reference_greedy(model, p, kMaxNew, {}, kContext));
      refs.push_back(p);
      refs.back().insert(refs.back().end(), want.back().tokens.begin(), want.back().tokens.end());
    }
    // Not one token repeated: the continuations exercise the state.
    EXPECT_GT(std::set<int64_t>(want[0].tokens.begin(), want[0].tokens.end()).size(), 2u);
    eval::GenerationOptions g;
    g.max_new_tokens = kMaxNew;
    g.context = kContext;
    g.slots = 2;
    g.prefill_tokens = 8;
    testing::expect_same_completions(eval::Generator(model, g).generate(prompts), want);
    for (int64_t k = 0; k < kBlock; ++k) {
      SCOPED_TRACE("drafts right: " + std::to_string(k));
      PrefixDrafter drafter(kBlock, refs, k, vocab);
      eval::SpeculativeOptions o;
      o.max_new_tokens = kMaxNew;
      o.context = kContext;
      o.slots = 2;
      eval::SpeculativeDecoder decoder(model, drafter, o);
      eval::SpeculativeStats stats;
      testing::expect_same_completions(decoder.generate(prompts, &stats), want);
      EXPECT_GT(stats.committed[k + 1], 0);
      for (int64_t j = k + 2; j <= kBlock; ++j) EXPECT_EQ(stats.committed[j], 0) << j;
    }
  }
}

// On CUDA in bf16 (the GPU machine; skipped without one), heads of 128 so that the delta-rule
// step and conv step kernels run: the cached forward (decode steps, verify blocks cropped to
// every accepted length) against the bf16 prefill of the whole sequence, and the captured
// decode step (Generator) and verify pass (SpeculativeDecoder) against the eager ones.
class HybridDecodeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
  static TargetModel model(const char* preset, at::ScalarType dtype = at::kBFloat16) {
    auto c = models::preset_config(preset);
    c.linear = {2, 4, 128, 128, 4};
    c.head_dim = 128;
    c.tie_word_embeddings = false;
    return testing::peaked_target(c, at::kCUDA, dtype, 6);
  }
};

TEST_F(HybridDecodeGpu, CachedDecodeAndVerifyMatchPrefill) {
  // The MoE in fp32: in bf16 its random router's near-ties pick other experts in the recurrent
  // (decode) and chunked (prefill) forms for some tokens (measured on the H200: 0.07-0.16 off),
  // which says nothing about the state handling this test is for.
  verify_every_k(model("tiny-qwen3.5"), 8, 3e-2);
  verify_every_k(model("tiny-qwen3.5-moe", at::kFloat), 8, 1e-3);
}

TEST_F(HybridDecodeGpu, CapturedStepsEqualEager) {
  constexpr int64_t kBlock = 8, kMaxNew = 24;
  auto m = model("tiny-qwen3.5");
  auto prompts = testing::random_prompts(m.config().vocab_size, {5, 40, 17, 3, 9}, 22);
  eval::GenerationOptions g;
  g.max_new_tokens = kMaxNew;
  g.slots = 3;
  g.cuda_graph = false;
  const auto want = eval::Generator(m, g).generate(prompts);
  g.cuda_graph = true;
  eval::Generator captured(m, g);
  ASSERT_TRUE(captured.uses_cuda_graph());
  testing::expect_same_completions(captured.generate(prompts), want);
  std::vector<std::vector<int64_t>> refs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    refs.push_back(prompts[i]);
    refs.back().insert(refs.back().end(), want[i].tokens.begin(), want[i].tokens.end());
  }
  for (int64_t k : {int64_t{0}, int64_t{3}, kBlock - 1}) {
    SCOPED_TRACE("drafts right: " + std::to_string(k));
    for (bool graph : {false, true}) {
      PrefixDrafter drafter(kBlock, refs, k, m.config().vocab_size);
      eval::SpeculativeOptions o;
      o.max_new_tokens = kMaxNew;
      o.slots = 3;
      o.cuda_graph = graph;
      eval::SpeculativeDecoder decoder(m, drafter, o);
      EXPECT_EQ(decoder.uses_cuda_graph(), graph);
      testing::expect_same_completions(decoder.generate(prompts), want);
    }
  }
}

}  // namespace
}  // namespace dflash
