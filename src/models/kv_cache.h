// models: the target's key/value cache for incremental decoding. Memory is preallocated once
// for S sequence slots x `capacity` tokens per layer, so a decode step allocates nothing and
// has fixed shapes (what a CUDA graph needs); each slot's length lives on the host, which
// drives every shape and index. Cropping (rejected draft tokens) and refilling a slot with a
// new sequence only move that length: stale rows past it are never read.
// Hybrid targets' Gated DeltaNet layers keep no K/V rows but a fixed-size state per slot (see
// LinearState), which a crop can move back only within a verify block whose per-token states
// were kept.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "models/config.h"

namespace dflash::models {

// One Gated DeltaNet layer's decode state in a KVCache, views of its storage: per slot the
// conv state (the last W-1 inputs of the conv channels, in the compute dtype, zero-padded on
// the left), transformers' conv_states, and the recurrent state in fp32, its
// recurrent_states. A slot's state is the one after its `length` tokens (an empty slot's is
// zero), but for a block: with KVCache::keep_block_states, a forward of a block leaves the
// slot state as it was before the block and writes the states after each block token to the
// *_block buffers (index j: after its first j + 1 tokens), until a crop commits the one of the
// accepted length.
struct LinearState {
  at::Tensor conv;             // [slots, conv_dim, W-1], compute dtype
  at::Tensor recurrent;        // [slots, Hv, Dk, Dv] float32
  at::Tensor conv_block;       // [slots, B, conv_dim, W-1], or undefined
  at::Tensor recurrent_block;  // [slots, B, Hv, Dk, Dv] float32, or undefined
};

// Sliding-window layers (gpt-oss') kept as rings: layer i with windows[i] = W > 0 holds
// R = W - 1 + span rows a slot, the key at row offset o (KVCache::keys) in ring row o mod R,
// instead of `capacity` rows. That is every key a query can still see after an append that is
// cropped back by at most `span` tokens (a verify block: its size; plain decoding: 1), so a
// crop further back fails. A ring no smaller than the capacity is not made.
struct WindowRings {
  std::vector<int64_t> windows;  // per layer, 0: the whole slot; one W for all ring layers
  int64_t span = 0;              // 0: no rings
};

class KVCache {
 public:
  KVCache(const ModelConfig& config, int64_t slots, int64_t capacity, at::Device device,
          at::ScalarType dtype);
  // A tensor-parallel rank's cache (TargetModel::make_cache): `kv_heads` key/value heads a layer
  // and the rank's share `linear` of a hybrid's Gated DeltaNet heads, not config's.
  KVCache(const ModelConfig& config, int64_t kv_heads, const LinearAttentionShape& linear,
          int64_t slots, int64_t capacity, at::Device device, at::ScalarType dtype,
          const WindowRings& rings = {});

  int64_t slots() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t capacity() const { return capacity_; }
  int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }
  int64_t length(int64_t slot) const;
  const std::vector<int64_t>& lengths() const { return lengths_; }

  // Keeps the first `length` tokens of `slot` (at most its current length). For a hybrid slot
  // that holds a block (holds_block), this commits the linear state of `length` tokens, any
  // from the block's start to its end (a device copy from the block buffers, all layers at
  // once); otherwise the linear state cannot go back, so `length` must be the slot's length or
  // 0 (reset).
  void crop(int64_t slot, int64_t length);
  // Empties `slot` for a new sequence (a hybrid's linear state set to zero).
  void reset(int64_t slot) { crop(slot, 0); }
  // Counts `count` more tokens in `slot` once their K/V rows (and linear states) have been
  // written. extend_block: the linear states of these tokens went to the block buffers (a
  // forward in the recurrent form with block states kept), and the slot holds the block until
  // a crop commits it. Neither may follow a held block without a crop.
  void extend(int64_t slot, int64_t count);
  void extend_block(int64_t slot, int64_t count);
  bool holds_block(int64_t slot) const;

