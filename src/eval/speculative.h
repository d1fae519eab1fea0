// eval: generation and speculative decoding with the target and drafter. This file: DFlash
// speculative decoding (BRIEF, inference). A slot's step: the drafter proposes B-1 tokens
// after the slot's newest committed token; the target runs once over that block (the token and
// the drafts) with its KV cache; some prefix of the drafts is accepted and the target supplies
// the token after it; the target cache is cropped to the tokens it ran that were committed,
// and their tapped features extend the drafter's context. Many slots step together, each with
// its own acceptance, and a slot is refilled from the queue when its sequence finishes.
// Greedy (temperature 0): the longest prefix of drafts equal to the target's own choices is
// accepted and the target's choice after it is the bonus token, so the output is, token for
// token, the target's own greedy output (Generator with greedy sampling). Temperature > 0:
// speculative sampling (sampling.h, speculative_verdict) with the drafter's distributions
// under the same temperature / top-k / top-p, so each output is distributed exactly as the
// target's own sampled output; the draws depend on (seed, request, token index) only. On CUDA
// in bf16/fp16 the verify pass over all slots is one captured CUDA graph (every slot verifies a
// full block; the drafts go from the drafter to the graph's input without a host round trip);
// greedy with the DFlash drafter, the graph holds the whole step: the draft, the verify, the
// accepted lengths and bonus tokens, and the drafter's context of the verified block, so that
// a step is one replay and one copy of its tokens and verdicts to the host, which reads them
// after launching the next step (each slot's last token and length live on the device, and
// every step advances them itself). With a tree budget
// (SpeculativeOptions::tree_budget) a step verifies a tree of drafts instead (draft_tree.h).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "eval/generator.h"
#include "eval/sampling.h"
#include "models/drafter.h"
#include "models/target.h"

namespace dflash::kernels {
struct SlotAdvance;
}  // namespace dflash::kernels

namespace dflash::eval {

class PrefillGraphs;

// Drafts for speculative sampling: the tokens and the distributions they were drawn from.
struct SampledDraft {
  at::Tensor tokens;  // int64 [n, B-1]
  // float [n, B-1, V]: q of draft j given the block before it, under the decoder's sampling
  // transform (sampling_probs). Undefined: each token is proposed with certainty (q one-hot),
  // which keeps speculative sampling exact for a source without distributions.
  at::Tensor probs;
};

// What proposes the drafts. DFlashDraftSource is the drafter; tests plug hand-made ones
// (the target's own continuation, always wrong, right with some probability, the target's
// own distribution).
class DraftSource {
 public:
  virtual ~DraftSource() = default;
  virtual int64_t block_size() const = 0;
  // Target decoder layers whose outputs extend() receives, in feature order; may be empty.
  virtual std::vector<int64_t> tap_layers() const = 0;
  // Called once before decoding: `slots` sequences of up to `context` tokens each.
  virtual void start(int64_t slots, int64_t context) = 0;
  // `slot` begins a new sequence.
  virtual void reset(int64_t slot) = 0;
  // The target has run over tokens[i], the next tokens of slot slots[i], which are committed;
  // `features` are their taps concatenated, [sum of sizes, K*H] (undefined with no taps).
  virtual void extend(const std::vector<int64_t>& slots,
                      const std::vector<std::span<const int64_t>>& tokens,
                      const at::Tensor& features) = 0;
  // B-1 draft tokens per slot after last[i], the slot's newest committed token (which the
  // target has not run yet): int64 [n, B-1] on any device.
  virtual at::Tensor draft(const std::vector<int64_t>& slots, const std::vector<int64_t>& last) = 0;
  // Temperature > 0: B-1 drafts per slot drawn from the source's distributions under
  // `sampling`, draft j of slot i with uniforms[i][j] (float64 [n, B-1] on the target's device;
  // sample_from_probs) so that a draft depends on its request's draws only. The default
  // proposes draft()'s tokens with certainty.
  virtual SampledDraft draft_sampled(const std::vector<int64_t>& slots,
                                     const std::vector<int64_t>& last,
                                     const SamplingParams& sampling, const at::Tensor& uniforms);
  // Tree verification: the source's distribution at each of the B-1 draft positions after
  // last[i], float [n, B-1, V] on any device. The default is certain of draft()'s tokens (a
  // tree of them is the chain).
  virtual at::Tensor draft_probs(const std::vector<int64_t>& slots,
                                 const std::vector<int64_t>& last, int64_t vocab);

