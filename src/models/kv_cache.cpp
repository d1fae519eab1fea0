#include "models/kv_cache.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "common/error.h"
#include "common/upload.h"
#include "kernels/attention_merge.h"
#include "kernels/block_attention.h"
#include "kernels/decode_ops.h"

namespace dflash::models {

KVCache::KVCache(const ModelConfig& config, int64_t slots, int64_t capacity, at::Device device,
                 at::ScalarType dtype)
    : KVCache(config, config.num_kv_heads, config.linear, slots, capacity, device, dtype) {}

KVCache::KVCache(const ModelConfig& config, int64_t kv_heads, const LinearAttentionShape& linear,
                 int64_t slots, int64_t capacity, at::Device device, at::ScalarType dtype,
                 const WindowRings& rings)
    : device_(device),
      capacity_(capacity),
      lengths_(std::max<int64_t>(slots, 0), 0),
      ring_rows_(config.num_layers, 0),
      written_(std::max<int64_t>(slots, 0), 0) {
  // Rows are int32 in flash attention's cu_seqlens_k.
  if (slots <= 0 || capacity <= 0 || slots * capacity > std::numeric_limits<int32_t>::max()) {
    fail("kv cache: slots ({}) and capacity ({}) must be positive with a product below 2^31", slots,
         capacity);
  }
  if (rings.span > 0) init_rings(config, rings);
  auto opts = at::TensorOptions().device(device).dtype(dtype);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    // A linear-attention layer keeps no K/V rows (its state: init_linear_state).
    int64_t rows = config.is_linear_layer(i) ? 0 : slots * capacity;
    if (ring_rows_[i] > 0) rows = slots * ring_rows_[i] + 1;
    keys_.push_back(at::zeros({rows, kv_heads, config.head_dim}, opts));
    values_.push_back(at::zeros_like(keys_.back()));
  }
  init_linear_state(config, linear, opts);
}

void KVCache::init_rings(const ModelConfig& config, const WindowRings& rings) {
  if (static_cast<int64_t>(rings.windows.size()) != config.num_layers) {
    fail("kv cache: window rings for {} layers, the model has {}", rings.windows.size(),
         config.num_layers);
  }
  for (int64_t i = 0; i < config.num_layers; ++i) {
    const int64_t w = rings.windows[i];
    if (w <= 0 || config.is_linear_layer(i)) continue;
    if (ring_window_ != 0 && w != ring_window_) {
      fail("kv cache: window rings of {} and {} keys (one window size only)", ring_window_, w);
    }
    const int64_t r = w - 1 + rings.span;
    if (r >= capacity_) continue;  // the plain layout is no larger
    ring_window_ = w;
    ring_rows_[i] = r;
  }
  ring_span_ = rings.span;
}

void KVCache::init_linear_state(const ModelConfig& config, const LinearAttentionShape& s,
                                at::TensorOptions opts) {
  int64_t count = 0;
  for (int64_t i = 0; i < config.num_layers; ++i) {
    linear_index_.push_back(config.is_linear_layer(i) ? count++ : -1);
  }
  if (count == 0) return;
  conv_ = at::zeros({count, slots(), s.conv_dim(), s.conv_kernel_dim - 1}, opts);
  recurrent_ = at::zeros({count, slots(), s.num_value_heads, s.key_head_dim, s.value_head_dim},
                         opts.dtype(at::kFloat));
  block_counts_.assign(slots(), 0);
}

void KVCache::keep_block_states(int64_t tokens) {
  if (!has_linear_state()) return;
  if (tokens <= 0) fail("kv cache: block states for {} tokens (need a positive number)", tokens);
  auto with_block = [&](const at::Tensor& t) {
    auto sizes = t.sizes().vec();
    sizes.insert(sizes.begin() + 2, tokens);
    return at::empty(sizes, t.options());
  };
  conv_block_ = with_block(conv_);
  recurrent_block_ = with_block(recurrent_);
}