  // Hybrids: allocates the block buffers for blocks of up to `tokens` tokens (speculative
  // verify); a no-op for a cache without linear-attention layers.
  void keep_block_states(int64_t tokens);
  // Longest block whose per-token states are kept (0: none).
  int64_t block_tokens() const { return conv_block_.defined() ? conv_block_.size(2) : 0; }
  bool has_linear_state() const { return conv_.defined(); }
  // `layer`'s state; fails unless it is a linear-attention layer.
  LinearState linear_state(int64_t layer) const;

  // One layer's keys or values, [slots * capacity, Hkv, D]: token p of slot s is row
  // s * capacity + p (flash attention reads a slot as one varlen sequence starting there).
  // A linear-attention layer's are empty, [0, Hkv, D]. A ring layer's (ring_rows > 0) are
  // [slots * R + 1, Hkv, D]: row offset o of slot s at s * R + o mod R, the last row a sink for
  // the writes a ring cannot keep (WindowPlan).
  const at::Tensor& keys(int64_t layer) const { return keys_[layer]; }
  const at::Tensor& values(int64_t layer) const { return values_[layer]; }
  at::Device device() const { return device_; }
  // R of a ring layer, 0 for the others; the window its rows serve.
  int64_t ring_rows(int64_t layer) const { return ring_rows_[layer]; }
  int64_t ring_window() const { return ring_window_; }
  bool has_rings() const { return ring_window_ > 0; }
  // Writes k and v, [tokens, Hkv, D], at `rows` (int64 [tokens]) of `layer`: gpt-fast's
  // KVCache.update(input_pos, k, v) with slot and position folded into one row index; on CUDA
  // in bf16/fp16 one kernel (kernels::write_kv_rows), elsewhere index_copy_. A ring layer's rows
  // are WindowPlan::write_rows.
  void update(int64_t layer, const at::Tensor& rows, const at::Tensor& k, const at::Tensor& v);
  // Copies the K/V of rows `from` to rows `to` (int64 [n] each, on the cache's device; rows as
  // AppendBatch::rows counts them, mapped into the rings) in every attention layer, all sources
  // read before any is written: a tree verify's accepted path moved to the rows after its root.
  // Lengths stay; crop() then counts the path.
  void move_rows(const at::Tensor& from, const at::Tensor& to);

 private:
  void check_slot(int64_t slot, const char* what) const;
  void init_rings(const ModelConfig& config, const WindowRings& rings);
  void init_linear_state(const ModelConfig& config, const LinearAttentionShape& s,
                         at::TensorOptions opts);
  void rewind_linear_state(int64_t slot, int64_t length);

  at::Device device_;
  int64_t capacity_;
  std::vector<int64_t> lengths_;
  std::vector<at::Tensor> keys_, values_;
  // Rings: R per layer (0: plain), their window and span; per slot, the row offset its last
  // write reached (a crop may go back at most span from there).
  std::vector<int64_t> ring_rows_;
  int64_t ring_window_ = 0, ring_span_ = 0;
  std::vector<int64_t> written_;
  // Hybrids: each layer's index among the linear-attention layers (-1: full attention); their
  // states stacked, [linear layers, slots, ...] (one copy moves a slot's state in all layers);
  // per slot, the tokens of the block it holds (0: none).
  std::vector<int64_t> linear_index_;
  at::Tensor conv_, recurrent_, conv_block_, recurrent_block_;
  std::vector<int64_t> block_counts_;
};

