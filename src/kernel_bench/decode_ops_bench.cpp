// kernel_bench: kernels/decode_ops, the target's fused inference steps, against the ATen
// sequences each replaces in the target's layer: the residual add and the RMSNorm that reads
// it, the per-head q/k norms and rotary (at decode and at the prefill's 2048 tokens) and with
// them the decode step's writes into the KV cache, and the SwiGLU activation. Each validated
// against its fp32 ATen reference (kernels::*_reference) on the same inputs.
#include <fmt/format.h>

#include "kernel_bench/bench.h"
#include "kernels/decode_ops.h"
#include "kernels/rotary.h"
#include "models/layers.h"

namespace dflash::kernel_bench {

// At batch 1 (and --rows): the residual add and the RMSNorm that reads it.
void bench_add_rms_norm(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto norm = at::ones({h}, opts);
  for (int64_t m : b.o.rows) {
    auto x = at::randn({m, h}, opts), y = at::randn({m, h}, opts);
    const auto ours = kernels::add_rms_norm(x, y, norm, eps);
    const auto want = kernels::add_rms_norm_reference(x, y, norm, eps);
    b.check(fmt::format("add_rms_norm sum ({} rows)", m), ours.sum, want.sum, kBitwise);
    b.check(fmt::format("add_rms_norm normed ({} rows)", m), ours.normed, want.normed,
            kRoundedOnce);
    const double norm_bytes = 2.0 * (4 * m + 1) * h;  // read x, y, weight; write sum, normed
    b.report("add_rms_norm", m, h, 0,
             b.graph_us([&](int) { kernels::add_rms_norm(x, y, norm, eps); }), norm_bytes);
    b.report("at::add + rms_norm", m, h, 0,
             b.graph_us([&](int) { models::rms_norm(x + y, norm, eps); }), norm_bytes);
  }
}

namespace {

// qk_norm_rotary's q and k against the reference's on the same inputs.
void check_qk_norm_rotary(const Bench& b, const std::string& what, const at::Tensor& qkv,
                          const at::Tensor& head_norm, const at::Tensor& cos,
                          const at::Tensor& sin) {
  const models::ModelConfig& c = b.config;
  const double eps = c.rms_norm_eps;
  const auto [q, k] = kernels::qk_norm_rotary(qkv, c.num_heads, c.num_kv_heads, head_norm,
                                              head_norm, cos, sin, eps);
  const auto [q_want, k_want] = kernels::qk_norm_rotary_reference(
      qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos, sin, eps);
  b.check(what + " q", q, q_want, kRoundedOnce);
  b.check(what + " k", k, k_want, kRoundedOnce);
}

// The decode step's writes into a KV cache (Qwen3-8B's layer at a 4096-token capacity): the
// norm + rotary writing k and v against it followed by KVCache::update's two index_copy_, and
// that write alone. Validated on copies of the cache, against the references.
void bench_kv_cache_writes(const Bench& b, const at::Tensor& qkv, const at::Tensor& head_norm,
                           const at::Tensor& cos, const at::Tensor& sin) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto keys = at::zeros({4096, c.num_kv_heads, d}, opts), values = at::zeros_like(keys);
  auto cache_row = at::full({1}, 4000, opts.dtype(at::kLong));
  {
    auto k1 = keys.clone(), v1 = values.clone(), k2 = keys.clone(), v2 = values.clone();
    const auto q1 = kernels::qk_norm_rotary_into_cache(qkv, c.num_heads, c.num_kv_heads, head_norm,
                                                       head_norm, cos, sin, eps, k1, v1, cache_row);
    const auto q2 = kernels::qk_norm_rotary_into_cache_reference(
        qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos, sin, eps, k2, v2, cache_row);
    b.check("qk_norm_rotary_into_cache q", q1, q2, kRoundedOnce);
    b.check("qk_norm_rotary_into_cache keys", k1, k2, kRoundedOnce);
    b.check("qk_norm_rotary_into_cache values", v1, v2, kBitwise);
  }
  const double qk_bytes = 2.0 * 2 * (q + kv);
  const double cache_bytes = qk_bytes + 2.0 * 2 * kv;  // v read and written besides
  b.report("qk_norm_rotary_into_cache", 1, q + 2 * kv, 0, b.graph_us([&](int) {
    kernels::qk_norm_rotary_into_cache(qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos,
                                       sin, eps, keys, values, cache_row);
  }),
           cache_bytes);
  b.report("qk_norm_rotary + 2 index_copy_", 1, q + 2 * kv, 0, b.graph_us([&](int) {
    auto k = kernels::qk_norm_rotary(qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos,
                                     sin, eps)
                 .second;
    keys.index_copy_(0, cache_row, k);
    values.index_copy_(0, cache_row, qkv.narrow(1, q + kv, kv).view({1, c.num_kv_heads, d}));
  }),
           cache_bytes);
  // KVCache::update's write alone (prefill and the passes without q/k norms).
  auto k_new = qkv.narrow(1, q, kv).view({1, c.num_kv_heads, d});
  auto v_new = qkv.narrow(1, q + kv, kv).view({1, c.num_kv_heads, d});
  {
    auto k1 = keys.clone(), v1 = values.clone(), k2 = keys.clone(), v2 = values.clone();
    kernels::write_kv_rows(k1, v1, cache_row, k_new, v_new);
    kernels::write_kv_rows_reference(k2, v2, cache_row, k_new, v_new);
    b.check("write_kv_rows keys", k1, k2, kBitwise);
    b.check("write_kv_rows values", v1, v2, kBitwise);
  }
  const double kv_bytes = 2.0 * 4 * kv;
  b.report("write_kv_rows", 1, 2 * kv, 0,
           b.graph_us([&](int) { kernels::write_kv_rows(keys, values, cache_row, k_new, v_new); }),
           kv_bytes);
  b.report("2 index_copy_", 1, 2 * kv, 0, b.graph_us([&](int) {
    keys.index_copy_(0, cache_row, k_new);
    values.index_copy_(0, cache_row, v_new);
  }),
           kv_bytes);
}

}  // namespace