LinearState KVCache::linear_state(int64_t layer) const {
  if (layer < 0 || layer >= num_layers() || linear_index_[layer] < 0) {
    fail("kv cache: layer {} is not a linear-attention layer", layer);
  }
  const int64_t i = linear_index_[layer];
  return {conv_[i], recurrent_[i], conv_block_.defined() ? conv_block_[i] : at::Tensor(),
          recurrent_block_.defined() ? recurrent_block_[i] : at::Tensor()};
}

void KVCache::rewind_linear_state(int64_t slot, int64_t length) {
  const int64_t back = lengths_[slot] - length, kept = block_counts_[slot];
  if (length == 0) {
    // Always, not only when the length changes: a CUDA graph replay may have run an idle slot.
    conv_.select(1, slot).zero_();
    recurrent_.select(1, slot).zero_();
    block_counts_[slot] = 0;
    return;
  }
  if (kept == 0 && back == 0) return;
  if (back > kept) {
    fail(
        "kv cache crop: slot {} holds {} tokens and linear-attention states for its last {} "
        "only; it cannot go back to {} tokens",
        slot, lengths_[slot], kept, length);
  }
  // The slot state is still the one before the block (back == kept: what is kept); block
  // entry j is the state after the block's first j + 1 tokens.
  if (back < kept) {
    const int64_t j = kept - 1 - back;
    conv_.select(1, slot).copy_(conv_block_.select(1, slot).select(1, j));
    recurrent_.select(1, slot).copy_(recurrent_block_.select(1, slot).select(1, j));
  }
  block_counts_[slot] = 0;
}

void KVCache::check_slot(int64_t slot, const char* what) const {
  if (slot < 0 || slot >= slots())
    fail("kv cache {}: slot {} is not in [0, {})", what, slot, slots());
}

int64_t KVCache::length(int64_t slot) const {
  check_slot(slot, "length");
  return lengths_[slot];
}

void KVCache::crop(int64_t slot, int64_t length) {
  check_slot(slot, "crop");
  if (length < 0 || length > lengths_[slot]) {
    fail("kv cache crop: slot {} holds {} tokens, cannot crop to {}", slot, lengths_[slot], length);
  }
  if (has_linear_state()) rewind_linear_state(slot, length);
  if (length == 0) {
    written_[slot] = 0;
  } else if (has_rings() && length < written_[slot] - ring_span_) {
    fail(
        "kv cache crop: slot {} wrote {} tokens and its window rings keep the keys of crops back "
        "by at most {} (WindowRings::span); cannot crop to {}",
        slot, written_[slot], ring_span_, length);
  }
  lengths_[slot] = length;
}

void KVCache::extend(int64_t slot, int64_t count) {
  check_slot(slot, "extend");
  if (count < 0 || lengths_[slot] + count > capacity_) {
    fail("kv cache extend: slot {} holds {} tokens, {} more exceed the capacity {}", slot,
         lengths_[slot], count, capacity_);
  }
  if (holds_block(slot)) {
    fail("kv cache extend: slot {} holds an uncommitted block (crop it to the accepted length)",
         slot);
  }
  lengths_[slot] += count;
  written_[slot] = lengths_[slot];
}

void KVCache::extend_block(int64_t slot, int64_t count) {
  extend(slot, count);
  if (!has_linear_state()) return;
  if (count > block_tokens()) {
    fail("kv cache extend: a block of {} tokens in slot {}, but block states are kept for {}",
         count, slot, block_tokens());
  }
  block_counts_[slot] = count;
}

bool KVCache::holds_block(int64_t slot) const {
  check_slot(slot, "holds_block");
  return has_linear_state() && block_counts_[slot] > 0;
}

void KVCache::update(int64_t layer, const at::Tensor& rows, const at::Tensor& k,
                     const at::Tensor& v) {
  kernels::write_kv_rows(keys_[layer], values_[layer], rows, k, v);
}

