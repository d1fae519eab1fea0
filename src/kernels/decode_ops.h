// decode_ops: the target's normalization and activation steps fused for the decode step, where
// each ATen op is a launch over a few rows and launches, not bytes, cost the time. Inference
// only (no autograd); each has an fp32 ATen reference, the CPU path and the test oracle.
//
// add_rms_norm: the residual add and the next RMSNorm in one pass (two launches in ATen).
// qk_norm_rotary: Qwen3's per-head q/k RMSNorm and rotary, read from the fused QKV output
//   (four launches in ATen and kernels::rotary).
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
// row); elsewhere the reference.
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

// gate_up: [T, 2F] contiguous (gate columns first). Returns silu(gate) * up, [T, F], computed
// in fp32 and rounded once. CUDA: one kernel; elsewhere the reference.
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor silu_mul_reference(const at::Tensor& gate_up);

}  // namespace dflash::kernels