// New tokens for several slots of a KVCache, packed end to end: entry i appends counts[i]
// tokens to slot slots[i] at positions [starts[i], starts[i] + counts[i]), where starts[i] is
// the slot's cached length. Each new token attends causally to its slot's cached prefix and
// the entry's new tokens before it. Host vectors drive shapes; device tensors feed kernels.
// A tree batch (make_tree: speculative tree verification) appends each entry's nodes of a token
// tree instead: node j goes to row start + j at position start + depth(j) and attends to the
// cached prefix and its own ancestors only.
struct AppendBatch {
  std::vector<int64_t> slots, counts, starts;
  int64_t total = 0;      // new tokens
  int64_t max_count = 0;  // longest entry in new tokens
  int64_t max_seen = 0;   // most keys any entry attends to (start + count)
  at::Tensor cu_seqlens;  // int32 [n+1], prefix sums of counts (the new tokens' packing)
  at::Tensor positions;   // int64 [total], absolute positions start..start+count-1
  at::Tensor rows;        // int64 [total], cache rows the new K/V go to
  at::Tensor key_starts;  // int32 [n+1], first cache row of each entry's slot (last: S*capacity)
  at::Tensor seen;        // int32 [n], start + count
  at::Tensor slot_ids;    // int64 [n], the entries' slots (caches with linear states only)
  // Tree batches: bool [total, max_count], row t (node j of entry i) true at column c when
  // node c of the same entry is node j or one of its ancestors; undefined for a causal batch.
  at::Tensor tree_mask;
  // Small blocks on CUDA (per_token_attention()): each new token as a one-query sequence of its
  // own, which flash runs through its split-KV decode kernel; as one tile per entry, a verify
  // or draft block's few queries leave most SMs idle while the tile walks the keys. A graph
  // that rewrites positions and seen in place rewrites token_seen and block_seen with them.
  at::Tensor token_cu;          // int32 [total+1]: 0..total
  at::Tensor token_key_starts;  // int32 [total+1]: each token's slot's first row (last: S*cap)
  at::Tensor token_seen;        // int32 [total]: position + 1, the causal mask
  at::Tensor block_seen;        // int32 [total]: the entry's start + count, both directions

  // Reads the slots' starts from `cache`; fails when a slot is repeated or would overflow.
  static AppendBatch make(const KVCache& cache, const std::vector<int64_t>& slots,
                          const std::vector<int64_t>& counts);
  // parents[i][j]: the parent of node j of entry i's tree, -1 for node 0 (the root) only, and
  // every other parent an earlier node (so counts[i] = parents[i].size()).
  static AppendBatch make_tree(const KVCache& cache, const std::vector<int64_t>& slots,
                               const std::vector<std::vector<int64_t>>& parents);
  bool is_tree() const { return tree_mask.defined(); }
  bool per_token_attention() const { return token_cu.defined() && !is_tree(); }
  int64_t size() const { return static_cast<int64_t>(slots.size()); }
};

// Batches of at most this many new tokens in all, in entries of 2 to 64, over heads of at least
// 128, take per-token attention (AppendBatch::token_*): where more tokens share a slot's keys,
// each reading them again costs more than the idle SMs; smaller heads walk the keys fast enough
// in one tile (docs/DECODING.md). A process-wide setting so that
// `bench-decode --per-token-attention-max` can compare both in one process.
int64_t per_token_attention_max_tokens();
void set_per_token_attention_max_tokens(int64_t tokens);

// Whether entries of at most kernels::kBlockAttentionMaxRows new tokens (speculative blocks and
// plain decode steps) attend through kernels::block_attention where it serves (CUDA, half
// precision, heads of 32 or 64; no window, no tree) rather than flash. On by default;
// process-wide so that `bench-decode --no-block-attention` can compare both in one process.
bool block_attention_kernel();
void set_block_attention_kernel(bool on);

// Per-token attention with group-major queries: flash's decode path regroups a token's query
// heads by KV head (a copy of q, two of the output); a q written group-major by the kernel that
// rotates it (kernels::qk_norm_rotary_into_cache: query head kv * G + g at g * Hkv + kv, G =
// Hq / Hkv) is attended as G-row sequences over Hkv heads with one copy of the output back to
// head order. On by default (the Qwen3-8B verify pass 0.25 ms faster eager, the captured step
// 0.09 ms, H100); process-wide so that `bench-decode --no-group-major-queries` compares both
// in one process.
bool group_major_queries();
void set_group_major_queries(bool on);

// Where a batch's per-token attention takes group-major queries of `dtype` (G = q_heads /
// kv_heads > 1, CUDA, half precision, the switch on): each token's first query row in that
// layout, int32 [total + 1] on the batch's device (one launch: token_cu * G); else undefined.
at::Tensor group_major_query_offsets(const AppendBatch& batch, int64_t q_heads, int64_t kv_heads,
                                     at::ScalarType dtype);

