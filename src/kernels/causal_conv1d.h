// causal_conv1d: the depthwise causal conv1d + SiLU in front of Gated DeltaNet's q/k/v (Qwen3.5,
// Qwen3-Next), over packed sequences (prefill) and for decode / verify steps. Each function has
// an fp32 ATen reference (transformers' causal_conv1d_fn / causal_conv1d_update with SiLU), the
// CPU path, the test oracle and the path whenever autograd records (it is differentiable). On
// CUDA, for x in bf16, fp16 or fp32 and widths 2 to 4, the inference-only kernels of
// causal_conv1d.cu run instead (fp32 math).
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// Prefill: x [T, C] (rows = tokens), weight [C, W] (transformers' conv1d.weight squeezed), no
// bias (Qwen3.5 has none). Sequence i only sees its own rows (zero left padding at each start,
// or `initial_state` [N, C, W-1] if given). cu_seqlens: int32 [N+1] on x's device; lengths: the
// same on the host. Returns out [T, C] in x's dtype, and final_state [N, C, W-1] (the last W-1
// inputs of each sequence, zero-padded on the left if the sequence is shorter, preceded by
// initial_state's tail) in x's dtype.
struct CausalConvResult {
  at::Tensor out, final_state;
};
CausalConvResult causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& cu_seqlens, c10::ArrayRef<int64_t> lengths,
                                    const at::Tensor& initial_state = {});

// Decode / verify: x [N, S, C]; state [N, C, W-1] (read, not modified). Returns out [N, S, C];
// if states_out ([N, S, C, W-1]) is defined, the conv state after each token is written there.
at::Tensor causal_conv1d_silu_step(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& state, const at::Tensor& states_out = {});

// The ATen compositions in fp32 on any device (same arguments and results).
CausalConvResult causal_conv1d_silu_reference(const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& cu_seqlens,
                                              c10::ArrayRef<int64_t> lengths,
                                              const at::Tensor& initial_state = {});
at::Tensor causal_conv1d_silu_step_reference(const at::Tensor& x, const at::Tensor& weight,
                                             const at::Tensor& state,
                                             const at::Tensor& states_out = {});

}  // namespace dflash::kernels
