// kernel_bench: the attention of decode steps and speculative blocks over their cached keys
// (models::cached_causal_attention) at the GSM8K example target's heads (6 query heads of 64 over
// 2 KV heads), 272 keys a sequence, 1 or 16 sequences of 1 or 16 queries. kernels/block_attention
// against what it replaces: flash's varlen call (one 128-row tile per sequence) and flash's
// split-KV path (each query a one-query sequence, as AppendBatch's per-token tensors lay it out),
// both validated against the tile's output on the same inputs.
#include <fmt/format.h>

#include <vector>

#include "kernel_bench/bench.h"
#include "kernels/block_attention.h"

namespace dflash::kernel_bench {
namespace {

constexpr int64_t kQHeads = 6, kKvHeads = 2, kHeadDim = 64, kKeys = 272, kCapacity = 320;

void bench_case(const Bench& b, int64_t sequences, int64_t queries) {
  const auto ints = [&](const std::vector<int32_t>& v) {
    return at::tensor(v, at::kInt).to(b.device);
  };
  const int64_t total = sequences * queries;
  auto q = at::randn({total, kQHeads, kHeadDim}, b.opts);
  auto k = at::randn({sequences * kCapacity, kKvHeads, kHeadDim}, b.opts);
  auto v = at::randn_like(k);
  std::vector<int32_t> cu, starts, seen, token_cu, token_starts, token_seen;
  for (int64_t i = 0; i <= sequences; ++i) {
    cu.push_back(static_cast<int32_t>(i * queries));
    starts.push_back(static_cast<int32_t>(i * kCapacity));
    if (i == sequences) break;
    seen.push_back(static_cast<int32_t>(kKeys));
    for (int64_t j = 0; j < queries; ++j) {
      token_cu.push_back(static_cast<int32_t>(token_starts.size()));
      token_starts.push_back(static_cast<int32_t>(i * kCapacity));
      token_seen.push_back(static_cast<int32_t>(kKeys - queries + j + 1));  // causal
    }
  }
  token_cu.push_back(static_cast<int32_t>(total));
  token_starts.push_back(static_cast<int32_t>(sequences * kCapacity));
  const auto cu_d = ints(cu), starts_d = ints(starts), seen_d = ints(seen);
  const auto token_cu_d = ints(token_cu), token_starts_d = ints(token_starts),
             token_seen_d = ints(token_seen);
  auto ours = [&] {
    return kernels::block_attention(q, k, v, cu_d, starts_d, seen_d, /*causal=*/true);
  };
  auto tile = [&] {
    return std::get<0>(at::_flash_attention_forward(
        q, k, v, cu_d, starts_d, queries, kCapacity, 0.0, /*is_causal=*/true,
        /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt, seen_d));
  };
  auto per_token = [&] {
    return std::get<0>(at::_flash_attention_forward(
        q, k, v, token_cu_d, token_starts_d, 1, kCapacity, 0.0, /*is_causal=*/false,
        /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt, token_seen_d));
  };
  const auto want = tile();
  const std::string shape = fmt::format("{} x {} queries", sequences, queries);
  b.check("block_attention vs flash tile, " + shape, ours(), want, kRoundedFew);
  b.check("flash per-token vs flash tile, " + shape, per_token(), want, kRoundedFew);
  // Bytes: each sequence's keys and values once, the queries and the output.
  const double bytes = 2.0 * (2.0 * sequences * kKeys * kKvHeads * kHeadDim + 2.0 * q.numel());
  b.report("block_attention, " + shape, total, kKeys, kHeadDim, b.graph_us([&](int) { ours(); }),
           bytes);
  b.report("flash tile, " + shape, total, kKeys, kHeadDim, b.graph_us([&](int) { tile(); }), bytes);
  b.report("flash per-token, " + shape, total, kKeys, kHeadDim,
           b.graph_us([&](int) { per_token(); }), bytes);
}

}  // namespace

void bench_decode_attention(const Bench& b) {
  for (int64_t sequences : {1, 16}) {
    for (int64_t queries : {1, 16}) bench_case(b, sequences, queries);
  }
}

}  // namespace dflash::kernel_bench
