// kernel_bench: the attention of decode steps and speculative blocks over their cached keys
// (models::cached_causal_attention) at the GSM8K example target's heads (6 query heads of 64 over
// 2 KV heads, 272 keys a sequence) and Qwen3-8B's (32 of 128 over 8, 528 keys: bench-decode's
// 512 cached and a block), 1 or 16 sequences of 1 or 16 queries. kernels/block_attention (at
// heads of 128 its split kernel, block_attention_wide_heads, at its own number of splits and at
// 4, 8 and 16) against what it replaces: flash's
// varlen call (one 128-row tile per sequence) and flash's split-KV path (each query a one-query
// sequence, as AppendBatch's per-token tensors lay it out), both validated against the tile's
// output on the same inputs.
#include <fmt/format.h>

#include <vector>

#include "kernel_bench/bench.h"
#include "kernels/block_attention.h"

namespace dflash::kernel_bench {
namespace {

struct AttentionShape {
  const char* name;
  int64_t q_heads, kv_heads, head_dim, keys, capacity;
};

void bench_case(const Bench& b, const AttentionShape& s, int64_t sequences, int64_t queries) {
  const auto ints = [&](const std::vector<int32_t>& v) {
    return at::tensor(v, at::kInt).to(b.device);
  };
  const int64_t total = sequences * queries;
  auto q = at::randn({total, s.q_heads, s.head_dim}, b.opts);
  auto k = at::randn({sequences * s.capacity, s.kv_heads, s.head_dim}, b.opts);
  auto v = at::randn_like(k);
  std::vector<int32_t> cu, starts, seen, token_cu, token_starts, token_seen;
  for (int64_t i = 0; i <= sequences; ++i) {
    cu.push_back(static_cast<int32_t>(i * queries));
    starts.push_back(static_cast<int32_t>(i * s.capacity));
    if (i == sequences) break;
    seen.push_back(static_cast<int32_t>(s.keys));
    for (int64_t j = 0; j < queries; ++j) {
      token_cu.push_back(static_cast<int32_t>(token_starts.size()));
      token_starts.push_back(static_cast<int32_t>(i * s.capacity));
      token_seen.push_back(static_cast<int32_t>(s.keys - queries + j + 1));  // causal
    }
  }
  token_cu.push_back(static_cast<int32_t>(total));
  token_starts.push_back(static_cast<int32_t>(sequences * s.capacity));
  const auto cu_d = ints(cu), starts_d = ints(starts), seen_d = ints(seen);
  const auto token_cu_d = ints(token_cu), token_starts_d = ints(token_starts),
             token_seen_d = ints(token_seen);
  auto ours = [&](int64_t splits = 0) {
    return kernels::block_attention(q, k, v, cu_d, starts_d, seen_d, /*causal=*/true, s.keys,
                                    splits);
  };
  auto tile = [&] {
    return std::get<0>(at::_flash_attention_forward(
        q, k, v, cu_d, starts_d, queries, s.capacity, 0.0, /*is_causal=*/true,
        /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt, seen_d));
  };
  auto per_token = [&] {
    return std::get<0>(at::_flash_attention_forward(
        q, k, v, token_cu_d, token_starts_d, 1, s.capacity, 0.0, /*is_causal=*/false,
        /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt, token_seen_d));
  };
  const auto want = tile();
  const std::string shape = fmt::format("{}, {} x {} queries", s.name, sequences, queries);
  b.check("block_attention vs flash tile, " + shape, ours(), want, kRoundedFew);
  b.check("flash per-token vs flash tile, " + shape, per_token(), want, kRoundedFew);
  // Bytes: each sequence's keys and values once, the queries and the output.
  const double bytes = 2.0 * (2.0 * sequences * s.keys * s.kv_heads * s.head_dim + 2.0 * q.numel());
  b.report("block_attention, " + shape, total, s.keys, s.head_dim, b.graph_us([&](int) { ours(); }),
           bytes);
  for (int64_t splits : {4, 8, 16}) {
    if (s.head_dim != 128) break;
    const std::string what = fmt::format("block_attention {} splits, {}", splits, shape);
    b.check(what + " vs flash tile", ours(splits), want, kRoundedFew);
    b.report(what, total, s.keys, s.head_dim, b.graph_us([&](int) { ours(splits); }), bytes);
  }
  b.report("flash tile, " + shape, total, s.keys, s.head_dim, b.graph_us([&](int) { tile(); }),
           bytes);
  b.report("flash per-token, " + shape, total, s.keys, s.head_dim,
           b.graph_us([&](int) { per_token(); }), bytes);
}

}  // namespace

void bench_decode_attention(const Bench& b) {
  const bool wide = kernels::block_attention_wide_heads();
  kernels::set_block_attention_wide_heads(true);
  for (const AttentionShape& s : {AttentionShape{"heads 6/2 x 64", 6, 2, 64, 272, 320},
                                  AttentionShape{"heads 32/8 x 128", 32, 8, 128, 528, 576}}) {
    for (int64_t sequences : {1, 16}) {
      for (int64_t queries : {1, 16}) bench_case(b, s, sequences, queries);
    }
  }
  kernels::set_block_attention_wide_heads(wide);
}

}  // namespace dflash::kernel_bench
