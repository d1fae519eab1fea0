#include "eval/slots.h"

#include <algorithm>

#include "common/error.h"

namespace dflash::eval {

SlotScheduler::SlotScheduler(int64_t slots, SlotLimits limits, const Generator::NextFn& next,
                             const Generator::DoneFn& done, const char* who)
    : slots_(slots), limits_(std::move(limits)), next_(next), done_(done), who_(who) {}

bool SlotScheduler::admit(const std::function<void(int64_t slot)>& admitted,
                          const std::function<void(const std::vector<int64_t>& group)>& prefill) {
  bool took = false;
  std::vector<int64_t> group;
  int64_t group_tokens = 0;
  for (int64_t i = 0; i < size(); ++i) {
    Slot& s = slots_[i];
    while (!s.occupied) {
      auto request = next_();
      if (!request) break;
      if (request->prompt.empty()) fail("{}: request {} has an empty prompt", who_, request->id);
      took = true;
      const int64_t length = static_cast<int64_t>(request->prompt.size());
      ++requests_;
      prompt_tokens_ += length;
      s.request = std::move(*request);
      s.completion = {};
      if (length >= limits_.context) {  // no room for even one token
        finish(s, Finish::kContext);
        continue;
      }
      s.occupied = true;
      s.serial = ++serial_;
      admitted(i);
      if (!group.empty() && group_tokens + length > limits_.prefill_tokens) {
        prefill(group);
        group.clear();
        group_tokens = 0;
      }
      group.push_back(i);
      group_tokens += length;
    }
  }
  if (!group.empty()) prefill(group);
  return took;
}

bool SlotScheduler::commit(int64_t slot, int64_t token) {
  Slot& s = slots_[slot];
  ++generated_tokens_;
  const auto& stops = limits_.stop_tokens;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) {
    finish(s, Finish::kStop);
    return false;
  }
  s.completion.tokens.push_back(token);
  if (s.generated() == limits_.max_new_tokens) {
    finish(s, Finish::kLength);
    return false;
  }
  if (s.prompt_length() + s.generated() == limits_.context) {
    finish(s, Finish::kContext);
    return false;
  }
  return true;
}

int64_t SlotScheduler::max_tokens(int64_t slot) const {
  return std::min(limits_.context - slots_[slot].prompt_length(), limits_.max_new_tokens);
}

std::vector<int64_t> SlotScheduler::occupied() const {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < size(); ++i) {
    if (slots_[i].occupied) out.push_back(i);
  }
  return out;
}

void SlotScheduler::check_all_finished() const {
  for (const Slot& s : slots_) {
    if (s.occupied) fail("{}: request {} was left unfinished", who_, s.request.id);
  }
}

DecodeProgress SlotScheduler::progress() const {
  return {finished_, generated_tokens_, finished_tokens_};
}

void SlotScheduler::finish(Slot& s, Finish why) {
  ++finished_;
  finished_tokens_ += s.generated() + (why == Finish::kStop ? 1 : 0);
  s.completion.finish = why;
  s.occupied = false;
  done_(s.request, std::move(s.completion));
}

}  // namespace dflash::eval