  // Whether the source drafts and extends its context as device work over the verify pass's
  // batch, with no host reads, so that the whole greedy step can be one captured CUDA graph.
  // Such a source's start(slots, context) makes caches of `slots` x (context + B) rows, the
  // decoder's target cache layout, so that one AppendBatch addresses both.
  virtual bool capturable() const { return false; }
  // Capturable sources. draft_at: the drafts of every slot of `batch` (B tokens per slot,
  // starting where the slot's context ends) after `last` (int64 [n], device), int64 [n, B-1].
  // write_block: the context of the whole verified block, its tokens int64 [n*B] and their
  // features [n*B, K*H] (undefined with no taps), written at the batch's positions; count_block
  // (slot, count) then says that its first `count` tokens were committed (the positions past
  // them are rewritten by the next block). The decoder reads verdicts one step late: it may
  // draft and write the next block before it calls count_block for this one, so a slot's
  // context for draft_at is what extend and write_block wrote before the batch's start, and
  // count_block must not be needed by the next draft_at.
  virtual at::Tensor draft_at(const models::AppendBatch& batch, const at::Tensor& last);
  virtual void write_block(const models::AppendBatch& batch, const at::Tensor& tokens,
                           const at::Tensor& features);
  virtual void count_block(int64_t slot, int64_t count);
};

// The DFlash drafter (models::DraftModel) with its context cache, in the target's dtype.
class DFlashDraftSource final : public DraftSource {
 public:
  // `block_size` 0: the drafter's own; `fp8_weights`: its weights and LM head in e4m3 (both as
  // models::DraftModel takes them). Of a tensor-parallel target it
  // gathers the whole embedding and LM head (models::whole_target_head), a collective of the
  // group: every rank drafts the same tokens from a whole copy.
  DFlashDraftSource(const models::Drafter& drafter, const models::TargetModel& target,
                    int64_t block_size = 0, bool fp8_weights = false);
  int64_t block_size() const override { return model_.block_size(); }
  std::vector<int64_t> tap_layers() const override { return model_.config().target_layer_ids; }
  void start(int64_t slots, int64_t context) override;
  void reset(int64_t slot) override;
  void extend(const std::vector<int64_t>& slots,
              const std::vector<std::span<const int64_t>>& tokens,
              const at::Tensor& features) override;
  at::Tensor draft(const std::vector<int64_t>& slots, const std::vector<int64_t>& last) override;
  // Drafts from the drafter's logits under `sampling`, with those distributions.
  SampledDraft draft_sampled(const std::vector<int64_t>& slots, const std::vector<int64_t>& last,
                             const SamplingParams& sampling, const at::Tensor& uniforms) override;
  // The softmax of the drafter's logits (temperature 1, whatever the decoder samples with).
  at::Tensor draft_probs(const std::vector<int64_t>& slots, const std::vector<int64_t>& last,
                         int64_t vocab) override;
  bool capturable() const override { return true; }
  at::Tensor draft_at(const models::AppendBatch& batch, const at::Tensor& last) override;
  void write_block(const models::AppendBatch& batch, const at::Tensor& tokens,
                   const at::Tensor& features) override;
  void count_block(int64_t slot, int64_t count) override { cache_->extend(slot, count); }

 private:
  models::DraftModel model_;
  std::optional<models::KVCache> cache_;
};

struct SpeculativeOptions {
  SamplingParams sampling;           // greedy by default
  int64_t max_new_tokens = 512;      // generated tokens per request, stop token included
  std::vector<int64_t> stop_tokens;  // a generated stop token ends its sequence
  int64_t slots = 1;                 // sequences decoded together
  int64_t context = 0;             // prompt + generated tokens at most; 0: max_position_embeddings
  int64_t prefill_tokens = 16384;  // prompt tokens per prefill forward (one prompt at least)
  // Capture the verify pass where the device and dtype allow (sampling then draws from the
  // captured logits).
  bool cuda_graph = true;
  // Greedy with a capturable draft source: run each step as one pass on the device (draft,
  // verify, verdicts, the drafter's context of the block), captured whole where cuda_graph
  // allows, rather than drafting, verifying and extending the drafter's context apart.
  bool whole_step = true;
  // A whole step's verdicts read after the next step is launched (reads_verdicts_late) where
  // the target allows; false: read before it (the step's host round trip not hidden).
  bool late_verdicts = true;
  // > 0: tree verification (draft_tree.h): each step verifies a tree of up to this many drafted
  // tokens from the source's draft_probs in one target pass (captured where cuda_graph allows;
  // the draft and the tree eager); the committed tokens are the target's own choices along the
  // tree (at temperature > 0 drawn as plain decoding draws them), so the output equals
  // Generator's with the same options. Targets whose every layer is attention (no
  // linear-attention layers) only.
  int64_t tree_budget = 0;
  // gpt-oss: its sliding layers cache only their windows (models/kv_cache.h, WindowRings).
  bool window_rings = true;
  ProgressFn progress;  // if set, called after each verify step's commits
};

// Fails naming --tree-budget where `target` cannot verify trees of `tree_budget` drafts (a
// negative budget; a hybrid target, whose linear-attention state cannot branch).
void check_tree_verification(const models::ModelConfig& target, int64_t tree_budget);

struct SpeculativeStats {
  int64_t requests = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;  // as GenerationStats: a stop token counts
  int64_t prefill_forwards = 0;
  int64_t verify_steps = 0;  // (slot, target forward over a draft block) pairs
  // committed[k]: verify steps that committed k tokens (accepted drafts + the bonus token,
  // cut at a stop token or a limit), k = 1..B (a tree's paths are no longer than a block);
  // [0] unused.
  std::vector<int64_t> committed;
  double seconds = 0;

