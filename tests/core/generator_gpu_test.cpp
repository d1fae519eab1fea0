// Decoding on CUDA (run on the GPU machine; skipped where there is no GPU): the cached forward
// through varlen flash attention with seqused_k against the packed forward, and the generator's
// captured decode step (CUDA graph) against the eager one.
#include <gtest/gtest.h>

#include <algorithm>

#include "decode_test_util.h"
#include "eval/generator.h"
#include "eval/prefill_graph.h"
#include "kernels/block_attention.h"
#include "models/kv_cache.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using eval::GenerationOptions;
using eval::Generator;
using models::AppendBatch;
using models::KVCache;
using models::Logits;
using models::PackedBatch;

class DecodeGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
    // Flash attention's shapes: head_dim 32, GQA 4/2.
    config_ = testing::tiny_target_config(models::Architecture::kQwen3);
    config_.hidden_size = 128;
    config_.intermediate_size = 256;
    config_.head_dim = 32;
  }
  std::vector<std::vector<int64_t>> prompts(const std::vector<int64_t>& lengths) const {
    auto gen = models::seeded_generator(at::kCPU, 5);
    std::vector<std::vector<int64_t>> out;
    for (int64_t n : lengths) {
      auto t = at::randint(config_.vocab_size, {n}, gen, at::kLong);
      out.emplace_back(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
    }
    return out;
  }
  models::ModelConfig config_;
};

TEST_F(DecodeGpu, CachedForwardMatchesPackedForward) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // fp32 takes the per-entry SDPA path, bf16 the flash path; both against the packed forward
    // in the same dtype (bf16: within its rounding).
    const double tol = dtype == at::kFloat ? 1e-5 : 2e-2;
    auto model = testing::peaked_target(config_, at::kCUDA, dtype, 1);
    auto seqs = prompts({13, 6, 9});
    std::vector<at::Tensor> ts;
    for (const auto& s : seqs) ts.push_back(at::tensor(s, at::kLong));
    auto all = at::cat(ts).to(at::kCUDA);
    const models::ForwardRequest request{{0, 2}, Logits::kAll};
    auto want = model.forward(all, PackedBatch::from_lengths({13, 6, 9}, at::kCUDA), request);
    KVCache cache(config_, 4, 16, at::kCUDA, dtype);
    // Prefill of different lengths into slots 3, 0, 1, then decode steps of one token each.
    const std::vector<int64_t> slots = {3, 0, 1}, offsets = {0, 13, 19}, prefill = {8, 2, 9};
    std::vector<at::Tensor> chunks;
    for (int i = 0; i < 3; ++i) chunks.push_back(all.narrow(0, offsets[i], prefill[i]));
    auto first = model.forward_cached(at::cat(chunks), AppendBatch::make(cache, slots, prefill),
                                      cache, request);
    EXPECT_CLOSE(first.logits.narrow(0, 0, 8), want.logits.narrow(0, 0, 8), tol);
    EXPECT_CLOSE(first.taps[1].narrow(0, 10, 9), want.taps[1].narrow(0, 19, 9), tol);
    for (int64_t p = 8; p < 13; ++p) {
      // Sequence 0 continues one token a step; sequence 1 (positions 2..5) joins while it has
      // tokens left. rows: the tokens' rows in the packed reference.
      std::vector<int64_t> s = {3}, c = {1}, rows = {p};
      if (p - 6 < 6) {
        s.push_back(0);
        c.push_back(1);
        rows.push_back(13 + p - 6);
      }
      auto index = at::tensor(rows, at::kLong).to(at::kCUDA);
      auto out = model.forward_cached(all.index_select(0, index), AppendBatch::make(cache, s, c),
                                      cache, request);
      EXPECT_CLOSE(out.logits, want.logits.index_select(0, index), tol);
      EXPECT_CLOSE(out.taps[0], want.taps[0].index_select(0, index), tol);
    }
  }
}

