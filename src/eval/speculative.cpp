#include "eval/speculative.h"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <numeric>

#include "common/error.h"
#include "common/upload.h"
#include "eval/draft_tree.h"
#include "eval/prefill_graph.h"
#include "eval/readback.h"
#include "eval/slots.h"
#include "kernels/gated_graph.h"
#include "kernels/speculative_step.h"
#include "models/target_head.h"

namespace dflash::eval {

using models::AppendBatch;
using models::Logits;

DFlashDraftSource::DFlashDraftSource(const models::Drafter& drafter,
                                     const models::TargetModel& target, int64_t block_size,
                                     bool fp8_weights)
    : model_(drafter, models::whole_target_head(target), target.dtype(), block_size, fp8_weights) {
  drafter.config().validate(target.config());
}

void DFlashDraftSource::start(int64_t slots, int64_t context) {
  // The context holds every committed token but the newest, which starts the next block.
  cache_.emplace(model_.make_cache(slots, context));
}

void DFlashDraftSource::reset(int64_t slot) { cache_->reset(slot); }

void DFlashDraftSource::extend(const std::vector<int64_t>& slots,
                               const std::vector<std::span<const int64_t>>& tokens,
                               const at::Tensor& features) {
  std::vector<int64_t> counts;
  for (const auto& t : tokens) counts.push_back(static_cast<int64_t>(t.size()));
  model_.extend(*cache_, slots, counts, features);
}

at::Tensor DFlashDraftSource::draft(const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& last) {
  return model_.draft(*cache_, slots, upload_to(model_.device(), at::tensor(last, at::kLong)));
}

SampledDraft DraftSource::draft_sampled(const std::vector<int64_t>& slots,
                                        const std::vector<int64_t>& last, const SamplingParams&,
                                        const at::Tensor&) {
  return {draft(slots, last), {}};
}

SampledDraft DFlashDraftSource::draft_sampled(const std::vector<int64_t>& slots,
                                              const std::vector<int64_t>& last,
                                              const SamplingParams& sampling,
                                              const at::Tensor& uniforms) {
  auto logits =
      model_.logits(*cache_, slots, upload_to(model_.device(), at::tensor(last, at::kLong)));
  auto probs = sampling_probs(logits, sampling);
  return {sample_from_probs(probs, uniforms), probs};
}

at::Tensor DraftSource::draft_probs(const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& last, int64_t vocab) {
  return at::one_hot(draft(slots, last).to(at::kLong), vocab).to(at::kFloat);
}

at::Tensor DFlashDraftSource::draft_probs(const std::vector<int64_t>& slots,
                                          const std::vector<int64_t>& last, int64_t) {
  auto logits =
      model_.logits(*cache_, slots, upload_to(model_.device(), at::tensor(last, at::kLong)));
  return at::softmax(logits.to(at::kFloat), -1);
}

at::Tensor DraftSource::draft_at(const AppendBatch&, const at::Tensor&) {
  fail("speculative: this draft source cannot draft inside a captured step");
}
void DraftSource::write_block(const AppendBatch&, const at::Tensor&, const at::Tensor&) {
  fail("speculative: this draft source cannot extend its context inside a captured step");
}
void DraftSource::count_block(int64_t, int64_t) {
  fail("speculative: this draft source cannot extend its context inside a captured step");
}

at::Tensor DFlashDraftSource::draft_at(const AppendBatch& batch, const at::Tensor& last) {
  return model_.draft(*cache_, batch, last);
}

void DFlashDraftSource::write_block(const AppendBatch& batch, const at::Tensor&,
                                    const at::Tensor& features) {
  model_.write_context(*cache_, batch, features);
}

double SpeculativeStats::tau() const {
  int64_t steps = 0, tokens = 0;
  for (size_t k = 0; k < committed.size(); ++k) {
    steps += committed[k];
    tokens += static_cast<int64_t>(k) * committed[k];
  }
  return steps == 0 ? 0.0 : static_cast<double>(tokens) / static_cast<double>(steps);
}

void SpeculativeStats::add(const SpeculativeStats& o) {
  requests += o.requests;
  prompt_tokens += o.prompt_tokens;
  generated_tokens += o.generated_tokens;
  prefill_forwards += o.prefill_forwards;
  verify_steps += o.verify_steps;
  if (committed.size() < o.committed.size()) committed.resize(o.committed.size(), 0);
  for (size_t k = 0; k < o.committed.size(); ++k) committed[k] += o.committed[k];
  seconds += o.seconds;
}

void check_tree_verification(const models::ModelConfig& target, int64_t tree_budget) {
  if (tree_budget < 0)
    fail("speculative: --tree-budget must be 0 or positive, got {}", tree_budget);
  if (tree_budget > 0 && target.is_hybrid()) {
    fail(
        "speculative: --tree-budget {}: {}'s linear-attention layers keep one state per sequence, "
        "which cannot follow a tree's branches; verify chains (--tree-budget 0)",
        tree_budget, models::architecture_name(target.arch));
  }
}

namespace {

int64_t resolve_context(const models::TargetModel& target, const SpeculativeOptions& o) {
  const int64_t context = o.context > 0 ? o.context : target.config().max_position_embeddings;
  if (context <= 1) fail("speculative: the context limit must exceed 1 token, got {}", context);
  return context;
}

// Rows a verify pass appends past a slot's committed tokens at most: a block, or a tree's root
// and drafted nodes.
int64_t verify_rows(const models::TargetModel& target, const DraftSource& drafter,
                    const SpeculativeOptions& o) {
  check_tree_verification(target.config(), o.tree_budget);
  return std::max(drafter.block_size(), o.tree_budget + 1);
}

}  // namespace

// The verify pass over every slot, captured once: each slot runs a whole block (or a tree of
// tree_budget + 1 nodes). Its inputs are static tensors rewritten in place before each replay
// (the block tokens and the batch's positions, cache rows and seen keys; a tree's mask); idle
// slots ride along at position 0 of their own rows, which nothing reads before the slot's next
// prefill overwrites them. For a whole step (whole_step()) the host writes only each slot's
// last token into `tokens`.
struct SpeculativeDecoder::Graph {
  at::cuda::CUDAGraph graph{/*keep_graph=*/true};  // kept: GatedGraph clones it
  AppendBatch batch;             // all slots, B tokens (nodes) each; max_seen = the capacity
  at::Tensor base_rows;          // int64 [slots*B]: slot * capacity
  at::Tensor offsets;            // int64 [slots*B]: 0..B-1 for each slot
  at::Tensor tokens;             // int64 [slots*B]: the input, [last token, drafts] per slot
  at::Tensor logits;             // [slots*B, V]: the target's logits after each block token
  at::Tensor choices;            // int64 [slots*B]: their argmax
  std::vector<at::Tensor> taps;  // [slots*B, H] each: the drafter's tapped layers
  at::Tensor verdicts;           // a whole step's result (whole_step())
  // Late steps: the graph behind the device's "any slot active" gate, where the driver
  // allows (else the graph is replayed as it is).
  std::unique_ptr<kernels::GatedGraph> gated;