void KVCache::move_rows(const at::Tensor& from, const at::Tensor& to) {
  at::Tensor ring_from, ring_to;
  if (has_rings()) {
    const int64_t r = ring_window_ - 1 + ring_span_;  // every ring layer's
    auto ring = [&](const at::Tensor& rows) {
      return rows.div(capacity_, "floor") * r + rows.remainder(capacity_).remainder(r);
    };
    ring_from = ring(from);
    ring_to = ring(to);
  }
  for (int64_t layer = 0; layer < num_layers(); ++layer) {
    if (keys_[layer].size(0) == 0) continue;  // a linear-attention layer
    const bool in_ring = ring_rows_[layer] > 0;
    const at::Tensor& src = in_ring ? ring_from : from;
    const at::Tensor& dst = in_ring ? ring_to : to;
    keys_[layer].index_copy_(0, dst, keys_[layer].index_select(0, src));
    values_[layer].index_copy_(0, dst, values_[layer].index_select(0, src));
  }
}

namespace {

// AppendBatch::make, and make_tree's entries: a tree batch never attends per token, so it skips
// those uploads (`token_queries` false).
AppendBatch make_entries(const KVCache& cache, const std::vector<int64_t>& slots,
                         const std::vector<int64_t>& counts, bool token_queries) {
  if (slots.size() != counts.size() || slots.empty()) {
    fail("append batch: {} slots and {} counts (need the same positive number)", slots.size(),
         counts.size());
  }
  AppendBatch b;
  b.slots = slots;
  b.counts = counts;
  const int64_t cap = cache.capacity();
  std::vector<bool> used(cache.slots(), false);
  std::vector<int32_t> cu{0}, key_starts, seen;
  std::vector<int64_t> positions, rows;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t slot = slots[i], start = cache.length(slot), n = counts[i];
    if (used[slot]) fail("append batch: slot {} appears twice", slot);
    used[slot] = true;
    if (n <= 0 || start + n > cap) {
      fail("append batch: slot {} holds {} tokens; {} more must be positive and fit in {}", slot,
           start, n, cap);
    }
    b.starts.push_back(start);
    b.total += n;
    b.max_count = std::max(b.max_count, n);
    b.max_seen = std::max(b.max_seen, start + n);
    cu.push_back(static_cast<int32_t>(b.total));
    key_starts.push_back(static_cast<int32_t>(slot * cap));
    seen.push_back(static_cast<int32_t>(start + n));
    for (int64_t p = start; p < start + n; ++p) {
      positions.push_back(p);
      rows.push_back(slot * cap + p);
    }
  }
  key_starts.push_back(static_cast<int32_t>(cache.slots() * cap));
  const at::Device device = cache.device();
  b.cu_seqlens = upload_to(device, at::tensor(cu, at::kInt));
  b.positions = upload_to(device, at::tensor(positions, at::kLong));
  b.rows = upload_to(device, at::tensor(rows, at::kLong));
  b.key_starts = upload_to(device, at::tensor(key_starts, at::kInt));
  b.seen = upload_to(device, at::tensor(seen, at::kInt));
  // Only a hybrid's linear-attention states are indexed by slot.
  if (cache.has_linear_state()) b.slot_ids = upload_to(device, at::tensor(slots, at::kLong));
  // Heads of 64 (the GSM8K example's 16.5M target) walk a few hundred keys in one tile faster
  // than the split path's query and output copies and combine cost (H100, 256 cached keys: the
  // whole step 0.945 ms without, 1.083 with); heads of 128 (Qwen3-8B, 512 keys) gain.
  // Blocks that kernels::block_attention serves need none of the per-token tensors.
  const at::Tensor& keys = cache.keys(0);
  const bool block_kernel =
      block_attention_kernel() &&
      kernels::block_attention_serves(device, keys.scalar_type(), keys.size(2), b.max_count);
  if (token_queries && !block_kernel && device.is_cuda() && b.max_count > 1 && b.max_count <= 64 &&
      b.total <= per_token_attention_max_tokens() && keys.size(2) >= 128) {
    std::vector<int32_t> token_cu, token_starts, token_seen, block_seen;
    for (size_t i = 0; i < slots.size(); ++i) {
      for (int64_t j = 0; j < counts[i]; ++j) {
        token_cu.push_back(static_cast<int32_t>(token_starts.size()));
        token_starts.push_back(key_starts[i]);
        token_seen.push_back(static_cast<int32_t>(b.starts[i] + j + 1));
        block_seen.push_back(seen[i]);
      }
    }
    token_cu.push_back(static_cast<int32_t>(b.total));
    token_starts.push_back(key_starts.back());
    b.token_cu = upload_to(device, at::tensor(token_cu, at::kInt));
    b.token_key_starts = upload_to(device, at::tensor(token_starts, at::kInt));
    b.token_seen = upload_to(device, at::tensor(token_seen, at::kInt));
    b.block_seen = upload_to(device, at::tensor(block_seen, at::kInt));
  }
  return b;
}

