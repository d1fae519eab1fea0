// train: one DFlash micro-batch, from its formation on the host to its forward and backward.
// A MicroBatch is formed once, on the producer side (anchors sampled, blocks and labels built,
// host tensors pinned for a GPU run); the feature stage adds the target's tapped features on
// the compute device; forward_backward runs the drafter, the chunked LM-head loss and the
// backward, leaving every figure on the device (no host sync).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "common/enum_names.h"
#include "models/drafter.h"
#include "train/blocks.h"
#include "train/loss.h"

namespace dflash::train {

// How sequences become blocks: at most max_anchors anchors per sequence, sequences with fewer
// than min_anchors anchor candidates are left out (counted), the draw seeded by (seed, epoch,
// sample id).
struct AnchorOptions {
  int64_t max_anchors = 512;
  int64_t min_anchors = 1;
  uint64_t seed = 0;
};

// One sample as the data layer serves it (token ids and assistant-only loss mask).
struct SampleView {
  int64_t id = 0;  // dataset index: with the epoch, it seeds the sample's anchors
  std::span<const int32_t> ids;
  std::span<const uint8_t> mask;
};

struct MicroBatch {
  int64_t position = 0;  // global micro-batch number in the data stream
  int64_t epoch = 0;
  std::vector<int64_t> sample_ids;  // the sequences kept, in order
  std::vector<int64_t> lengths;
  at::Tensor tokens;              // int64 [sum of lengths]
  BlockTargets blocks;            // anchors' blocks and labels
  double step_weight_sum = 0;     // loss normaliser: label weights of the whole optimizer step
  int64_t skipped_sequences = 0;  // sequences of this micro-batch with too few anchors
  int64_t global_tokens = 0;      // tokens of the whole micro-batch, every rank's share
  at::Tensor features;            // [sum of lengths, K*H], set by the feature stage
  models::PackedBatch packed;     // the sequences' layout on the compute device, set by to()

  int64_t num_tokens() const { return tokens.defined() ? tokens.numel() : 0; }
  // Tokens, blocks and labels copied to `device` (non-blocking from pinned memory), and the
  // packed layout that the target and the drafter share.
  MicroBatch to(at::Device device) const;
};

// Anchors of one sample (empty when it has fewer than min_anchors candidates).
std::vector<int64_t> sample_anchors(const SampleView& sample, int64_t epoch,
                                    const AnchorOptions& options);

// A micro-batch of `samples` on the host (pinned when `pin`): the sequences with anchors, cut
// to `max_seq_len` tokens, and their blocks. step_weight_sum is left for the caller.
MicroBatch form_micro_batch(int64_t position, int64_t epoch, std::span<const SampleView> samples,
                            int64_t max_seq_len, const AnchorOptions& anchors,
                            const models::DrafterConfig& config, bool pin);

// Sum of the loss weights of every supervised label the blocks of `samples` carry, in the
// samples' order and rounded through fp32 as build_blocks stores them: every rank computes the
// same normaliser from the whole global step, so N ranks compute what one rank would.
double label_weight_sum(std::span<const SampleView> samples, int64_t epoch, int64_t max_seq_len,
                        const AnchorOptions& anchors, const models::DrafterConfig& config);

// The drafter layers' projections (--drafter-gemms): kCompute in the compute dtype; kFp8 as FP8
// GEMMs, forward and input gradients in e4m3 with a scale per row, weight gradients in the
// compute dtype (11% off the drafter step at the paper's shape on an H200; tau level with compute
// on GSM8K over two seeds); kAuto is fp8 where it runs on a GPU, compute on the CPU.
enum class DrafterGemms { kAuto, kCompute, kFp8 };
inline constexpr EnumName<DrafterGemms> kDrafterGemmsNames[] = {
    {DrafterGemms::kAuto, "auto",
     "fp8 where it runs: a GPU of compute capability 9.0 or newer, bf16, widths that are "
     "multiples of 16"},
    {DrafterGemms::kCompute, "compute", "the compute dtype"},
    {DrafterGemms::kFp8, "fp8",
     "their forward and input-gradient GEMMs in e4m3 with a scale per row, the weight gradients "
     "in the compute dtype"},
};

struct StepOptions {
  at::ScalarType dtype = at::kFloat;  // compute dtype (bf16 on GPU)
  int64_t head_chunk_rows = 1024;
  models::DrafterAttention attention = models::DrafterAttention::kAuto;
  // kFp8 reads the head's lm_head_t_fp8; kAuto is the Trainer's to resolve (here: kCompute).
  HeadGrad head_grad = HeadGrad::kCompute;
  // kFp8: Drafter::forward's fp8_gemms; kAuto is the Trainer's to resolve (here: kCompute).
  DrafterGemms drafter_gemms = DrafterGemms::kCompute;
};

DrafterGemms parse_drafter_gemms(const std::string& name, const std::string& what);
inline const char* drafter_gemms_name(DrafterGemms gemms) {
  return enum_name(kDrafterGemmsNames, gemms);
}
// kAuto resolved, kFp8 checked, for `config`'s layers on `device` in `dtype`: the FP8 GEMMs need
// kernels::fp8_gemm_unsupported's GPU and dtype, and widths that are multiples of 16 (the GEMM
// reduces over them). kAuto becomes kFp8 where they run, else kCompute; kFp8 where they cannot
// run fails, saying why.
DrafterGemms resolve_drafter_gemms(DrafterGemms requested, const models::DrafterConfig& config,
                                   at::Device device, at::ScalarType dtype);

struct MicroResult {
  at::Tensor weighted_ce;  // fp32 scalar, unnormalised
  at::Tensor correct;      // fp32 [B]
  at::Tensor count;        // fp32 [B]
  at::Tensor predictions;  // int64 [labels]
  double weight_sum = 0;   // sum of the weights of valid labels (host)
  int64_t blocks = 0;
  int64_t labels = 0;
};

// x.index_select(0, rows) for rows without repeats (the labelled predicting rows): its backward
// writes each row's gradient to its place (zeros, then index_copy_) where index_select's adds
// it (index_add_, atomic adds: 0.3 ms a step for bf16 rows on an H200). Same values.
at::Tensor select_unique_rows(const at::Tensor& x, const at::Tensor& rows);

// Forward and backward of a micro-batch whose tensors and features are on the compute device.
// Gradients of grad_scale * weighted_ce accumulate into the drafter parameters' .grad.
// `before_backward` (if set) runs once the forward and the loss are queued, before the backward.
MicroResult forward_backward(const models::Drafter& drafter, const models::TargetHead& head,
                             const MicroBatch& batch, double grad_scale, const StepOptions& options,
                             const std::function<void()>& before_backward = {});

// The same for sequences given as host vectors with explicit anchors (one ascending list per
// sequence; empty = the sequence contributes nothing) and their features: what the reference
// tests drive.
struct StepInput {
  std::vector<std::vector<int64_t>> tokens;
  std::vector<std::vector<uint8_t>> loss_masks;
  at::Tensor features;  // [sum of lengths, K*H], taps concatenated in target_layer_ids order
};
MicroResult forward_backward(const models::Drafter& drafter, const models::TargetHead& head,
                             const StepInput& input,
                             const std::vector<std::vector<int64_t>>& anchors, double grad_scale,
                             const StepOptions& options);

// Simulated acceptance length from per-position accuracies acc_1..acc_{B-1}:
// 1 + sum_k prod_{j<=k} acc_j.
double simulated_acceptance(const std::vector<double>& accuracy);

}  // namespace dflash::train