  // Every slot's block at its cached length, `starts` (int64 [slots], device), and with `last`
  // each block's first token: device work only, so that a late step captures it.
  void place(const at::Tensor& starts, const at::Tensor& last = {}) {
    kernels::place_blocks(starts, offsets, base_rows,
                          {batch.positions, batch.rows, batch.seen,
                           batch.per_token_attention() ? batch.token_seen : at::Tensor(),
                           batch.per_token_attention() ? batch.block_seen : at::Tensor()},
                          last, last.defined() ? tokens : at::Tensor());
  }
};

bool SpeculativeDecoder::captures_whole_step() const { return graph_ && whole_step_; }

at::Tensor SpeculativeDecoder::whole_step(const AppendBatch& batch, const at::Tensor& tokens,
                                          const kernels::SlotAdvance* advance) {
  const int64_t n = batch.size(), bs = drafter_.block_size();
  auto block = tokens.view({n, bs});
  auto drafts = drafter_.draft_at(batch, block.select(1, 0));
  block.narrow(1, 1, bs - 1).copy_(drafts);
  auto out = target_.forward_cached(
      tokens, batch, cache_,
      {.tap_layers = drafter_.tap_layers(), .logits = Logits::kAll, .keep_block_states = true});
  drafter_.write_block(batch, tokens, out.taps.empty() ? at::Tensor() : at::cat(out.taps, 1));
  return kernels::greedy_verdicts(tokens, out.logits.argmax(-1), bs, advance);
}

at::Tensor SpeculativeDecoder::late_step(const AppendBatch& batch, const at::Tensor& tokens) {
  const DeviceSlots& d = device_slots_;
  const kernels::SlotAdvance advance{d.last,           d.length, d.active,
                                     options_.context, d.room,   stop_tokens_};
  return whole_step(batch, tokens, &advance);
}

SpeculativeDecoder::SpeculativeDecoder(const models::TargetModel& target, DraftSource& drafter,
                                       SpeculativeOptions options)
    : target_(target),
      drafter_(drafter),
      options_(std::move(options)),
      cache_(target.make_cache(
          options_.slots,
          resolve_context(target, options_) + verify_rows(target, drafter, options_),
          /*window_span=*/options_.window_rings ? verify_rows(target, drafter, options_) : 0)) {
  if (options_.max_new_tokens <= 0) {
    fail("speculative: --max-new-tokens must be positive, got {}", options_.max_new_tokens);
  }
  if (drafter_.block_size() < 2) {
    fail("speculative: block size must be at least 2, got {}", drafter_.block_size());
  }
  options_.sampling.validate();
  options_.context = resolve_context(target, options_);
  // A hybrid target's verify keeps the linear states after each block token, for the crop to
  // the accepted prefix.
  cache_.keep_block_states(drafter_.block_size());
  drafter_.start(options_.slots, options_.context);
  whole_step_ = options_.whole_step && options_.sampling.greedy() && drafter_.capturable() &&
                options_.tree_budget == 0;
  late_ = whole_step_ && options_.late_verdicts && !target_.config().is_hybrid();
  if (late_) {
    auto zeros = [&] {
      return at::zeros({options_.slots}, at::dtype(at::kLong).device(target_.device()));
    };
    device_slots_ = {zeros(), zeros(), zeros(), zeros()};
    stop_tokens_ = upload_to(target_.device(), at::tensor(options_.stop_tokens, at::kLong));
  }
  // gpt-oss' sink attention over a tree takes the per-entry path, whose shapes follow the
  // cache lengths: its trees verify eagerly.
  const bool capturable = options_.tree_budget == 0 || target_.gpt_oss() == nullptr;
  if (options_.cuda_graph && cuda_graph_capable(target_) && capturable) capture_graph();
  if (options_.cuda_graph && PrefillGraphs::supported(target_)) {
    PrefillGraphs::ContextFn context;
    if (drafter_.capturable()) {
      context = [this](const AppendBatch& batch, const at::Tensor& tokens,
                       const at::Tensor& features) {
        drafter_.write_block(batch, tokens, features);
      };
    }
    // A capturable source's context cache holds the context and one block per slot.
    prefill_ =
        std::make_shared<PrefillGraphs>(target_, cache_, drafter_.tap_layers(), std::move(context),
                                        options_.context + drafter_.block_size());
  }
}

void SpeculativeDecoder::capture_graph() {
  const int64_t n = cache_.slots(), budget = options_.tree_budget;
  // Trees: every slot verifies budget + 1 nodes (the captured shape); their layout (positions,
  // rows, mask) is rewritten before each replay, captured here as chains.
  const int64_t bs = budget > 0 ? budget + 1 : drafter_.block_size();
  auto g = std::make_shared<Graph>();
  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  if (budget > 0) {
    std::vector<int64_t> chain(bs);
    std::iota(chain.begin(), chain.end(), -1);
    g->batch = AppendBatch::make_tree(cache_, all, std::vector(n, chain));
  } else {
    g->batch = AppendBatch::make(cache_, all, std::vector<int64_t>(n, bs));
  }
  g->batch.max_seen = cache_.capacity();  // the kernel's bound for any length replayed later
  // Captured with every slot empty: positions are the offsets in the block, rows the slot's
  // first rows plus those.
  g->offsets = g->batch.positions.clone();
  g->base_rows = g->batch.rows - g->offsets;
  g->tokens = at::zeros({n * bs}, g->offsets.options());
  const models::ForwardRequest request{
      .tap_layers = drafter_.tap_layers(), .logits = Logits::kAll, .keep_block_states = true};
  capture_cuda_graph(
      g->graph, target_.device(),
      [&] {
        if (late_) {
          g->place(device_slots_.length, device_slots_.last);
          g->verdicts = late_step(g->batch, g->tokens);
          return;
        }
        if (whole_step_) {
          g->verdicts = whole_step(g->batch, g->tokens);
          return;
        }
        auto out = target_.forward_cached(g->tokens, g->batch, cache_, request);
        g->logits = out.logits;
        g->choices = out.logits.argmax(-1);
        g->taps = out.taps;
      },
      [&] {
        for (int64_t s = 0; s < n; ++s) cache_.reset(s);
      });
  if (late_) {
    try {
      g->gated = std::make_unique<kernels::GatedGraph>(g->graph, device_slots_.active,
                                                       g->verdicts.narrow(0, n * bs, n));
    } catch (const Error& e) {
      fmt::print(stderr, "speculative: steps run ungated ({})\n", e.what());
    }
  }
  graph_ = std::move(g);
}

// One run(): the slots, each slot's newest committed token and the counts, with the steps it
// takes (admission and prefill, drafts, the three step policies and their verdicts) over the
// decoder's target, draft source and cache.
class SpeculativeDecoder::Session {
 public:
  Session(SpeculativeDecoder& decoder, const Generator::NextFn& next,
          const Generator::DoneFn& done);
  SpeculativeStats run();