// How a batch meets a cache's rings, made once per forward from the batch's device tensors only
// (so a CUDA graph replays it for new positions). A ring layer's attention reads, per entry, a
// gathered copy laid out as [the slot's last P = W - 1 cached keys (fewer near the start)][the
// entry's new keys][unused rows up to P]: a long append (a prompt longer than the ring) then
// sees all its own keys, and flash reads each entry as one contiguous sequence.
struct WindowPlan {
  at::Tensor write_rows;  // int64 [total]: the new tokens' ring rows (the sink row for those
                          // older than the entry's last R, which no later query sees)
  at::Tensor prefix_src;  // int64 [n * P]: ring rows of each entry's cached prefix
  at::Tensor prefix_dst;  // int64 [n * P]: their rows in the gathered copy
  at::Tensor new_dst;     // int64 [total]: the new keys' rows in the gathered copy
  at::Tensor cu_keys;     // int32 [n + 1]: each entry's first gathered row (i * P + cu_seqlens)
  at::Tensor seen_keys;   // int32 [n]: its gathered keys, min(start, P) + count
  int64_t rows = 0;       // gathered rows, n * P + total
  int64_t max_keys = 0;   // most gathered keys of an entry (a bound for flash)

  static WindowPlan make(const KVCache& cache, const AppendBatch& batch);
  // The gathered keys and values of a ring layer: its prefix rows and the batch's new k / v
  // ([total, Hkv, D]); read before the new rows are written (a long append's writes wrap over
  // the prefix it still reads).
  std::pair<at::Tensor, at::Tensor> gather(const KVCache& cache, int64_t layer, const at::Tensor& k,
                                           const at::Tensor& v) const;
};

// The keys the new tokens of entry i of `batch` (rows offset.. of the packed batch) may see,
// bool [counts[i], starts[i] + counts[i]]: the slot's cached prefix and the entry's tokens up
// to their own position, or along their own branch in a tree batch; with `window` > 0 only
// keys within `window` positions. Attention paths that cannot take the batch's shape in a
// fused kernel (other devices and dtypes, tree batches) mask with it.
at::Tensor entry_mask(const AppendBatch& batch, int64_t i, int64_t offset, int64_t window);

// Softmax attention of queries [..., L, Hq, D] over keys and values [..., K, Hkv, D] (grouped)
// where `mask` (bool, broadcast to [..., Hq, L, K]; undefined: every key) allows, computed as
// flash attention computes a tile (fp32 scores and sums, the probabilities rounded to q's
// dtype before they weight the values): {out [..., L, Hq, D] in q's dtype, lse fp32
// [..., Hq, L]}. The masked paths' arithmetic (tree parts, gpt-oss' cached sink attention off
// flash), which must round as the flash decode steps do: speculative output must equal greedy.
std::pair<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const at::Tensor& mask = {});

// Flash attention's window_size_left for a window of `window` keys (0: none): flash keeps keys
// j with p - left <= j <= p for the query at p, so `window` keys is left = window - 1.
inline std::optional<int64_t> flash_window_left(int64_t window) {
  if (window > 0) return window - 1;
  return std::nullopt;
}

// Attention of the batch's new queries, q [total, Hq, D], over their slots' keys and values
// in `layer` of `cache` (the new tokens' rows already written), causal and grouped-query.
// On CUDA in bf16/fp16 one variable-length flash-attention call reads the cache in place
// (cu_seqlens_k = each slot's first row, seqused_k = start + count; flash aligns the causal
// mask to the end of the keys; small blocks as one-query sequences, AppendBatch::token_*);
// elsewhere one masked scaled_dot_product_attention per entry.
// `window` > 0: a query at position p sees only keys j > p - window (flash's own window).
// `group_major_offsets` (group_major_query_offsets; undefined: q head-major): q's heads are in
// group-major order and the batch takes the per-token path.
at::Tensor cached_causal_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                   const AppendBatch& batch, int64_t window = 0,
                                   const at::Tensor& group_major_offsets = {});

// The same without the causal mask: every new query of an entry sees all its slot's keys up to
// start + count, its entry's new tokens in both directions (the DFlash drafter's block).
at::Tensor cached_block_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                  const AppendBatch& batch,
                                  const at::Tensor& group_major_offsets = {});

}  // namespace dflash::models
