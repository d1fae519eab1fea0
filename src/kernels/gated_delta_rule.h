// gated_delta_rule: Gated DeltaNet's gated delta rule (the linear-attention layers of Qwen3.5 and
// Qwen3-Next) over packed sequences. Each function has an fp32 ATen reference (transformers'
// torch_chunk_gated_delta_rule with chunk 64, all sequences at once, and
// torch_recurrent_gated_delta_rule), the CPU path, the test oracle and, being differentiable,
// the path whenever autograd records (training a hybrid target with `dflash pretrain`). On
// CUDA, for heads of 128 (Dk = Dv = 128, as Qwen3.5 and Qwen3-Next) and q, k, v of one dtype
// (bf16, fp16 or fp32), the inference-only kernels of gated_delta_rule.cu run instead (other
// shapes take the reference on the GPU). The chunked form has two CUDA variants (ChunkKernel):
// tensor cores (scratch of about 0.5 KB per token and value head during the call) and SIMT
// (about 1.3 KB).
#pragma once
#include <ATen/ATen.h>

namespace dflash::kernels {

// q, k: [T, Hk, Dk]; v: [T, Hv, Dv], Hv a multiple of Hk (value head h reads key head
//   h / (Hv / Hk), as transformers' repeat_interleave);
// g: [T, Hv] float32, log decay (<= 0); beta: [T, Hv] float32 (any dtype accepted, read as fp32);
// cu_seqlens: int32 [N+1] on q's device; lengths: the same on the host (N sequences);
// initial_state: undefined (zeros) or [N, Hv, Dk, Dv] float32.
// q and k are L2-normalised inside (fp32, x * rsqrt(sum x^2 + 1e-6)) and q scaled by Dk^-0.5
// (transformers' use_qk_l2norm_in_kernel=True). Each sequence starts from its own initial
// state (zeros by default): nothing flows across a sequence boundary.
// The chunked form's CUDA kernel: kAuto reads DFLASH_GDN_KERNEL (tc or simt; tc when unset).
enum class ChunkKernel { kAuto, kTensorCore, kSimt };

struct GatedDeltaResult {
  at::Tensor out;          // [T, Hv, Dv], v's dtype
  at::Tensor final_state;  // [N, Hv, Dk, Dv] float32
};
GatedDeltaResult chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& g,
                                        const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                        c10::ArrayRef<int64_t> lengths,
                                        const at::Tensor& initial_state = {},
                                        ChunkKernel kernel = ChunkKernel::kAuto);

// Decode / verify: each of N sequences advances by S tokens (S >= 1, same for all) from
// `state` [N, Hv, Dk, Dv] float32. q, k: [N, S, Hk, Dk]; v: [N, S, Hv, Dv]; g, beta: [N, S, Hv].
// Returns out [N, S, Hv, Dv] (v's dtype). `state` is read, not modified; if `states_out` is
// defined ([N, S, Hv, Dk, Dv] float32) the state after each token is written there, so a
// speculative verify can keep the state of the accepted prefix only.
at::Tensor recurrent_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta,
                                      const at::Tensor& state, const at::Tensor& states_out = {});

// The ATen compositions in fp32 on any device (same arguments and results).
GatedDeltaResult chunk_gated_delta_rule_reference(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& g,
                                                  const at::Tensor& beta,
                                                  const at::Tensor& cu_seqlens,
                                                  c10::ArrayRef<int64_t> lengths,
                                                  const at::Tensor& initial_state = {});
at::Tensor recurrent_gated_delta_rule_reference(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& g,
                                                const at::Tensor& beta, const at::Tensor& state,
                                                const at::Tensor& states_out = {});

}  // namespace dflash::kernels