std::atomic<int64_t> per_token_max_tokens{32};
std::atomic<bool> block_attention_on{true};
std::atomic<bool> group_major_on{true};

}  // namespace

AppendBatch AppendBatch::make(const KVCache& cache, const std::vector<int64_t>& slots,
                              const std::vector<int64_t>& counts) {
  return make_entries(cache, slots, counts, /*token_queries=*/true);
}

int64_t per_token_attention_max_tokens() { return per_token_max_tokens.load(); }
void set_per_token_attention_max_tokens(int64_t tokens) { per_token_max_tokens.store(tokens); }

bool block_attention_kernel() { return block_attention_on.load(); }
void set_block_attention_kernel(bool on) { block_attention_on.store(on); }

bool group_major_queries() { return group_major_on.load(); }
void set_group_major_queries(bool on) { group_major_on.store(on); }

at::Tensor group_major_query_offsets(const AppendBatch& batch, int64_t q_heads, int64_t kv_heads,
                                     at::ScalarType dtype) {
  const bool half = dtype == at::kBFloat16 || dtype == at::kHalf;
  if (!group_major_queries() || !batch.per_token_attention() || !batch.token_cu.is_cuda() ||
      !half || kv_heads <= 0 || q_heads <= kv_heads || q_heads % kv_heads != 0) {
    return {};
  }
  return batch.token_cu * static_cast<int32_t>(q_heads / kv_heads);
}

AppendBatch AppendBatch::make_tree(const KVCache& cache, const std::vector<int64_t>& slots,
                                   const std::vector<std::vector<int64_t>>& parents) {
  if (parents.size() != slots.size()) {
    fail("append batch: {} slots and {} trees (need one tree per slot)", slots.size(),
         parents.size());
  }
  std::vector<int64_t> counts;
  for (const auto& p : parents) counts.push_back(static_cast<int64_t>(p.size()));
  AppendBatch b = make_entries(cache, slots, counts, /*token_queries=*/false);
  std::vector<int64_t> positions;
  std::vector<uint8_t> mask(b.total * b.max_count, 0);
  int64_t row = 0;
  for (size_t i = 0; i < parents.size(); ++i) {
    const auto& p = parents[i];
    std::vector<int64_t> depth(p.size(), 0);
    for (size_t j = 0; j < p.size(); ++j, ++row) {
      const bool root = j == 0;
      if (root ? p[j] != -1 : (p[j] < 0 || p[j] >= static_cast<int64_t>(j))) {
        fail(
            "append batch: tree {} node {} has parent {} (the root's must be -1, every other "
            "node's an earlier node)",
            i, j, p[j]);
      }
      if (!root) depth[j] = depth[p[j]] + 1;
      positions.push_back(b.starts[i] + depth[j]);
      // Node j sees itself and, through its parent's row, every ancestor.
      uint8_t* r = mask.data() + row * b.max_count;
      if (!root) std::copy_n(mask.data() + (row - (j - p[j])) * b.max_count, b.max_count, r);
      r[j] = 1;
    }
  }
  const at::Device device = cache.device();
  b.positions = upload_to(device, at::tensor(positions, at::kLong));
  b.tree_mask = upload_to(
      device, at::from_blob(mask.data(), {b.total, b.max_count}, at::kByte).to(at::kBool));
  return b;
}

