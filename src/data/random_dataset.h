// data: prepared datasets of random tokens, written by the real writer (DatasetWriter), for
// the main job on a tiny model, benchmarks at real shapes and tests: no tokenizer or chat
// data needed.
#pragma once
#include <cstdint>
#include <filesystem>

namespace dflash::data {

struct RandomDatasetOptions {
  std::filesystem::path out_dir;
  uint64_t samples = 32;
  uint64_t length = 256;
  // Each sample's length is uniform in [length - length_jitter, length + length_jitter].
  uint64_t length_jitter = 0;
  // The first `prompt` tokens of a sample are unsupervised (mask 0), the rest supervised.
  uint64_t prompt = 32;
  uint64_t vocab = 0;  // ids are uniform in [0, vocab)
  uint64_t seed = 0;
  uint64_t shard_tokens = 16u << 20;
  bool overwrite = false;
};

struct RandomDatasetSummary {
  uint64_t tokens = 0, loss_tokens = 0;
  size_t shards = 0;
};

// Same options and seed, same bytes, on every platform (common/random.h draws everything).
RandomDatasetSummary write_random_dataset(const RandomDatasetOptions& options);

}  // namespace dflash::data
