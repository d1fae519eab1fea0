// kernels::block_attention (a speculative step's small blocks over their cached keys) against
// attention_with_lse, the masked reference that rounds as flash does, entry by entry: blocks of
// 1 to 16 queries over 1 to 300 keys, causal and not, heads of 32, 64 and 128 (the last with
// the keys in 1, 3 and 8 splits and as many as fill the SMs, 1 to 8 query heads per KV head:
// one or two groups of 64 rows), grouped queries (1 to 8 per key head), entries at scattered
// cache rows. On CPU: it serves nothing and names what it cannot take.
#include "kernels/block_attention.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/error.h"
#include "models/kv_cache.h"
#include "models/layers.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

struct Shape {
  int64_t head_dim, q_heads, kv_heads;
};

TEST(BlockAttentionGpu, MatchesTheMaskedReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const bool wide = kernels::block_attention_wide_heads();
  kernels::set_block_attention_wide_heads(true);
  // (queries, keys) per entry; the keys include the entry's own queries.
  const std::vector<std::pair<int32_t, int32_t>> entries = {
      {16, 272}, {1, 1}, {5, 5}, {16, 16}, {3, 40}, {16, 300}, {7, 129}, {1, 64}};
  const int64_t capacity = 320;
  for (const Shape& s :
       {Shape{64, 6, 2}, Shape{64, 4, 1}, Shape{32, 4, 4}, Shape{64, 32, 8}, Shape{128, 32, 8},
        Shape{128, 4, 1}, Shape{128, 2, 1}, Shape{128, 8, 1}, Shape{128, 2, 2}}) {
    for (const auto& [causal, splits] : std::vector<std::pair<bool, int64_t>>{
             {true, 0}, {false, 0}, {true, 1}, {false, 3}, {true, 8}}) {
      if (s.head_dim != 128 && splits != 0) continue;
      SCOPED_TRACE(fmt::format("head_dim {}, heads {}/{}, causal {}, splits {}", s.head_dim,
                               s.q_heads, s.kv_heads, causal, splits));
      auto gen = models::seeded_generator(at::kCPU, 11);
      const auto n = static_cast<int64_t>(entries.size());
      std::vector<int32_t> cu = {0}, starts, seen;
      for (int64_t i = 0; i < n; ++i) {
        cu.push_back(cu.back() + entries[i].first);
        starts.push_back(static_cast<int32_t>(((i * 5) % n) * capacity));  // scattered slots
        seen.push_back(entries[i].second);
      }
      const int64_t total = cu.back();
      auto q = at::randn({total, s.q_heads, s.head_dim}, gen).to(at::kBFloat16);
      auto k = at::randn({n * capacity, s.kv_heads, s.head_dim}, gen).to(at::kBFloat16);
      auto v = at::randn({n * capacity, s.kv_heads, s.head_dim}, gen).to(at::kBFloat16);
      auto cuda_int = [](const std::vector<int32_t>& x) {
        return at::tensor(x, at::kInt).to(at::kCUDA);
      };
      auto got = kernels::block_attention(q.to(at::kCUDA), k.to(at::kCUDA), v.to(at::kCUDA),
                                          cuda_int(cu), cuda_int(starts), cuda_int(seen), causal,
                                          /*max_seen=*/300, splits)
                     .cpu();
      for (int64_t i = 0; i < n; ++i) {
        const int64_t c = entries[i].first, keys = entries[i].second;
        auto mask = at::ones({c, keys}, at::kBool);
        if (causal) mask = at::arange(keys).unsqueeze(0) <= (keys - c + at::arange(c)).unsqueeze(1);
        auto [want, lse] =
            models::attention_with_lse(q.narrow(0, cu[i], c), k.narrow(0, starts[i], keys),
                                       v.narrow(0, starts[i], keys), mask);
        SCOPED_TRACE(fmt::format("entry {}: {} queries over {} keys", i, c, keys));
        EXPECT_CLOSE(got.narrow(0, cu[i], c).to(at::kFloat), want.to(at::kFloat), 1e-2);
      }
    }
  }
  kernels::set_block_attention_wide_heads(wide);
}

TEST(BlockAttention, ServesCudaHalfPrecisionOnlyAndNamesTheRest) {
  auto q = at::zeros({4, 4, 64});
  auto k = at::zeros({32, 2, 64});
  EXPECT_FALSE(kernels::block_attention_fits(q, k, 4));
  EXPECT_FALSE(kernels::block_attention_serves(at::kCPU, at::kBFloat16, 64, 4));
  EXPECT_FALSE(kernels::block_attention_serves(at::kCUDA, at::kBFloat16, 96, 4));
  EXPECT_TRUE(kernels::block_attention_serves(at::kCUDA, at::kBFloat16, 128, 4));
  kernels::set_block_attention_wide_heads(false);
  EXPECT_FALSE(kernels::block_attention_serves(at::kCUDA, at::kBFloat16, 128, 4));
  kernels::set_block_attention_wide_heads(true);
  EXPECT_FALSE(kernels::block_attention_serves(at::kCUDA, at::kBFloat16, 64, 17));
  EXPECT_TRUE(kernels::block_attention_serves(at::kCUDA, at::kHalf, 64, 16));
  auto cu = at::tensor(std::vector<int32_t>{0, 4}, at::kInt);
  EXPECT_THROW(kernels::block_attention(q, k, k, cu, cu, cu, true, 4), Error);
  try {
    kernels::block_attention(q, k, k, cu, cu, cu, true, 4, kernels::kBlockAttentionMaxSplits + 1);
    ADD_FAILURE() << "33 splits accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("33 splits of the keys (0 to 32)"));
  }
}

}  // namespace
}  // namespace dflash
