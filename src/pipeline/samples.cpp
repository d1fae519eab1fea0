#include "pipeline/samples.h"

#include "common/error.h"
#include "common/random.h"

namespace dflash::pipeline {

train::SampleView DatasetSamples::sample(int64_t index) const {
  if (index < 0 || index >= size())
    fail("data: sample {} outside the dataset of {}", index, size());
  const auto s = dataset_[static_cast<size_t>(index)];
  if (s.ids.empty()) fail("data: sample {} is empty", index);
  return {index, s.ids, s.mask};
}

SyntheticSamples::SyntheticSamples(int64_t count, int64_t length, int64_t prompt, int64_t vocab,
                                   uint64_t seed)
    : count_(count), length_(length) {
  if (count < 1 || length < 2 || prompt < 0 || prompt >= length || vocab < 2) {
    fail("synthetic samples: need count >= 1, length >= 2, 0 <= prompt < length, vocab >= 2");
  }
  ids_.resize(static_cast<size_t>(count * length));
  mask_.resize(ids_.size());
  uint64_t state = seed;
  for (size_t i = 0; i < ids_.size(); ++i) {
    ids_[i] = static_cast<int32_t>(uniform_below(state, static_cast<uint64_t>(vocab)));
    mask_[i] = static_cast<int64_t>(i) % length >= prompt;
  }
}

train::SampleView SyntheticSamples::sample(int64_t index) const {
  if (index < 0 || index >= count_) fail("synthetic sample {} outside 0..{}", index, count_ - 1);
  const size_t start = static_cast<size_t>(index * length_), n = static_cast<size_t>(length_);
  return {index, std::span<const int32_t>(ids_).subspan(start, n),
          std::span<const uint8_t>(mask_).subspan(start, n)};
}

}  // namespace dflash::pipeline