 private:
  // One verify pass: host copies of the block tokens, where each active slot's block sits
  // among them, and per active slot the drafts accepted and the target's token after them.
  struct Verified {
    std::vector<int64_t> tokens;
    std::vector<int64_t> offsets, starts;  // per active slot
    std::vector<int64_t> accepted, next;   // per active slot
    // Tree verification: per active slot, the accepted nodes (their indices in its block, the
    // root being 0); empty for chains, whose accepted drafts are tokens 1..accepted.
    std::vector<std::vector<int64_t>> paths;
    std::vector<at::Tensor> taps;
    bool context_written = false;  // the drafter holds the block's context, to be counted
  };

  at::Tensor upload(const at::Tensor& t) const { return upload_to(device_, t); }
  static std::vector<int64_t> to_host(const at::Tensor& t) {
    auto h = t.to(at::kCPU, at::kLong).contiguous();
    return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
  }
  at::Tensor features_at(const std::vector<at::Tensor>& tapped,
                         const std::vector<int64_t>& rows) const;
  // Commits one generated token; false once the sequence has finished.
  bool commit(int64_t slot, int64_t token);
  // Draws of `stream` for tokens first[i], first[i] + 1, ... (`count` of them) of active
  // slot i's request: float64 [n, count] on the device.
  at::Tensor draws(const std::vector<int64_t>& active, const std::vector<int64_t>& first,
                   int64_t count, DrawStream stream) const;
  // Prefill of newly admitted requests, packed up to prefill_tokens: the drafter context of
  // their prompts; returns their first tokens, int64 [group] on the device.
  at::Tensor prefill(const std::vector<int64_t>& group);
  // A prompt admitted alone through the decoder's prefill graphs: the logits after it.
  at::Tensor prefill_alone(int64_t slot, const std::vector<int64_t>& prompt);
  // The first tokens of `group` from the logits after their prompts.
  at::Tensor first_token(const std::vector<int64_t>& group, const at::Tensor& logits) const;
  // Fills free slots; true if it took any request (which may have finished at once).
  bool admit();
  // Commits the accepted drafts of `slot`'s block (token(j): the block's token j) and then
  // `next`, up to where its sequence finishes; counts the step. Returns whether it goes on.
  bool commit_block(int64_t slot, int64_t accepted, const std::function<int64_t(int64_t)>& token,
                    int64_t next);

  // Late whole steps (reads_verdicts_late): a step's first tokens of the requests admitted
  // before it and its verdicts, each tagged with its slot and admission serial (those of a
  // sequence that has finished meanwhile are dropped).
  struct LateStep {
    std::vector<at::Tensor> firsts;                      // per prefill group, on the device
    std::vector<std::pair<int64_t, uint64_t>> admitted;  // (slot, serial) per first token
    std::vector<std::pair<int64_t, uint64_t>> stepped;   // the slots the step decoded
    at::Tensor verdicts;                                 // late_step's; undefined: no step
    HostReadback host;
  };
  void run_late();
  // admit(), the first tokens and the admitted slots' state going to the device.
  bool admit_late(LateStep& step);
  // The whole step of every slot from the device state: replayed, or eager with the cache's
  // host lengths set from the device's.
  void launch_late(LateStep& step);
  // The commits of a step launched before the last; the slots found finished stop on the
  // device.
  void process_late(LateStep& step);
  // The drafts of the active slots (their newest committed tokens `last`), with their
  // distributions when sampling.
  SampledDraft draft(const std::vector<int64_t>& active, const std::vector<int64_t>& last);
  // Greedy: draft j+1 is accepted while it equals the target's choice after block token j
  // (choices[offsets[i] + j]); the choice after the accepted ones is the bonus token.
  static void greedy_verdict(Verified& v, const std::vector<int64_t>& choices,
                             const std::vector<int64_t>& counts);
  // Sampling: speculative_verdict on the target's distributions after each block token
  // (logits rows rows[i*B + j], B per slot: a block cut to b tokens repeats its last row) and
  // the drafts' distributions. Returns accepted counts and next tokens, on the device.
  at::Tensor sampled_verdict(const std::vector<int64_t>& active, const at::Tensor& logits,
                             const std::vector<int64_t>& rows, const std::vector<int64_t>& counts,
                             const SampledDraft& d) const;
  static void split_verdict(Verified& v, const std::vector<int64_t>& both);
  // Eager: one packed forward over the active slots, each block cut to what its limits still
  // allow.
  Verified verify_eager(const std::vector<int64_t>& active, const std::vector<int64_t>& last);
  // The captured pass: every slot runs a whole block (commits still stop at the limits); the
  // drafts go into the graph's input on the device, and one copy brings tokens and verdicts
  // back. The replay leaves the cache's host lengths as they were: they grow by the block here,
  // as forward_cached's do.
  Verified verify_graph(const std::vector<int64_t>& active, const std::vector<int64_t>& last);
  // A whole step (SpeculativeDecoder::whole_step): captured, over every slot, the host writing
  // each slot's last token and positions into the graph; else over the active slots. One copy
  // brings the block tokens and verdicts back.
  Verified step_whole(const std::vector<int64_t>& active);
  // Tree verification: a draft tree per active slot from the source's distributions, one target
  // pass over all of them, and each slot's path walked by the target's own choices (greedy, or
  // drawn with the token draws plain decoding uses at those indices).
  Verified verify_tree(const std::vector<int64_t>& active, const std::vector<int64_t>& last);
  // One draft and one verify pass for every occupied slot; false when none is occupied.
  bool step();