WindowPlan WindowPlan::make(const KVCache& cache, const AppendBatch& batch) {
  if (!cache.has_rings()) fail("window plan: the cache keeps no window rings");
  int64_t r = 0;
  for (int64_t i = 0; i < cache.num_layers() && r == 0; ++i) r = cache.ring_rows(i);
  const int64_t p = cache.ring_window() - 1, cap = cache.capacity(), n = batch.size();
  const auto longs = batch.positions.options();
  auto cu = batch.cu_seqlens.to(at::kLong);
  auto firsts = cu.narrow(0, 0, n);
  auto counts = cu.narrow(0, 1, n) - firsts;
  auto seen = batch.seen.to(at::kLong);
  auto starts = seen - counts;
  auto slot = batch.key_starts.narrow(0, 0, n).to(at::kLong).div(cap, "floor");
  auto kept = starts.clamp_max(p);
  WindowPlan plan;
  auto cu_keys = at::arange(n + 1, longs) * p + cu;
  auto base = cu_keys.narrow(0, 0, n);
  // Prefix key k of entry i: row offset start - kept + k, valid for k < kept; the others go to
  // the unused rows after the entry's new keys (their sources any ring row).
  auto k = at::arange(p, longs).unsqueeze(0);
  auto valid = k < kept.unsqueeze(1);
  auto offset = (starts - kept).unsqueeze(1) + k;
  plan.prefix_src = (slot.unsqueeze(1) * r + offset.remainder(r)).flatten();
  plan.prefix_dst = (base.unsqueeze(1) + k + at::where(valid, 0, counts.unsqueeze(1))).flatten();
  auto t = at::arange(batch.total, longs);
  auto entry = at::searchsorted(cu.narrow(0, 1, n), t, /*out_int32=*/false, /*right=*/true);
  plan.new_dst = (base + kept - firsts).index_select(0, entry) + t;
  // Row offsets, not positions: a tree's nodes sit at start + node.
  auto slot_of = slot.index_select(0, entry);
  auto row_offset = batch.rows - slot_of * cap;
  auto keep = row_offset >= (seen - r).index_select(0, entry);
  plan.write_rows = at::where(keep, slot_of * r + row_offset.remainder(r), cache.slots() * r);
  plan.cu_keys = cu_keys.to(at::kInt);
  plan.seen_keys = (kept + counts).to(at::kInt);
  plan.rows = n * p + batch.total;
  plan.max_keys = std::min(batch.max_seen, p + batch.max_count);
  return plan;
}

std::pair<at::Tensor, at::Tensor> WindowPlan::gather(const KVCache& cache, int64_t layer,
                                                     const at::Tensor& k,
                                                     const at::Tensor& v) const {
  if (cache.ring_rows(layer) == 0) fail("window plan: layer {} keeps no ring", layer);
  auto one = [&](const at::Tensor& ring, const at::Tensor& fresh) {
    auto out = at::empty({rows, fresh.size(1), fresh.size(2)}, fresh.options());
    out.index_copy_(0, prefix_dst, ring.index_select(0, prefix_src));
    out.index_copy_(0, new_dst, fresh);
    return out;
  };
  return {one(cache.keys(layer), k), one(cache.values(layer), v)};
}

at::Tensor entry_mask(const AppendBatch& batch, int64_t i, int64_t offset, int64_t window) {
  const int64_t n = batch.counts[i], start = batch.starts[i];
  const auto longs = batch.positions.options();
  auto query = batch.positions.narrow(0, offset, n);
  auto key = at::cat({at::arange(start, longs), query});
  auto mask = key.unsqueeze(0) <= query.unsqueeze(1);
  if (batch.is_tree()) {
    auto branch = batch.tree_mask.narrow(0, offset, n).narrow(1, 0, n);
    mask = at::cat({mask.narrow(1, 0, start), branch}, 1);
  }
  if (window > 0) mask = mask & (key.unsqueeze(0) > query.unsqueeze(1) - window);
  return mask;
}