// A prompt prefilled through a captured bucket (padded to 64 tokens) into slots other than the
// one it was captured on: the same logits, taps and cached keys as the eager prefill, and the
// pads' rows left past the slot's length.
TEST_F(DecodeGpu, PrefillGraphsMatchTheEagerPrefill) {
  auto model = testing::peaked_target(config_, at::kCUDA, at::kBFloat16, 1);
  ASSERT_TRUE(eval::PrefillGraphs::supported(model));
  KVCache eager(config_, 4, 128, at::kCUDA, at::kBFloat16);
  KVCache graphed(config_, 4, 128, at::kCUDA, at::kBFloat16);
  eval::PrefillGraphs graphs(model, graphed, {0, 1});
  EXPECT_FALSE(graphs.serves(0));
  EXPECT_TRUE(graphs.serves(64));
  EXPECT_TRUE(graphs.serves(65));    // a bucket of 128: a slot's rows
  EXPECT_FALSE(graphs.serves(129));  // 256 rows would exceed a slot
  // The first captures the 64 bucket on slot 1; the last the 128 bucket on slot 3 while the
  // other slots hold prompts, which its capture must leave as they are.
  const auto seqs = prompts({23, 40, 7, 70});
  const std::vector<int64_t> slots = {1, 0, 2, 3};
  for (size_t i = 0; i < seqs.size(); ++i) {
    SCOPED_TRACE("prompt " + std::to_string(i));
    const int64_t slot = slots[i], n = std::ssize(seqs[i]);
    auto want =
        model.forward_cached(at::tensor(seqs[i], at::kLong).to(at::kCUDA),
                             AppendBatch::make(eager, {slot}, {n}), eager, {{0, 1}, Logits::kLast});
    auto got = graphs.run(slot, seqs[i]);
    EXPECT_EQ(graphed.length(slot), n);
    EXPECT_CLOSE(got.logits, want.logits, 2e-2);
    EXPECT_CLOSE(got.features, at::cat(want.taps, 1), 2e-2);
    for (int64_t layer = 0; layer < config_.num_layers; ++layer) {
      EXPECT_CLOSE(graphed.keys(layer).narrow(0, slot * 128, n),
                   eager.keys(layer).narrow(0, slot * 128, n), 2e-2);
      EXPECT_CLOSE(graphed.values(layer).narrow(0, slot * 128, n),
                   eager.values(layer).narrow(0, slot * 128, n), 2e-2);
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    SCOPED_TRACE("slot " + std::to_string(slots[i]) + " after every prefill");
    const int64_t first = slots[i] * 128, n = std::ssize(seqs[i]);
    for (int64_t layer = 0; layer < config_.num_layers; ++layer) {
      EXPECT_CLOSE(graphed.keys(layer).narrow(0, first, n), eager.keys(layer).narrow(0, first, n),
                   2e-2);
    }
  }
  EXPECT_THROW(graphs.run(1, seqs[0]), Error);  // slot 1 is not empty
}

TEST_F(DecodeGpu, GraphDecodeMatchesEagerWithRefill) {
  auto model = testing::peaked_target(config_, at::kCUDA, at::kBFloat16, 2);
  auto ps = prompts({5, 17, 3, 9, 30, 2, 12});
  GenerationOptions o;
  o.slots = 3;
  o.max_new_tokens = 20;
  o.context = 40;  // the 30-token prompt stops at the context limit
  o.cuda_graph = false;
  auto eager = Generator(model, o).generate(ps);
  o.cuda_graph = true;
  Generator graph(model, o);
  ASSERT_TRUE(graph.uses_cuda_graph());
  auto got = graph.generate(ps);
  ASSERT_EQ(got.size(), eager.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, eager[i].tokens) << "prompt " << i;
    EXPECT_EQ(got[i].finish, eager[i].finish) << "prompt " << i;
  }
  // Replaying again from a fresh start gives the same (the graph holds no stale state).
  auto again = graph.generate(ps);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(again[i].tokens, got[i].tokens);
  // Stop tokens: the first token of the first prompt's output not seen earlier in it (after the
  // first) ends the output there.
  const auto& first = got[0].tokens;
  size_t k = 1;
  while (k < first.size() && std::count(first.begin(), first.begin() + k, first[k]) > 0) ++k;
  if (k == first.size()) k = 0;  // one repeated token: it stops the output at once
  o.stop_tokens = {first[k]};
  auto stopped = Generator(model, o).generate(ps);
  EXPECT_EQ(stopped[0].tokens, std::vector<int64_t>(first.begin(), first.begin() + k));
  EXPECT_EQ(stopped[0].finish, eval::Finish::kStop);
}

