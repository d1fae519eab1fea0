// cudnn_attention: variable-length, non-causal attention forward and backward through cuDNN's
// fused SDPA kernels (its frontend's graph API, header-only; the library itself is the libcudnn
// that LibTorch already loads, opened with dlopen). On Hopper these are cuDNN's own flash
// kernels, a different implementation from ATen's FlashAttention-2; models/prefix_attention can
// run its shared segments, its largest attention cost, through either.
// The contracts are at::_flash_attention_forward's (with seqused_k: a sequence's keys start
// anywhere, so sequences may share keys) and at::_flash_attention_backward's for packed
// (varlen) inputs, so the two are interchangeable: flash's output and log-sum-exp layouts,
// gradients in the inputs' layouts. Graphs are built once per shape key and cached (building one
// takes tens of milliseconds or more): the batch count is exact, the sequence bounds are rounded up
// to powers of two (the per-sequence lengths come from the device tensors, as a padding mask).
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

namespace dflash::kernels {

struct AttentionOutput {
  at::Tensor out;  // [Tq, H, D]
  at::Tensor lse;  // fp32 [H, Tq], flash's varlen layout
};

struct AttentionGrads {
  at::Tensor dq, dk, dv;
};

// Whether cuDNN's library can be opened and is at least 9.0 (CUDA builds; false without a GPU).
bool cudnn_attention_available();

// Whether the calls below run on `device`: the library opens, the GPU is Hopper or newer (the
// frontend serves ragged offsets there only), and a tiny forward and backward with overlapping
// key segments build and return finite values. Probed once per device, then cached; a failed
// probe is reported once on stderr, naming the reason. What `auto` settings ask before taking
// cuDNN, so that other GPUs and libraries fall back to flash's kernels instead of failing.
bool cudnn_attention_supported(at::Device device);

// q: [Tq, H, D]; k, v: [Tk, Hk, D] with H a multiple of Hk, D a multiple of 8 and at most 256,
// bf16 or fp16 on one CUDA device; cu_q: int32 [b + 1], sequence i's query rows at
// [cu_q[i], cu_q[i+1]); k_start: int32 [b + 1], its keys the k_len[i] (int32 [b], each at least
// 1) rows from k_start[i], in any order and overlapping (k_start[b] is any row past them, e.g.
// Tk); max_q, max_k: bounds on the lengths.
AttentionOutput cudnn_varlen_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& cu_q,
                                               const at::Tensor& k_start, const at::Tensor& k_len,
                                               int64_t max_q, int64_t max_k, double scale);

// dout, q, out: [Tq, H, D]; k, v: [Tk, Hk, D] with H a multiple of Hk, D a multiple of 8 and at
// most 256, bf16 or fp16 on one CUDA device; lse: fp32 [H, Tq] (flash's varlen log-sum-exp);
// cu_q, cu_k: int32 [b + 1] on the device, sequence i's rows at [cu[i], cu[i+1]), each sequence
// with at least one query and one key; max_q, max_k: bounds on the lengths. Rows of k and v
// past cu_k[b] are not read, and the same rows of dk and dv are left unwritten.
AttentionGrads cudnn_varlen_attention_backward(const at::Tensor& dout, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& out, const at::Tensor& lse,
                                               const at::Tensor& cu_q, const at::Tensor& cu_k,
                                               int64_t max_q, int64_t max_k, double scale);

// Causal attention of `batches` sequences of one length packed as rows: q [T, H, D], k, v
// [T, Hk, D] with T = batches x length, any row and head strides (views of a fused projection's
// output), H a multiple of Hk, D a multiple of 8 and at most 256, bf16 or fp16 on one CUDA
// device. Returns the output, [T, H, D] contiguous; no log-sum-exp (inference only). The graph
// and plan are those ATen's cuDNN call builds (the same bits), without its per-call host work;
// built once per shape and strides, then cached.
at::Tensor cudnn_causal_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, int64_t batches, double scale);

}  // namespace dflash::kernels
