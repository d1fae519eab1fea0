// models: the target's key/value cache for incremental decoding. Memory is preallocated once
// for S sequence slots x `capacity` tokens per layer, so a decode step allocates nothing and
// has fixed shapes (what a CUDA graph needs); each slot's length lives on the host, which
// drives every shape and index. Cropping (rejected draft tokens) and refilling a slot with a
// new sequence only move that length: stale rows past it are never read.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "models/config.h"

namespace dflash::models {

class KVCache {
 public:
  KVCache(const ModelConfig& config, int64_t slots, int64_t capacity, at::Device device,
          at::ScalarType dtype);

  int64_t slots() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t capacity() const { return capacity_; }
  int64_t num_layers() const { return static_cast<int64_t>(keys_.size()); }
  int64_t length(int64_t slot) const;
  const std::vector<int64_t>& lengths() const { return lengths_; }

  // Keeps the first `length` tokens of `slot` (at most its current length).
  void crop(int64_t slot, int64_t length);
  // Empties `slot` for a new sequence.
  void reset(int64_t slot) { crop(slot, 0); }
  // Counts `count` more tokens in `slot` once their K/V rows have been written.
  void extend(int64_t slot, int64_t count);

  // One layer's keys or values, [slots * capacity, Hkv, D]: token p of slot s is row
  // s * capacity + p (flash attention reads a slot as one varlen sequence starting there).
  const at::Tensor& keys(int64_t layer) const { return keys_[layer]; }
  const at::Tensor& values(int64_t layer) const { return values_[layer]; }
  at::Device device() const { return device_; }
  // Writes k and v, [tokens, Hkv, D], at `rows` (int64 [tokens]) of `layer`: gpt-fast's
  // KVCache.update(input_pos, k, v) with slot and position folded into one row index; on CUDA
  // in bf16/fp16 one kernel (kernels::write_kv_rows), elsewhere index_copy_.
  void update(int64_t layer, const at::Tensor& rows, const at::Tensor& k, const at::Tensor& v);

 private:
  void check_slot(int64_t slot, const char* what) const;

  at::Device device_;
  int64_t capacity_;
  std::vector<int64_t> lengths_;
  std::vector<at::Tensor> keys_, values_;
};

// New tokens for several slots of a KVCache, packed end to end: entry i appends counts[i]
// tokens to slot slots[i] at positions [starts[i], starts[i] + counts[i]), where starts[i] is
// the slot's cached length. Each new token attends causally to its slot's cached prefix and
// the entry's new tokens before it. Host vectors drive shapes; device tensors feed kernels.
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

  // Reads the slots' starts from `cache`; fails when a slot is repeated or would overflow.
  static AppendBatch make(const KVCache& cache, const std::vector<int64_t>& slots,
                          const std::vector<int64_t>& counts);
  int64_t size() const { return static_cast<int64_t>(slots.size()); }
};

// Attention of the batch's new queries, q [total, Hq, D], over their slots' keys and values
// in `layer` of `cache` (the new tokens' rows already written), causal and grouped-query.
// On CUDA in bf16/fp16 one variable-length flash-attention call reads the cache in place
// (cu_seqlens_k = each slot's first row, seqused_k = start + count; flash aligns the causal
// mask to the end of the keys); elsewhere one masked scaled_dot_product_attention per entry.
at::Tensor cached_causal_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                   const AppendBatch& batch);

// The same without the causal mask: every new query of an entry sees all its slot's keys up to
// start + count, its entry's new tokens in both directions (the DFlash drafter's block).
at::Tensor cached_block_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                  const AppendBatch& batch);

}  // namespace dflash::models