  SpeculativeDecoder& d_;
  const models::TargetModel& target_;
  DraftSource& drafter_;
  models::KVCache& cache_;
  const SamplingParams& sampling_;
  const at::Device device_;
  const at::TensorOptions long_opts_ = at::TensorOptions().dtype(at::kLong);
  const int64_t n_slots_, bs_;
  const std::vector<int64_t> taps_;
  SlotScheduler slots_;
  std::vector<int64_t> last_token_;  // per slot: the newest committed token, not run yet
  SpeculativeStats stats_;
};

SpeculativeDecoder::Session::Session(SpeculativeDecoder& decoder, const Generator::NextFn& next,
                                     const Generator::DoneFn& done)
    : d_(decoder),
      target_(decoder.target_),
      drafter_(decoder.drafter_),
      cache_(decoder.cache_),
      sampling_(decoder.options_.sampling),
      device_(decoder.target_.device()),
      n_slots_(decoder.cache_.slots()),
      bs_(decoder.drafter_.block_size()),
      taps_(decoder.drafter_.tap_layers()),
      slots_(n_slots_,
             {decoder.options_.context, decoder.options_.max_new_tokens,
              decoder.options_.prefill_tokens, decoder.options_.stop_tokens},
             next, done, "speculative"),
      last_token_(n_slots_, 0) {
  stats_.committed.assign(bs_ + 1, 0);
}

SpeculativeStats SpeculativeDecoder::Session::run() {
  const auto t0 = std::chrono::steady_clock::now();
  if (d_.late_) {
    run_late();
  } else {
    for (;;) {
      // Requests that finish in their prefill leave their slots free for more at once.
      const bool took = admit();
      if (!step() && !took) break;
      if (d_.options_.progress) d_.options_.progress(slots_.progress());
    }
  }
  slots_.close_run(stats_, t0);
  return stats_;
}

// Step k's verdicts are read after step k + 1 is launched; a slot whose sequence step k
// finished runs step k + 1 for nothing.
void SpeculativeDecoder::Session::run_late() {
  LateStep pending;  // the previous iteration's, when has_pending
  bool has_pending = false;
  for (;;) {
    LateStep step;
    const bool took = admit_late(step);
    launch_late(step);
    std::vector<at::Tensor> parts = step.firsts;
    if (step.verdicts.defined()) parts.push_back(step.verdicts);
    const bool launched = !parts.empty();
    if (launched) step.host.send(parts, device_);
    const bool processed = has_pending;
    if (has_pending) {
      process_late(pending);
      if (d_.options_.progress) d_.options_.progress(slots_.progress());
    }
    has_pending = launched;
    if (launched) {
      pending = std::move(step);
    } else if (!processed && !took) {
      break;
    }
  }
}

bool SpeculativeDecoder::Session::admit_late(LateStep& step) {
  DeviceSlots& d = d_.device_slots_;
  return slots_.admit([&](int64_t slot) { cache_.reset(slot); },
                      [&](const std::vector<int64_t>& group) {
                        auto first = prefill(group).to(at::kLong);
                        std::vector<int64_t> state;  // lengths, then room, then activity
                        for (int64_t slot : group) {
                          state.push_back(slots_[slot].prompt_length());
                          step.admitted.emplace_back(slot, slots_[slot].serial);
                        }
                        // The first token is kept unless it is a stop token, which the host
                        // then finds (the device steps the slot once for nothing); a request
                        // of one token has no step at all.
                        for (int64_t slot : group) state.push_back(slots_.max_tokens(slot) - 1);
                        for (int64_t slot : group) state.push_back(slots_.max_tokens(slot) > 1);
                        const int64_t n = std::ssize(group);
                        auto index = upload(at::tensor(group, long_opts_));
                        auto values = upload(at::tensor(state, long_opts_));
                        d.last.index_copy_(0, index, first);
                        d.length.index_copy_(0, index, values.narrow(0, 0, n));
                        d.room.index_copy_(0, index, values.narrow(0, n, n));
                        d.active.index_copy_(0, index, values.narrow(0, 2 * n, n));
                        step.firsts.push_back(first);
                      });
}

void SpeculativeDecoder::Session::launch_late(LateStep& step) {
  const std::vector<int64_t> active = slots_.occupied();
  if (active.empty()) return;
  for (int64_t slot : active) step.stepped.emplace_back(slot, slots_[slot].serial);
  if (d_.graph_) {
    if (d_.graph_->gated) {
      d_.graph_->gated->launch();
    } else {
      d_.graph_->graph.replay();
    }
    step.verdicts = d_.graph_->verdicts;
    return;
  }
  const auto lengths = to_host(d_.device_slots_.length);
  std::vector<int64_t> all(n_slots_);
  std::iota(all.begin(), all.end(), 0);
  for (int64_t slot : all) {
    const int64_t have = cache_.length(slot), want = lengths[slot];
    if (want < have) cache_.crop(slot, want);
    if (want > have) cache_.extend(slot, want - have);
  }
  auto tokens = at::zeros({n_slots_, bs_}, long_opts_.device(device_));
  tokens.select(1, 0).copy_(d_.device_slots_.last);
  step.verdicts = d_.late_step(AppendBatch::make(cache_, all, std::vector<int64_t>(n_slots_, bs_)),
                               tokens.view(-1));
}

void SpeculativeDecoder::Session::process_late(LateStep& step) {
  const int64_t* values = step.host.wait();
  auto current = [&](int64_t slot, uint64_t serial) {
    return slots_[slot].occupied && slots_[slot].serial == serial;
  };
  std::vector<int64_t> finished;
  for (size_t i = 0; i < step.admitted.size(); ++i) {
    const auto [slot, serial] = step.admitted[i];
    if (current(slot, serial) && !commit(slot, values[i])) finished.push_back(slot);
  }
  // Verdicts: every slot's block tokens, then its accepted drafts, then its next tokens.
  const int64_t* block = values + step.admitted.size();
  const int64_t* accepted = block + n_slots_ * bs_;
  const int64_t* next = accepted + n_slots_;
  for (const auto& [slot, serial] : step.stepped) {
    if (!current(slot, serial)) continue;
    if (accepted[slot] < 0) {
      fail(
          "speculative: the device skipped a step of slot {} (request {}), which it found "
          "finished before the host did: the device's stop rules disagree with SlotScheduler's",
          slot, slots_[slot].request.id);
    }
    const int64_t* tokens = block + slot * bs_;
    if (commit_block(
            slot, accepted[slot], [&](int64_t j) { return tokens[j]; }, next[slot])) {
      drafter_.count_block(slot, accepted[slot] + 1);
    } else {
      finished.push_back(slot);
    }
  }
  if (finished.empty()) return;
  auto index = upload(at::tensor(finished, long_opts_));
  d_.device_slots_.active.index_fill_(0, index, 0);
  d_.device_slots_.length.index_fill_(0, index, 0);
}

at::Tensor SpeculativeDecoder::Session::features_at(const std::vector<at::Tensor>& tapped,
                                                    const std::vector<int64_t>& rows) const {
  if (tapped.empty() || rows.empty()) return at::Tensor();
  auto index = upload(at::tensor(rows, long_opts_));
  std::vector<at::Tensor> parts;
  for (const auto& t : tapped) parts.push_back(t.index_select(0, index));
  return at::cat(parts, 1);
}
// Commits one generated token; false once the sequence has finished.
bool SpeculativeDecoder::Session::commit(int64_t slot, int64_t token) {
  last_token_[slot] = token;
  return slots_.commit(slot, token);
}

// Draws of `stream` for tokens first[i], first[i] + 1, ... (`count` of them) of active
// slot i's request: float64 [n, count] on the device.
at::Tensor SpeculativeDecoder::Session::draws(const std::vector<int64_t>& active,
                                              const std::vector<int64_t>& first, int64_t count,
                                              DrawStream stream) const {
  std::vector<double> u;
  for (size_t i = 0; i < active.size(); ++i) {
    for (int64_t j = 0; j < count; ++j) {
      u.push_back(sampling_uniform(sampling_.seed, slots_[active[i]].request.id,
                                   static_cast<uint64_t>(first[i] + j), stream));
    }
  }
  return upload(at::tensor(u, at::kDouble).view({static_cast<int64_t>(active.size()), count}));
}

// Prefill of newly admitted requests, packed up to prefill_tokens: their first tokens and
// the drafter context of their prompts.
at::Tensor SpeculativeDecoder::Session::prefill(const std::vector<int64_t>& group) {
  const auto& alone = slots_[group[0]].request.prompt;
  if (group.size() == 1 && d_.prefill_ && d_.prefill_->serves(std::ssize(alone))) {
    return first_token(group, prefill_alone(group[0], alone));
  }
  std::vector<int64_t> counts;
  std::vector<at::Tensor> prompts;
  std::vector<std::span<const int64_t>> spans;
  for (int64_t slot : group) {
    const auto& p = slots_[slot].request.prompt;
    counts.push_back(static_cast<int64_t>(p.size()));
    prompts.push_back(at::tensor(p, long_opts_));
    spans.emplace_back(p);
    drafter_.reset(slot);
  }
  auto batch = AppendBatch::make(cache_, group, counts);
  auto out =
      target_.forward_cached(upload(at::cat(prompts)), batch, cache_, {taps_, Logits::kLast});
  ++stats_.prefill_forwards;
  drafter_.extend(group, spans, out.taps.empty() ? at::Tensor() : at::cat(out.taps, 1));
  return first_token(group, out.logits);
}

at::Tensor SpeculativeDecoder::Session::prefill_alone(int64_t slot,
                                                      const std::vector<int64_t>& prompt) {
  drafter_.reset(slot);
  const auto out = d_.prefill_->run(slot, prompt);
  ++stats_.prefill_forwards;
  if (drafter_.capturable()) {
    drafter_.count_block(slot, std::ssize(prompt));
  } else {
    drafter_.extend({slot}, {std::span<const int64_t>(prompt)}, out.features);
  }
  return out.logits;
}

at::Tensor SpeculativeDecoder::Session::first_token(const std::vector<int64_t>& group,
                                                    const at::Tensor& logits) const {
  // Token 0 as the plain decoder draws it.
  if (sampling_.greedy()) return logits.argmax(-1);
  return sample_tokens(
      logits, sampling_,
      draws(group, std::vector<int64_t>(group.size(), 0), 1, DrawStream::kToken).view(-1));
}
// Fills free slots_; true if it took any request (which may have finished at once).
bool SpeculativeDecoder::Session::admit() {
  return slots_.admit([&](int64_t slot) { cache_.reset(slot); },
                      [&](const std::vector<int64_t>& group) {
                        const auto first = to_host(prefill(group));
                        for (size_t i = 0; i < group.size(); ++i) commit(group[i], first[i]);
                      });
}

bool SpeculativeDecoder::Session::commit_block(int64_t slot, int64_t accepted,
                                               const std::function<int64_t(int64_t)>& token,
                                               int64_t next) {
  ++stats_.verify_steps;
  int64_t committed = 0;
  bool going = true;
  for (int64_t j = 0; j <= accepted && going; ++j) {
    going = commit(slot, j < accepted ? token(j + 1) : next);
    ++committed;
  }
  ++stats_.committed[committed];
  return going;
}

// The drafts of the active slots_ (their newest committed tokens `last`), with their
// distributions when sampling.
SampledDraft SpeculativeDecoder::Session::draft(const std::vector<int64_t>& active,
                                                const std::vector<int64_t>& last) {
  if (sampling_.greedy()) return SampledDraft{drafter_.draft(active, last), {}};
  // Draft j (1-based) of a slot with g committed tokens is its token g - 1 + j.
  std::vector<int64_t> first;
  for (int64_t slot : active) first.push_back(slots_[slot].generated());
  auto d = drafter_.draft_sampled(active, last, sampling_,
                                  draws(active, first, bs_ - 1, DrawStream::kDraft));
  d.tokens = d.tokens.to(device_, at::kLong);
  d.probs = d.probs.defined() ? d.probs.to(device_)
                              : at::one_hot(d.tokens, target_.config().vocab_size).to(at::kFloat);
  return d;
}

// Greedy: draft j+1 is accepted while it equals the target's choice after block token j
// (choices[offsets[i] + j]); the choice after the accepted ones is the bonus token.
void SpeculativeDecoder::Session::greedy_verdict(Verified& v, const std::vector<int64_t>& choices,
                                                 const std::vector<int64_t>& counts) {
  for (size_t i = 0; i < counts.size(); ++i) {
    const int64_t offset = v.offsets[i];
    int64_t accepted = 0;
    while (accepted < counts[i] - 1 &&
           v.tokens[offset + accepted + 1] == choices[offset + accepted]) {
      ++accepted;
    }
    v.accepted.push_back(accepted);
    v.next.push_back(choices[offset + accepted]);
  }
}
// Sampling: speculative_verdict on the target's distributions after each block token
// (logits rows rows[i*B + j], B per slot: a block cut to b tokens repeats its last row) and
// the drafts' distributions. Returns accepted counts and next tokens, on the device.
at::Tensor SpeculativeDecoder::Session::sampled_verdict(const std::vector<int64_t>& active,
                                                        const at::Tensor& logits,
                                                        const std::vector<int64_t>& rows,
                                                        const std::vector<int64_t>& counts,
                                                        const SampledDraft& d) const {
  const auto n = static_cast<int64_t>(active.size());
  auto p = sampling_probs(logits.index_select(0, upload(at::tensor(rows, long_opts_))), sampling_)
               .view({n, bs_, -1});
  std::vector<int64_t> tested, first;
  for (size_t i = 0; i < active.size(); ++i) {
    tested.push_back(counts[i] - 1);
    first.push_back(slots_[active[i]].generated());
  }
  // Draft j (1-based) is token g - 1 + j of a slot with g committed tokens; the token after
  // a accepted drafts is token g + a.
  auto accept_u = draws(active, first, bs_ - 1, DrawStream::kAccept);
  auto token_u = draws(active, first, bs_, DrawStream::kToken);
  auto verdict = speculative_verdict(p, d.probs, d.tokens, upload(at::tensor(tested, long_opts_)),
                                     accept_u, token_u);
  return at::cat({verdict.accepted, verdict.next});
}
void SpeculativeDecoder::Session::split_verdict(Verified& v, const std::vector<int64_t>& both) {
  const auto n = static_cast<int64_t>(both.size() / 2);
  v.accepted.assign(both.begin(), both.begin() + n);
  v.next.assign(both.begin() + n, both.end());
}

// Eager: one packed forward over the active slots_, each block cut to what its limits still
// allow.
SpeculativeDecoder::Session::Verified SpeculativeDecoder::Session::verify_eager(
    const std::vector<int64_t>& active, const std::vector<int64_t>& last) {
  const SampledDraft d = draft(active, last);
  const auto drafts = to_host(d.tokens);  // [n, B-1] row-major
  // A hybrid runs whole blocks (commits still stop at the limits): a pass that keeps the
  // per-token states a crop into the block needs takes equal blocks.
  const bool whole = target_.config().is_hybrid();
  Verified v;
  std::vector<int64_t> counts;
  for (size_t i = 0; i < active.size(); ++i) {
    const int64_t b = whole ? bs_ : std::min(bs_, slots_.room(active[i]));
    v.offsets.push_back(static_cast<int64_t>(v.tokens.size()));
    counts.push_back(b);
    v.tokens.push_back(last_token_[active[i]]);
    v.tokens.insert(v.tokens.end(), drafts.begin() + i * (bs_ - 1),
                    drafts.begin() + i * (bs_ - 1) + (b - 1));
  }
  auto batch = AppendBatch::make(cache_, active, counts);
  v.starts = batch.starts;
  auto out = target_.forward_cached(
      upload(at::tensor(v.tokens, long_opts_)), batch, cache_,
      {.tap_layers = taps_, .logits = Logits::kAll, .keep_block_states = true});
  if (sampling_.greedy()) {
    greedy_verdict(v, to_host(out.logits.argmax(-1)), counts);
  } else {
    std::vector<int64_t> rows;
    for (size_t i = 0; i < active.size(); ++i) {
      for (int64_t j = 0; j < bs_; ++j) rows.push_back(v.offsets[i] + std::min(j, counts[i] - 1));
    }
    split_verdict(v, to_host(sampled_verdict(active, out.logits, rows, counts, d)));
  }
  v.taps = std::move(out.taps);
  return v;
}
// The captured pass: every slot runs a whole block (commits still stop at the limits); the
// drafts go into the graph's input on the device, and one copy brings tokens and verdicts
// back. The replay leaves the cache's host lengths as they were: they grow by the block here,
// as forward_cached's do.
SpeculativeDecoder::Session::Verified SpeculativeDecoder::Session::verify_graph(
    const std::vector<int64_t>& active, const std::vector<int64_t>& last) {
  Graph& g = *d_.graph_;
  const SampledDraft d = draft(active, last);
  std::vector<int64_t> starts(n_slots_, 0), lasts(n_slots_, 0);
  for (size_t i = 0; i < active.size(); ++i) {
    starts[active[i]] = cache_.length(active[i]);
    lasts[active[i]] = last[i];
  }
  g.place(upload(at::tensor(starts, long_opts_)));
  auto block = g.tokens.view({n_slots_, bs_});
  block.select(1, 0).copy_(upload(at::tensor(lasts, long_opts_)));
  block.narrow(1, 1, bs_ - 1)
      .index_copy_(0, upload(at::tensor(active, long_opts_)), d.tokens.to(device_, at::kLong));
  g.graph.replay();
  for (int64_t slot : active) cache_.extend_block(slot, bs_);
  Verified v;
  for (int64_t slot : active) {
    v.offsets.push_back(slot * bs_);
    v.starts.push_back(starts[slot]);
  }
  const std::vector<int64_t> counts(active.size(), bs_);
  if (sampling_.greedy()) {
    const auto both = to_host(at::cat({g.tokens, g.choices}));
    v.tokens.assign(both.begin(), both.begin() + n_slots_ * bs_);
    greedy_verdict(v, std::vector<int64_t>(both.begin() + n_slots_ * bs_, both.end()), counts);
  } else {
    std::vector<int64_t> rows;
    for (int64_t slot : active) {
      for (int64_t j = 0; j < bs_; ++j) rows.push_back(slot * bs_ + j);
    }
    const auto all =
        to_host(at::cat({g.tokens, sampled_verdict(active, g.logits, rows, counts, d)}));
    v.tokens.assign(all.begin(), all.begin() + n_slots_ * bs_);
    split_verdict(v, std::vector<int64_t>(all.begin() + n_slots_ * bs_, all.end()));
  }
  v.taps = g.taps;
  return v;
}

// A whole step (whole_step()): captured, over every slot, the host writing each slot's last
// token and positions into the graph; else over the active slots. One copy brings the block
// tokens and verdicts back.
SpeculativeDecoder::Session::Verified SpeculativeDecoder::Session::step_whole(
    const std::vector<int64_t>& active) {
  std::vector<int64_t> order = active;
  if (d_.graph_) {
    order.resize(n_slots_);
    std::iota(order.begin(), order.end(), 0);
  }
  const auto n = static_cast<int64_t>(order.size());
  std::vector<int64_t> starts, lasts;
  for (int64_t slot : order) {
    // An idle slot (captured) runs at position 0 of its rows, whatever its stale length.
    const bool occupied = slots_[slot].occupied;
    starts.push_back(occupied ? cache_.length(slot) : 0);
    lasts.push_back(occupied ? last_token_[slot] : 0);
  }
  at::Tensor verdicts;
  if (d_.graph_) {
    d_.graph_->place(upload(at::tensor(starts, long_opts_)));
    d_.graph_->tokens.view({n, bs_}).select(1, 0).copy_(upload(at::tensor(lasts, long_opts_)));
    d_.graph_->graph.replay();
    for (int64_t slot : active) cache_.extend_block(slot, bs_);
    verdicts = d_.graph_->verdicts;
  } else {
    auto tokens = at::zeros({n, bs_}, long_opts_.device(device_));
    tokens.select(1, 0).copy_(upload(at::tensor(lasts, long_opts_)));
    verdicts = d_.whole_step(AppendBatch::make(cache_, order, std::vector<int64_t>(n, bs_)),
                             tokens.view(-1));
  }
  const auto all = to_host(verdicts);
  Verified v;
  v.tokens.assign(all.begin(), all.begin() + n * bs_);
  for (int64_t i = 0; i < n; ++i) {
    if (!slots_[order[i]].occupied) continue;
    v.offsets.push_back(i * bs_);
    v.starts.push_back(starts[i]);
    v.accepted.push_back(all[n * bs_ + i]);
    v.next.push_back(all[n * bs_ + n + i]);
  }
  v.context_written = true;
  return v;
}

SpeculativeDecoder::Session::Verified SpeculativeDecoder::Session::verify_tree(
    const std::vector<int64_t>& active, const std::vector<int64_t>& last) {
  const int64_t budget = d_.options_.tree_budget, vocab = target_.config().vocab_size;
  auto probs = drafter_.draft_probs(active, last, vocab).to(at::kFloat);
  auto [top_probs, top_tokens] = probs.topk(std::min(budget, vocab), -1);
  top_probs = top_probs.cpu();
  top_tokens = top_tokens.cpu();
  // Captured, every slot runs budget + 1 nodes: an idle slot (emptied, at position 0) a root,
  // and a tree with fewer (zero-probability tokens) more children of its root, which the walk
  // may take like any node: what it commits is the target's own choice either way.
  const bool captured = d_.graph_ != nullptr;
  std::vector<int64_t> order = active;
  if (captured) {
    order.resize(n_slots_);
    std::iota(order.begin(), order.end(), 0);
  }
  std::vector<DraftTree> trees;
  std::vector<std::vector<int64_t>> parents;
  Verified v;
  for (size_t i = 0, a = 0; i < order.size(); ++i) {
    const bool occupied = a < active.size() && active[a] == order[i];
    if (occupied) {
      const auto row = static_cast<int64_t>(a);
      trees.push_back(build_draft_tree(last[a++], top_probs[row], top_tokens[row], budget));
      v.offsets.push_back(static_cast<int64_t>(v.tokens.size()));
    } else {
      cache_.reset(order[i]);
      trees.push_back(DraftTree{{0}, {-1}, {0}});
    }
    DraftTree& t = trees.back();
    while (captured && t.size() < budget + 1) {
      t.tokens.push_back(0);
      t.parents.push_back(0);
      t.depths.push_back(1);
    }
    v.tokens.insert(v.tokens.end(), t.tokens.begin(), t.tokens.end());
    parents.push_back(t.parents);
  }
  auto batch = AppendBatch::make_tree(cache_, order, parents);
  auto tokens = upload(at::tensor(v.tokens, long_opts_));
  at::Tensor logits, argmax;
  if (captured) {
    Graph& g = *d_.graph_;
    g.tokens.copy_(tokens);
    g.batch.positions.copy_(batch.positions);
    g.batch.rows.copy_(batch.rows);
    g.batch.seen.copy_(batch.seen);
    g.batch.tree_mask.copy_(batch.tree_mask);
    g.graph.replay();
    for (int64_t slot : order) cache_.extend(slot, budget + 1);
    logits = g.logits;
    argmax = g.choices;
    v.taps = g.taps;
  } else {
    auto out = target_.forward_cached(tokens, batch, cache_,
                                      {.tap_layers = taps_, .logits = Logits::kAll});
    logits = out.logits;
    argmax = sampling_.greedy() ? logits.argmax(-1) : at::Tensor();
    v.taps = std::move(out.taps);
  }
  at::Tensor choices = argmax;
  if (!sampling_.greedy()) {
    // The token after a node at depth d is token generated + d of the request (an idle slot
    // draws for an empty request: nothing reads it).
    std::vector<double> u;
    for (size_t i = 0; i < order.size(); ++i) {
      const auto& s = slots_[order[i]];
      for (int64_t depth : trees[i].depths) {
        u.push_back(sampling_uniform(sampling_.seed, s.request.id,
                                     static_cast<uint64_t>(s.generated() + depth),
                                     DrawStream::kToken));
      }
    }
    choices = sample_tokens(logits, sampling_, upload(at::tensor(u, at::kDouble)));
  }
  const auto chosen = to_host(choices);
  for (size_t i = 0, a = 0, offset = 0; i < order.size(); offset += trees[i++].size()) {
    if (a == active.size() || active[a] != order[i]) continue;
    auto path = trees[i].walk(std::span(chosen).subspan(offset, trees[i].size()));
    v.starts.push_back(batch.starts[i]);
    v.accepted.push_back(static_cast<int64_t>(path.size()));
    v.next.push_back(chosen[offset + (path.empty() ? 0 : path.back())]);
    v.paths.push_back(std::move(path));
    ++a;
  }
  return v;
}

// One draft and one verify pass for every occupied slot.
bool SpeculativeDecoder::Session::step() {
  const std::vector<int64_t> active = slots_.occupied();
  if (active.empty()) return false;
  std::vector<int64_t> last;
  for (int64_t slot : active) last.push_back(last_token_[slot]);
  const Verified v = d_.options_.tree_budget > 0 ? verify_tree(active, last)
                     : d_.whole_step_            ? step_whole(active)
                     : d_.graph_                 ? verify_graph(active, last)
                                                 : verify_eager(active, last);
  std::vector<int64_t> extend_slots, feature_rows, move_from, move_to;
  // Per active slot, the tokens the target ran that are committed: the block's first token and
  // the accepted drafts.
  std::vector<std::vector<int64_t>> ran(active.size());
  std::vector<std::span<const int64_t>> extend_tokens;
  for (size_t i = 0; i < active.size(); ++i) {
    const int64_t slot = active[i], offset = v.offsets[i], accepted = v.accepted[i];
    // Block index of the committed token j (0: the block's first; then the accepted drafts).
    auto node = [&](int64_t j) { return j == 0 || v.paths.empty() ? j : v.paths[i][j - 1]; };
    const bool going = commit_block(
        slot, accepted, [&](int64_t j) { return v.tokens[offset + node(j)]; }, v.next[i]);
    if (going) {
      // The target ran the block's token and its accepted drafts with the right inputs:
      // the cache keeps those (a tree's moved to the rows after the root; a hybrid's linear
      // states those after them), and their features are the drafter's new context.
      const int64_t first_row = slot * cache_.capacity() + v.starts[i];
      for (int64_t j = 1; j <= accepted; ++j) {
        if (node(j) == j) continue;
        move_from.push_back(first_row + node(j));
        move_to.push_back(first_row + j);
      }
      cache_.crop(slot, v.starts[i] + accepted + 1);
      if (v.context_written) {
        drafter_.count_block(slot, accepted + 1);
        continue;
      }
      extend_slots.push_back(slot);
      for (int64_t j = 0; j <= accepted; ++j) {
        ran[i].push_back(v.tokens[offset + node(j)]);
        feature_rows.push_back(offset + node(j));
      }
      extend_tokens.emplace_back(ran[i]);
    }
  }
  if (!move_from.empty()) {
    cache_.move_rows(upload(at::tensor(move_from, long_opts_)),
                     upload(at::tensor(move_to, long_opts_)));
  }
  if (!extend_slots.empty()) {
    drafter_.extend(extend_slots, extend_tokens, features_at(v.taps, feature_rows));
  }
  return true;
}

SpeculativeStats SpeculativeDecoder::run(const Generator::NextFn& next,
                                         const Generator::DoneFn& done) {
  c10::NoGradGuard no_grad;
  // The graph replays on the current device's stream: make it the model's (a rank's
  // cuda:LOCAL_RANK need not be current).
  std::optional<c10::cuda::CUDAGuard> device_guard;
  if (target_.device().is_cuda()) device_guard.emplace(target_.device());
  return Session(*this, next, done).run();
}

std::vector<Completion> SpeculativeDecoder::generate(
    const std::vector<std::vector<int64_t>>& prompts, SpeculativeStats* stats, uint64_t first_id) {
  std::vector<Completion> out;
  auto s = run_prompts(
      prompts, out,
      [&](const Generator::NextFn& next, const Generator::DoneFn& done) { return run(next, done); },
      first_id);
  if (stats != nullptr) *stats = s;
  return out;
}

}  // namespace dflash::eval
