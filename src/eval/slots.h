// eval: generation and speculative decoding with the target and drafter. This file: the slot
// scheduler both decoders share (continuous batching). A fixed number of slots each hold one
// sequence; admit() fills free slots from the request queue and packs the new prompts into
// prefill groups, commit() appends a generated token and finishes the sequence at a stop
// token, the token limit or the context limit, handing its completion to `done` and freeing
// the slot for the next admit(). The step policy (Generator: one sampled token per slot, read
// one step late; SpeculativeDecoder: a drafted block verified per slot) stays with its decoder.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "eval/generator.h"

namespace dflash::eval {

struct SlotLimits {
  int64_t context = 0;         // prompt + generated tokens at most
  int64_t max_new_tokens = 0;  // generated tokens per request, stop token included
  int64_t prefill_tokens = 0;  // prompt tokens per prefill group (one prompt at least)
  std::vector<int64_t> stop_tokens;
};

class SlotScheduler {
 public:
  struct Slot {
    bool occupied = false;
    uint64_t serial = 0;  // which admission the slot holds (tokens in flight carry it)
    Request request;
    Completion completion;
    int64_t prompt_length() const { return static_cast<int64_t>(request.prompt.size()); }
    int64_t generated() const { return static_cast<int64_t>(completion.tokens.size()); }
  };

  // `who` names the decoder in errors ("generation", "speculative").
  SlotScheduler(int64_t slots, SlotLimits limits, const Generator::NextFn& next,
                const Generator::DoneFn& done, const char* who);

  // Fills every free slot it can from `next`: a request whose prompt leaves no room for one
  // token finishes at once (kContext); the others are `admitted(slot)` and gathered into
  // groups of at most prefill_tokens prompt tokens, each handed to `prefill(slots)` in slot
  // order. Returns whether it took any request.
  bool admit(const std::function<void(int64_t slot)>& admitted,
             const std::function<void(const std::vector<int64_t>& group)>& prefill);

  // Appends `token` to `slot`'s completion; returns false once that has finished the sequence
  // (a stop token, which is counted but not kept, the token limit or the context limit).
  bool commit(int64_t slot, int64_t token);

  // Tokens `slot`'s request may generate in all, and may still generate, before a limit
  // finishes it.
  int64_t max_tokens(int64_t slot) const;
  int64_t room(int64_t slot) const { return max_tokens(slot) - slots_[slot].generated(); }

  // The occupied slots, in order.
  std::vector<int64_t> occupied() const;

  // Fails naming a request that is still unfinished (a decoder that returned too early).
  void check_all_finished() const;
  // The end of a decoder's run: check_all_finished, then the run's counts and its seconds since
  // `start` into the decoder's stats (GenerationStats, SpeculativeStats).
  template <class Stats>
  void close_run(Stats& stats, std::chrono::steady_clock::time_point start) const {
    check_all_finished();
    stats.requests = requests_;
    stats.prompt_tokens = prompt_tokens_;
    stats.generated_tokens = generated_tokens_;
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  Slot& operator[](int64_t slot) { return slots_[slot]; }
  const Slot& operator[](int64_t slot) const { return slots_[slot]; }
  int64_t size() const { return static_cast<int64_t>(slots_.size()); }
  const SlotLimits& limits() const { return limits_; }

  // Counts for the decoders' stats and progress lines.
  int64_t requests() const { return requests_; }
  int64_t prompt_tokens() const { return prompt_tokens_; }
  int64_t generated_tokens() const { return generated_tokens_; }
  DecodeProgress progress() const;

 private:
  void finish(Slot& s, Finish why);

  std::vector<Slot> slots_;
  SlotLimits limits_;
  const Generator::NextFn& next_;
  const Generator::DoneFn& done_;
  const char* who_;
  uint64_t serial_ = 0;
  int64_t requests_ = 0, prompt_tokens_ = 0, generated_tokens_ = 0;
  int64_t finished_ = 0, finished_tokens_ = 0;
};

}  // namespace dflash::eval