// Small blocks attend as one-query sequences (AppendBatch::token_*, flash's split-KV path; heads
// of 128; q head-major or group-major) or through kernels::block_attention (heads of 64, and of
// 128 with its split kernel, kernels::set_block_attention_wide_heads): the
// same logits, taps and block attention as flash's one tile per entry, over slots at different
// lengths.
TEST_F(DecodeGpu, SmallBlockAttentionPathsMatchFlashTiles) {
  struct Restore {
    int64_t limit = models::per_token_attention_max_tokens();
    bool block = models::block_attention_kernel();
    bool group_major = models::group_major_queries();
    bool wide = kernels::block_attention_wide_heads();
    ~Restore() {
      kernels::set_block_attention_wide_heads(wide);
      models::set_per_token_attention_max_tokens(limit);
      models::set_block_attention_kernel(block);
      models::set_group_major_queries(group_major);
    }
  } restore;
  for (int64_t head_dim : {128, 64}) {
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    config_.head_dim = head_dim;
    auto model = testing::peaked_target(config_, at::kCUDA, at::kBFloat16, 1);
    KVCache cache(config_, 3, 64, at::kCUDA, at::kBFloat16);
    auto seqs = prompts({21, 7, 16, 5});
    const std::vector<int64_t> slots = {2, 0};
    model.forward_cached(at::tensor(seqs[0], at::kLong).to(at::kCUDA),
                         AppendBatch::make(cache, {2}, {21}), cache, {});
    model.forward_cached(at::tensor(seqs[1], at::kLong).to(at::kCUDA),
                         AppendBatch::make(cache, {0}, {7}), cache, {});
    auto block =
        at::cat({at::tensor(seqs[2], at::kLong), at::tensor(seqs[3], at::kLong)}).to(at::kCUDA);
    const models::ForwardRequest request{{1}, Logits::kAll};
    auto gen = models::seeded_generator(at::kCUDA, 3);
    auto q = at::randn({21, config_.num_heads, config_.head_dim}, gen,
                       at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
    std::vector<models::ForwardResult> outs;
    std::vector<at::Tensor> both_ways;
    struct Path {
      const char* name;
      int64_t per_token_limit;
      bool block_kernel, group_major, wide_heads;
    };
    const std::vector<Path> paths = {{"flash tiles", 0, false, false, false},
                                     {"per token, q group-major", 64, false, true, false},
                                     {"per token, q head-major", 64, false, false, false},
                                     {"block kernel", 64, true, false, false},
                                     {"block kernel, heads of 128 too", 64, true, true, true}};
    for (const Path& p : paths) {
      models::set_per_token_attention_max_tokens(p.per_token_limit);
      models::set_block_attention_kernel(p.block_kernel);
      models::set_group_major_queries(p.group_major);
      kernels::set_block_attention_wide_heads(p.wide_heads);
      auto batch = AppendBatch::make(cache, slots, {16, 5});
      // The block kernel serves heads of 64, and of 128 with wide heads on; other blocks of
      // heads of 128 take per-token attention.
      const bool block_served = p.block_kernel && (head_dim < 128 || p.wide_heads);
      const bool per_token = p.per_token_limit > 0 && head_dim >= 128 && !block_served;
      EXPECT_EQ(batch.per_token_attention(), per_token) << p.name;
      const auto offsets = models::group_major_query_offsets(batch, config_.num_heads,
                                                             config_.num_kv_heads, at::kBFloat16);
      EXPECT_EQ(offsets.defined(), per_token && p.group_major) << p.name;
      outs.push_back(model.forward_cached(block, batch, cache, request));
      both_ways.push_back(models::cached_block_attention(q, cache, 1, batch));
      if (offsets.defined()) {
        // The attention alone, on q moved to group-major order, against the head-major call.
        const int64_t groups = config_.num_heads / config_.num_kv_heads;
        auto grouped = q.view({21, config_.num_kv_heads, groups, head_dim})
                           .transpose(1, 2)
                           .reshape({21, config_.num_heads, head_dim});
        EXPECT_CLOSE(models::cached_causal_attention(grouped, cache, 1, batch, 0, offsets),
                     models::cached_causal_attention(q, cache, 1, batch), 2e-2);
        EXPECT_CLOSE(models::cached_block_attention(grouped, cache, 1, batch, offsets),
                     models::cached_block_attention(q, cache, 1, batch), 2e-2);
      }
      cache.crop(2, 21);
      cache.crop(0, 7);
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      SCOPED_TRACE(paths[i].name);
      EXPECT_CLOSE(outs[i].logits, outs[0].logits, 2e-2);
      EXPECT_CLOSE(outs[i].taps[0], outs[0].taps[0], 2e-2);
      EXPECT_CLOSE(both_ways[i], both_ways[0], 2e-2);
    }
  }
}

TEST_F(DecodeGpu, SeededSamplingWithGraphMatchesEager) {
  auto model = models::TargetModel::random(config_, at::kCUDA, at::kBFloat16, 3);
  model.final_norm().mul_(3.0);  // a spread distribution with clear ranks
  auto ps = prompts({4, 8, 6, 2, 5});
  GenerationOptions o;
  // One slot: the graph runs every slot's row each step and eager decoding only the active
  // ones, and in bf16 one row (kernels::small_linear) and several (cuBLAS) round differently,
  // enough to move a draw at a top-p boundary (2 slots against 5 matched on 3 of 5 prompts).
  o.slots = 1;
  o.max_new_tokens = 16;
  o.sampling = {0.8, 0.9, 20, 42};
  o.cuda_graph = true;
  auto a = Generator(model, o).generate(ps);
  o.cuda_graph = false;
  auto b = Generator(model, o).generate(ps);
  int same = 0;
  for (size_t i = 0; i < a.size(); ++i) same += a[i].tokens == b[i].tokens;
  EXPECT_EQ(same, static_cast<int>(a.size()));
}

}  // namespace
}  // namespace dflash