std::pair<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const at::Tensor& mask) {
  const int64_t groups = q.size(-2) / k.size(-2);
  auto heads_first = [](const at::Tensor& t) { return t.to(at::kFloat).transpose(-3, -2); };
  auto qh = heads_first(q);                                // [..., Hq, L, D]
  auto kh = heads_first(k).repeat_interleave(groups, -3);  // [..., Hq, K, D]
  auto vh = heads_first(v).repeat_interleave(groups, -3);
  // Flash attention's arithmetic (one key tile): raw scores, their row maximum, probabilities
  // exp2((s - max) * scale * log2 e) in fp32 summed unrounded, but rounded to the inputs' dtype
  // before they weight the values. Verify passes that take this path and decode steps through
  // flash then round alike: with fp32 probabilities a bf16 target's near ties went the other
  // way often enough that tree verification left greedy output (gpt-oss on the H100/H200).
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  auto scores = at::matmul(qh, kh.transpose(-1, -2));
  if (mask.defined()) {
    scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity());
  }
  auto max = std::get<0>(scores.max(-1, /*keepdim=*/true));
  auto p = at::exp2((scores - max) * (scale * M_LOG2E));
  auto sum = p.sum(-1, /*keepdim=*/true);
  if (q.scalar_type() != at::kFloat) p = p.to(q.scalar_type()).to(at::kFloat);
  auto out = (at::matmul(p, vh) / sum).transpose(-3, -2);
  auto lse = (max * scale + at::log(sum)).squeeze(-1);
  return {out.to(q.scalar_type()), lse};
}

namespace {

// A tree batch whose entries all hold C nodes: attention over each slot's cached prefix (the
// keys before its tree, all visible: one variable-length flash call on CUDA in half precision,
// else per entry) and over its own tree (the nodes' K/V read back at the batch's rows, the
// scores [n, Hq, C, C] masked by tree_mask), merged by their log-sum-exps
// (kernels::attention_merge). The launches do not grow with the batch.
at::Tensor tree_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                          const AppendBatch& batch) {
  const at::Tensor& k = cache.keys(layer);
  const at::Tensor& v = cache.values(layer);
  const int64_t n = batch.size(), c = batch.max_count, hq = q.size(1), d = q.size(2);
  const int64_t hkv = k.size(1);
  auto prefix = batch.seen - static_cast<int32_t>(c);  // int32 [n]: each slot's start
  at::Tensor out_ctx, lse_ctx;
  if (q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf)) {
    auto r = at::_flash_attention_forward(
        q, k, v, batch.cu_seqlens, batch.key_starts, c, batch.max_seen, 0.0, /*is_causal=*/false,
        /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt, prefix);
    out_ctx = std::get<0>(r);
    lse_ctx = std::get<1>(r);
  } else {
    std::vector<at::Tensor> outs, lses;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t first = batch.slots[i] * cache.capacity(), start = batch.starts[i];
      auto [o, lse] = attention_with_lse(q.narrow(0, i * c, c), k.narrow(0, first, start),
                                         v.narrow(0, first, start));
      outs.push_back(o);
      lses.push_back(lse);
    }
    out_ctx = at::cat(outs, 0);
    lse_ctx = at::cat(lses, 1);
  }
  // The tree part, all entries at once: [n, C, Hq, D] queries against their trees' keys, every
  // node seeing at least itself.
  auto [out_blk, lse_blk] = attention_with_lse(
      q.reshape({n, c, hq, d}), k.index_select(0, batch.rows).view({n, c, hkv, d}),
      v.index_select(0, batch.rows).view({n, c, hkv, d}), batch.tree_mask.view({n, 1, c, c}));
  out_blk = out_blk.reshape({n * c, hq, d});
  lse_blk = lse_blk.permute({1, 0, 2}).reshape({hq, n * c});
  return kernels::attention_merge(out_ctx, lse_ctx.contiguous(), prefix, out_blk, lse_blk).first;
}

// The per-token path over group-major q (group_major_queries): token t's G query heads of KV
// head h are rows t * G .. t * G + G - 1 of head h in q viewed [total * G, Hkv, D], one
// sequence of flash's without grouping (seqlen_q G, as flash's decode path regroups them);
// `offsets` packs those sequences.
at::Tensor group_major_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const AppendBatch& batch, const at::Tensor& offsets, bool causal) {
  const int64_t t = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1), g = hq / hkv;
  auto out = std::get<0>(at::_flash_attention_forward(
      q.view({t * g, hkv, d}), k, v, offsets, batch.token_key_starts, g, batch.max_seen, 0.0,
      /*is_causal=*/false, /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt,
      causal ? batch.token_seen : batch.block_seen));
  return out.view({t, g, hkv, d}).transpose(1, 2).reshape({t, hq, d});
}

