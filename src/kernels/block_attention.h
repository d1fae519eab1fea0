// block_attention: attention of a few new tokens per sequence (a verify or draft block of at
// most 16 tokens, or one decode token) over their sequences' cached keys. Flash's tiles hold
// 128 query rows: a 16-token block leaves most of each tile idle while one thread block per head
// walks the keys in turn (about 14.5 us a layer at 16 queries over 272 keys, heads of 64, on an
// H100). Here a thread block serves one (sequence, query head) with the block's rows as one
// 16-row tensor-core tile, eight warps splitting the keys in 16-key tiles (each with its own
// running softmax) and merging at the end: 7.5 us there, and the one-token decode step's
// attention faster than flash's split-KV kernel and its combine. It rounds as flash does: fp32
// scores and sums, the probabilities rounded to the inputs' dtype before they weigh the values.
// CUDA in bf16/fp16 with heads of 32 or 64 (block_attention_serves). Heads of 128 over the
// hundreds of keys of an 8B target's context walk too many tiles per warp this way (Qwen3-8B
// shape, 768 keys: the plain step 5.81 ms with flash, 6.32 ms with this kernel), and splitting
// those keys further over a thread-block cluster did not close it (25.0 us against flash's 23.1
// at 16 queries over 528 keys; removed, docs/DECODING.md). Heads of 128 therefore take a second
// kernel (block_attention_split.cu): one thread block per (entry, KV head, split of the keys)
// holding all of that KV head's query rows, G per token (64 rows: 16 tokens of 4 query heads
// per KV head), so each key is read once per KV head rather than once per query head, the keys
// split over enough blocks to fill the SMs and the splits merged by a second launch. At the
// Qwen3-8B shape (H100, 528 keys) 12.9 us at 16 queries against flash's 22.9, 9.9 at one query
// against 10.0 (docs/DECODING.md). attention_with_lse (models/kv_cache.h) and flash are the
// references in the GPU tests.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

inline constexpr int64_t kBlockAttentionMaxRows = 16;
// The most splits of the keys at heads of 128 (the merge holds one split per lane of a warp).
inline constexpr int64_t kBlockAttentionMaxSplits = 32;

// Whether block_attention serves heads of `head_dim` in `dtype` on `device` in blocks of at
// most `max_count` tokens; block_attention_fits: queries q [T, Hq, D] over a cache's keys k
// [rows, Hkv, D] too.
bool block_attention_serves(at::Device device, at::ScalarType dtype, int64_t head_dim,
                            int64_t max_count);
bool block_attention_fits(const at::Tensor& q, const at::Tensor& k, int64_t max_count);

// Whether heads of 128 are served too (on by default); process-wide so that `bench-decode
// --no-block-attention-128` compares it with flash in one process.
bool block_attention_wide_heads();
void set_block_attention_wide_heads(bool on);

// q: [T, Hq, D], entry i's queries at rows cu_seqlens[i] .. cu_seqlens[i + 1] (int32 [n + 1]);
// k, v: [rows, Hkv, D], entry i's keys at rows key_starts[i] .. key_starts[i] + seen[i] (int32
// [>= n] each), its queries the last cu_seqlens[i + 1] - cu_seqlens[i] of them. Causal: query r
// of an entry with c queries sees keys j <= seen - c + r; otherwise every key before seen.
// Returns [T, Hq, D] in q's dtype. Scale 1 / sqrt(D). max_seen bounds seen (heads of 128 split
// the keys by it); `splits` > 0 sets their number (benches), 0 picks enough to fill the SMs.
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cu_seqlens, const at::Tensor& key_starts,
                           const at::Tensor& seen, bool causal, int64_t max_seen,
                           int64_t splits = 0);

}  // namespace dflash::kernels
