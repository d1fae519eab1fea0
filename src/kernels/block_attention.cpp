#include "kernels/block_attention.h"

#include <ATen/ATen.h>

#include <atomic>

#include "common/error.h"

namespace dflash::kernels {

// block_attention.cu
void block_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& cu_seqlens, const at::Tensor& key_starts,
                          const at::Tensor& seen, bool causal, at::Tensor& out);
// block_attention_split.cu
void block_attention_split_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_seqlens, const at::Tensor& key_starts,
                                const at::Tensor& seen, bool causal, int64_t max_seen,
                                int64_t splits, at::Tensor& out);

namespace {

std::atomic<bool> wide_heads{true};

bool packed_heads(const at::Tensor& t) {
  return t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2);
}

}  // namespace

bool block_attention_serves(at::Device device, at::ScalarType dtype, int64_t head_dim,
                            int64_t max_count) {
  return device.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         (head_dim == 32 || head_dim == 64 || (head_dim == 128 && wide_heads.load())) &&
         max_count >= 1 && max_count <= kBlockAttentionMaxRows;
}

bool block_attention_fits(const at::Tensor& q, const at::Tensor& k, int64_t max_count) {
  return q.dim() == 3 && k.dim() == 3 &&
         block_attention_serves(q.device(), q.scalar_type(), q.size(2), max_count) &&
         k.scalar_type() == q.scalar_type() && k.size(2) == q.size(2) && k.size(1) > 0 &&
         q.size(1) % k.size(1) == 0;
}

bool block_attention_wide_heads() { return wide_heads.load(); }
void set_block_attention_wide_heads(bool on) { wide_heads.store(on); }

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cu_seqlens, const at::Tensor& key_starts,
                           const at::Tensor& seen, bool causal, int64_t max_seen, int64_t splits) {
  if (splits < 0 || splits > kBlockAttentionMaxSplits) {
    fail("block attention: {} splits of the keys (0 to {})", splits, kBlockAttentionMaxSplits);
  }
  if (!block_attention_fits(q, k, 1) || v.sizes() != k.sizes() || !packed_heads(k) ||
      !packed_heads(v) || k.stride(0) != v.stride(0)) {
    fail("block attention: q {} {} over k {} / v {} is not a CUDA half-precision shape it serves",
         q.sizes(), c10::toString(q.scalar_type()), k.sizes(), v.sizes());
  }
  const int64_t n = cu_seqlens.numel() - 1;
  for (const at::Tensor* t : {&cu_seqlens, &key_starts, &seen}) {
    if (t->scalar_type() != at::kInt || t->dim() != 1 || !t->is_contiguous() ||
        t->device() != q.device()) {
      fail(
          "block attention: cu_seqlens, key_starts and seen must be contiguous int32 vectors on {}",
          q.device().str());
    }
  }
  if (n < 1 || key_starts.numel() < n || seen.numel() < n) {
    fail("block attention: {} entries (cu_seqlens {}) but key_starts {} and seen {}", n,
         cu_seqlens.numel(), key_starts.numel(), seen.numel());
  }
  auto qc = q.contiguous();
  auto out = at::empty_like(qc);
  if (qc.size(0) == 0) return out;
  if (qc.size(2) == 128) {
    block_attention_split_cuda(qc, k, v, cu_seqlens, key_starts, seen, causal, max_seen, splits,
                               out);
  } else {
    block_attention_cuda(qc, k, v, cu_seqlens, key_starts, seen, causal, out);
  }
  return out;
}

}  // namespace dflash::kernels