// `window` only with `causal`.
at::Tensor cached_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                            const AppendBatch& batch, bool causal, int64_t window,
                            const at::Tensor& group_major_offsets) {
  const at::Tensor& k = cache.keys(layer);
  const at::Tensor& v = cache.values(layer);
  if (cache.ring_rows(layer) > 0) {
    fail("attention: layer {} keeps a window ring, which only gpt-oss' attention reads", layer);
  }
  if (batch.is_tree() && !causal) fail("attention: a tree batch has no block (non-causal) form");
  if (batch.is_tree() && window == 0 &&
      std::all_of(batch.counts.begin(), batch.counts.end(),
                  [&](int64_t c) { return c == batch.max_count; })) {
    return tree_attention(q, cache, layer, batch);
  }
  const bool flash = q.is_cuda() && !batch.is_tree() &&
                     (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
  if (group_major_offsets.defined()) {
    if (!flash || window != 0 || !batch.per_token_attention() || q.size(1) % k.size(1) != 0) {
      fail("attention: group-major queries take only the per-token flash path (layer {})", layer);
    }
    return group_major_attention(q, k, v, batch, group_major_offsets, causal);
  }
  if (flash && window == 0 && block_attention_kernel() &&
      kernels::block_attention_fits(q, k, batch.max_count)) {
    return kernels::block_attention(q, k, v, batch.cu_seqlens, batch.key_starts, batch.seen, causal,
                                    batch.max_seen);
  }
  if (flash && window == 0 && batch.per_token_attention()) {
    // One query per sequence: flash folds a KV head's query heads into the rows and splits the
    // keys (its decode path); causal or not is then in seqused_k alone.
    auto out = at::_flash_attention_forward(
        q, k, v, batch.token_cu, batch.token_key_starts, 1, batch.max_seen, 0.0,
        /*is_causal=*/false, /*return_debug_mask=*/false, std::nullopt, std::nullopt, std::nullopt,
        causal ? batch.token_seen : batch.block_seen);
    return std::get<0>(out);
  }
  if (flash) {
    auto out = at::_flash_attention_forward(
        q, k, v, batch.cu_seqlens, batch.key_starts, batch.max_count, batch.max_seen, 0.0, causal,
        /*return_debug_mask=*/false, std::nullopt, flash_window_left(window),
        window > 0 ? std::optional<int64_t>(0) : std::nullopt, batch.seen);
    return std::get<0>(out);
  }
  std::vector<at::Tensor> outs;
  outs.reserve(batch.slots.size());
  int64_t offset = 0;
  for (int64_t i = 0; i < batch.size(); ++i) {
    const int64_t n = batch.counts[i], start = batch.starts[i], seen = start + n;
    // [L, H, D] -> [1, H, L, D]
    auto view = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
    auto keys = k.narrow(0, batch.slots[i] * cache.capacity(), seen);
    auto values = v.narrow(0, batch.slots[i] * cache.capacity(), seen);
    // SDPA's is_causal would align the mask to the first key instead of the last.
    std::optional<at::Tensor> mask;
    if (causal) mask = entry_mask(batch, i, offset, window);
    auto o = at::scaled_dot_product_attention(view(q.narrow(0, offset, n)), view(keys),
                                              view(values), mask, 0.0, /*is_causal=*/false,
                                              std::nullopt, /*enable_gqa=*/true);
    outs.push_back(o.squeeze(0).transpose(0, 1));
    offset += n;
  }
  return outs.size() == 1 ? outs[0].contiguous() : at::cat(outs, 0);
}

}  // namespace

at::Tensor cached_causal_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                   const AppendBatch& batch, int64_t window,
                                   const at::Tensor& group_major_offsets) {
  return cached_attention(q, cache, layer, batch, /*causal=*/true, window, group_major_offsets);
}

at::Tensor cached_block_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                  const AppendBatch& batch, const at::Tensor& group_major_offsets) {
  return cached_attention(q, cache, layer, batch, /*causal=*/false, /*window=*/0,
                          group_major_offsets);
}

}  // namespace dflash::models