  // Acceptance length tau: tokens committed per verify step (the first token of each
  // request comes from its prefill and is not counted).
  double tau() const;
  // Adds another run's counts (histograms of different lengths are padded).
  void add(const SpeculativeStats& other);
};

class SpeculativeDecoder {
 public:
  // `drafter` must outlive the decoder; its start() is called here.
  SpeculativeDecoder(const models::TargetModel& target, DraftSource& drafter,
                     SpeculativeOptions options);

  // As Generator::run: pulls requests from `next` while slots are free, calls `done` as each
  // finishes (and `done` may make more requests available), returns when all are done.
  SpeculativeStats run(const Generator::NextFn& next, const Generator::DoneFn& done);
  // All `prompts` as requests first_id, first_id + 1, ... (run_prompts), completions in input
  // order.
  std::vector<Completion> generate(const std::vector<std::vector<int64_t>>& prompts,
                                   SpeculativeStats* stats = nullptr, uint64_t first_id = 0);

  const SpeculativeOptions& options() const { return options_; }
  bool uses_cuda_graph() const { return graph_ != nullptr; }
  // Whether the captured graph holds the whole step (draft and verdict too).
  bool captures_whole_step() const;
  // Whether the host reads each whole step's verdicts after launching the next step (every
  // whole step with late_verdicts but a hybrid target's, whose linear states the host crops
  // between steps).
  bool reads_verdicts_late() const { return late_; }

 private:
  struct Graph;
  class Session;
  void capture_graph();
  // The greedy step over `batch` (B tokens per slot at each slot's cached length; `tokens`
  // [n*B] holds each slot's last committed token at its block's start, the drafts are written
  // after it): drafts, verify, verdicts, and the drafter's context of the whole block (to be
  // counted, DraftSource::count_block). Returns int64 [n*B + 2n]: the block tokens, each
  // slot's accepted drafts, and the target's token after them.
  // With `advance`, the slots' device state moves by the verdicts (kernels::greedy_verdicts).
  at::Tensor whole_step(const models::AppendBatch& batch, const at::Tensor& tokens,
                        const kernels::SlotAdvance* advance = nullptr);
  // whole_step over every slot from device_slots_, which it then advances by its verdicts
  // (`batch` at device_slots_.length; `tokens` [slots*B] holding each slot's last token at its
  // block's start).
  at::Tensor late_step(const models::AppendBatch& batch, const at::Tensor& tokens);

  const models::TargetModel& target_;
  DraftSource& drafter_;
  SpeculativeOptions options_;
  // Per slot: the context limit plus one block (or one tree, whichever is larger), so that a
  // slot can always run a whole block (the graph's fixed shape) past its committed tokens.
  models::KVCache cache_;
  bool whole_step_ = false;
  // Whole steps read late (reads_verdicts_late): what a step starts from lives on the device,
  // each step advancing it, so that launching step k + 1 needs nothing from step k's verdicts.
  // int64 [slots] each: the newest committed token, the cached length (the caches' host
  // lengths are not kept), 1 while the slot decodes, the tokens it may still keep. The host
  // writes them when it admits a request or sees one finish; a step's verdicts deactivate the
  // slots they finish (a stop token, no room left: kernels::greedy_verdicts), so that step
  // k + 1, launched before the host reads step k, skips on the device when no slot is left
  // (kernels::GatedGraph) and otherwise runs the finished slot at length 0 of its own rows.
  struct DeviceSlots {
    at::Tensor last, length, active, room;
  };
  at::Tensor stop_tokens_;  // int64 [k] on the device: options_.stop_tokens
  bool late_ = false;
  DeviceSlots device_slots_;
  std::shared_ptr<Graph> graph_;
  // A request admitted alone, where the target allows: the drafter's context written inside
  // the graph for a capturable source, else extended from the graph's taps.
  std::shared_ptr<PrefillGraphs> prefill_;
};

}  // namespace dflash::eval