// The per-head q/k norms and rotary of a decode step and of the prefill, and the decode step's
// writes into the KV cache.
void bench_qk_norm_rotary(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  [[maybe_unused]] const auto [h, d, q, kv, f, eps] = shape_of(c);
  auto qkv = at::randn({1, q + 2 * kv}, opts);
  auto head_norm = at::ones({d}, opts);
  auto cos = at::randn({1, d}, opts), sin = at::randn({1, d}, opts);
  check_qk_norm_rotary(b, "qk_norm_rotary", qkv, head_norm, cos, sin);
  const double qk_bytes = 2.0 * 2 * (q + kv);
  b.report("qk_norm_rotary", 1, q + kv, 0, b.graph_us([&](int) {
    kernels::qk_norm_rotary(qkv, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos, sin, eps);
  }),
           qk_bytes);
  b.report("2 rms_norm + 2 rotary", 1, q + kv, 0, b.graph_us([&](int) {
    auto qh = qkv.narrow(1, 0, q).view({1, c.num_heads, d});
    auto kh = qkv.narrow(1, q, kv).view({1, c.num_kv_heads, d});
    kernels::rotary(models::rms_norm(qh, head_norm, eps), cos, sin);
    kernels::rotary(models::rms_norm(kh, head_norm, eps), cos, sin);
  }),
           qk_bytes);
  {
    // At the prefill's 2048 tokens, where the pass's bytes decide (one read and one write of
    // q and k, the tables).
    const int64_t tokens = 2048;
    auto qkv_p = at::randn({tokens, q + 2 * kv}, opts);
    auto cos_p = at::randn({tokens, d}, opts), sin_p = at::randn({tokens, d}, opts);
    check_qk_norm_rotary(b, "qk_norm_rotary (prefill)", qkv_p, head_norm, cos_p, sin_p);
    b.report("qk_norm_rotary (prefill)", tokens, q + kv, 0, b.graph_us([&](int) {
      kernels::qk_norm_rotary(qkv_p, c.num_heads, c.num_kv_heads, head_norm, head_norm, cos_p,
                              sin_p, eps);
    }),
             2.0 * tokens * (2 * (q + kv) + 2 * d));
  }
  bench_kv_cache_writes(b, qkv, head_norm, cos, sin);
}

// The decode step's SwiGLU activation.
void bench_silu_mul(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t f = c.intermediate_size;
  auto gate_up = at::randn({1, 2 * f}, opts);
  b.check("silu_mul", kernels::silu_mul(gate_up), kernels::silu_mul_reference(gate_up),
          kRoundedOnce);
  const double act_bytes = 2.0 * 3 * f;
  b.report("silu_mul", 1, f, 0, b.graph_us([&](int) { kernels::silu_mul(gate_up); }), act_bytes);
  b.report("at::silu * up", 1, f, 0,
           b.graph_us([&](int) { at::silu(gate_up.narrow(1, 0, f)) * gate_up.narrow(1, f, f); }),
           act_bytes);
}

}  // namespace dflash::kernel_bench
