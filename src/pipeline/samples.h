// pipeline: where training samples come from: a prepared dataset on disk (memory-mapped), or
// synthetic samples made from a seed, for benchmarks that need no files.
#pragma once
#include <cstdint>
#include <vector>

#include "data/dataset.h"
#include "train/step.h"

namespace dflash::pipeline {

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  virtual train::SampleView sample(int64_t index) const = 0;
};

// `dataset` must outlive this.
class DatasetSamples : public SampleSource {
 public:
  explicit DatasetSamples(const data::Dataset& dataset) : dataset_(dataset) {}
  int64_t size() const override { return static_cast<int64_t>(dataset_.size()); }
  train::SampleView sample(int64_t index) const override;

 private:
  const data::Dataset& dataset_;
};

// `count` samples of `length` random tokens below `vocab`, the first `prompt` of each
// unsupervised, fixed by `seed`.
class SyntheticSamples : public SampleSource {
 public:
  SyntheticSamples(int64_t count, int64_t length, int64_t prompt, int64_t vocab, uint64_t seed);
  int64_t size() const override { return count_; }
  train::SampleView sample(int64_t index) const override;

 private:
  int64_t count_, length_;
  std::vector<int32_t> ids_;
  std::vector<uint8_t> mask_;
};

}  // namespace dflash::pipeline
