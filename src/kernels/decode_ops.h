// decode_ops: the target's normalization and activation steps fused for its inference passes:
// at decode each ATen op is a launch over a few rows and launches cost the time; at prefill
// each is a pass over thousands of rows and the passes do. Inference only (no autograd); each
// has an fp32 ATen reference, the CPU path and the test oracle.
//
// add_rms_norm: the residual add and the next RMSNorm in one pass (two launches in ATen).
// qk_norm_rotary: Qwen3's per-head q/k RMSNorm and rotary, read from the fused QKV output
//   (four launches in ATen and kernels::rotary); qk_norm_rotary_into_cache also writes k and v
//   into the KV cache (two index_copy_ launches more); write_kv_rows writes k and v alone.
// silu_mul: silu(gate) * up from the fused gate/up output (two launches and a temporary).
#pragma once
#include <ATen/ATen.h>

#include <utility>

namespace dflash::kernels {

struct AddRmsNorm {
  at::Tensor sum;     // x + y, rounded to the dtype (what at::add gives)
  at::Tensor normed;  // rms_norm(sum) * weight, the norm of the rounded sum, in fp32
};

// x, y: [T, H] contiguous, one dtype; weight: [H] of that dtype. CUDA: one kernel (a block per
// row, each input read once with 16-byte loads where rows are aligned); elsewhere the
// reference.
AddRmsNorm add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                        double eps);
AddRmsNorm add_rms_norm_reference(const at::Tensor& x, const at::Tensor& y,
                                  const at::Tensor& weight, double eps);

// qkv: [T, (Hq + 2 Hkv) D] with the last dimension contiguous (q heads, then k, then v);
// q_norm, k_norm: [D]; cos, sin: [T, D] (kernels::rotary's tables); all one dtype. Returns q
// [T, Hq, D] and k [T, Hkv, D], contiguous: rotary(rms_norm(head) * norm weight), computed
// in fp32 and rounded once. CUDA: one kernel (a warp per token and head); elsewhere the
// reference.
std::pair<at::Tensor, at::Tensor> qk_norm_rotary(const at::Tensor& qkv, int64_t q_heads,
                                                 int64_t kv_heads, const at::Tensor& q_norm,
                                                 const at::Tensor& k_norm, const at::Tensor& cos,
                                                 const at::Tensor& sin, double eps);
std::pair<at::Tensor, at::Tensor> qk_norm_rotary_reference(
    const at::Tensor& qkv, int64_t q_heads, int64_t kv_heads, const at::Tensor& q_norm,
    const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, double eps);

// The same with the new tokens' K and V going straight to a KV cache, as the decode step
// needs them (gpt-fast's KVCache.update folded in): keys and values, [R, Hkv, D] contiguous
// (KVCache's layer tensors, written in place through these handles), get token t's rotated k
// heads and its v heads (copied from qkv) at row rows[t]; rows: int64 [T] on qkv's device, read
// there (CUDA-graph capturable; a row outside [0, R) is a device-side assert). Returns q. CUDA:
// the one qk_norm_rotary kernel with a warp per v head more; elsewhere the reference (the
// reference's q and k, then index_copy_). `q_group_major`: q's heads in group-major order
// (query head kv * G + g at g * Hkv + kv, G = Hq / Hkv), the layout in which flash attends a
// token's G query heads of one KV head as one sequence (models::cached_causal_attention's
// per-token path) without regrouping them.
at::Tensor qk_norm_rotary_into_cache(const at::Tensor& qkv, int64_t q_heads, int64_t kv_heads,
                                     const at::Tensor& q_norm, const at::Tensor& k_norm,
                                     const at::Tensor& cos, const at::Tensor& sin, double eps,
                                     at::Tensor keys, at::Tensor values, const at::Tensor& rows,
                                     bool q_group_major = false);
at::Tensor qk_norm_rotary_into_cache_reference(const at::Tensor& qkv, int64_t q_heads,
                                               int64_t kv_heads, const at::Tensor& q_norm,
                                               const at::Tensor& k_norm, const at::Tensor& cos,
                                               const at::Tensor& sin, double eps, at::Tensor keys,
                                               at::Tensor values, const at::Tensor& rows,
                                               bool q_group_major = false);

// KVCache::update's two index_copy_ in one launch, for the passes that do not take
// qk_norm_rotary_into_cache (prefill, models without q/k norms, the drafter): keys[rows[t]] =
// k[t] and values[rows[t]] = v[t]. keys, values: [R, Hkv, D] contiguous, written in place;
// k, v: [T, Hkv, D] of their dtype and device (any row stride); rows: int64 [T] there, read on
// the device (a row outside [0, R) is a device-side assert). CUDA bf16/fp16: one kernel;
// elsewhere the reference (index_copy_).
void write_kv_rows(at::Tensor keys, at::Tensor values, const at::Tensor& rows, const at::Tensor& k,
                   const at::Tensor& v);
void write_kv_rows_reference(at::Tensor keys, at::Tensor values, const at::Tensor& rows,
                             const at::Tensor& k, const at::Tensor& v);

// gate_up: [T, 2F] (gate columns first). Returns silu(gate) * up, [T, F], computed in fp32 and
// rounded once: kernels::swiglu_forward over the two halves (one kernel on CUDA).
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor silu_mul_reference(const at::Tensor& gate_up);

}  // namespace dflash::kernels
