// data: the prepared-dataset format. A directory holds shard-NNNNN.bin files and a
// manifest.json (written last, so a directory without one is an interrupted prepare).
//
// Shard file, little-endian, version 1:
//   0   char[8]  magic "DFSHARD1"
//   8   u32      version (1)          12  u32 header bytes (64)
//   16  u64      samples S            24  u64 tokens T
//   32  u64      offset of ids        40  u64 offset of mask      48  u64 offset of index
//   56  u64      file size
//   ids: int32[T]; mask: uint8[T] (1 = supervised); index: u64[S + 1], sample i is tokens
//   [index[i], index[i + 1]). Sections start on 8-byte boundaries.
// The manifest records per shard its counts, size and CRC-32C, so truncation or corruption is
// caught at load; the reader memory-maps the shards and serves samples in O(1).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

namespace dflash::data {

inline constexpr int kDatasetFormatVersion = 1;

// Accumulates samples for one shard in memory (bounded by the caller's shard size) and writes
// it atomically.
class ShardWriter {
 public:
  void add(std::span<const int32_t> ids, std::span<const uint8_t> mask);
  size_t samples() const { return index_.size() - 1; }
  size_t tokens() const { return ids_.size(); }
  // Writes the shard to `path` and returns its manifest entry (file name, counts, size, crc).
  nlohmann::json write(const std::filesystem::path& path);

 private:
  std::vector<int32_t> ids_;
  std::vector<uint8_t> mask_;
  std::vector<uint64_t> index_{0};
};

// Writes a prepared directory, the one writer of the format: samples fill shards of at most
// `shard_tokens` tokens (a longer sample gets a shard of its own), and finish() writes the
// manifest last.
class DatasetWriter {
 public:
  // Refuses a directory that already holds a dataset (manifest or shards) unless `overwrite`,
  // which removes the old manifest before anything else so a half-replaced dataset never opens.
  DatasetWriter(std::filesystem::path dir, uint64_t shard_tokens, bool overwrite);
  void add(std::span<const int32_t> ids, std::span<const uint8_t> mask);
  // Writes the last shard and manifest.json: `fields` (what made the data) plus the format,
  // its version and the shard entries. Returns the number of shards.
  size_t finish(nlohmann::json fields);

 private:
  void flush();
  std::filesystem::path dir_;
  uint64_t shard_tokens_;
  ShardWriter shard_;
  nlohmann::json shards_ = nlohmann::json::array();
};

class Dataset {
 public:
  // Opens a prepared directory: checks the manifest's format version, each shard's size and
  // header against the manifest, and (when `verify`) each shard's CRC-32C. Throws dflash::Error
  // naming the shard and what is wrong.
  static Dataset open(const std::filesystem::path& dir, bool verify = true);

  struct Sample {
    std::span<const int32_t> ids;
    std::span<const uint8_t> mask;
  };
  size_t size() const { return total_samples_; }
  uint64_t tokens() const { return total_tokens_; }
  Sample operator[](size_t i) const;
  const nlohmann::json& manifest() const { return manifest_; }

 private:
  struct Shard;
  std::vector<std::shared_ptr<const Shard>> shards_;
  std::vector<uint64_t> first_sample_;  // per shard, plus the total at the end
  size_t total_samples_ = 0;
  uint64_t total_tokens_ = 0;
  nlohmann::json manifest_;
};

// A seeded, resumable order over a dataset: every epoch is a fresh permutation derived only from
// (seed, epoch), so a run restarted at a saved Position continues with exactly the samples it
// would have seen. With world > 1, rank r takes every world-th element of the permutation and
// all ranks get the same count per epoch (the remainder is dropped).
class EpochSampler {
 public:
  struct Position {
    uint64_t epoch = 0;
    uint64_t step = 0;  // samples this rank has taken in the epoch
  };
  EpochSampler(size_t num_samples, uint64_t seed, size_t rank = 0, size_t world = 1);
  size_t per_epoch() const { return per_rank_; }
  size_t next();  // moves to the next epoch when one is exhausted
  Position position() const { return pos_; }
  void seek(Position p);
  // The full permutation of an epoch (deterministic across platforms: own RNG, own shuffle).
  std::vector<uint32_t> permutation(uint64_t epoch) const;

 private:
  size_t n_, rank_, world_, per_rank_;
  uint64_t seed_;
  Position pos_;
  uint64_t perm_epoch_ = UINT64_MAX;
  std::vector<uint32_t> perm_;
};

}  // namespace dflash::data
