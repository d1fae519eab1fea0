// io: safetensors files and checkpoints. This component owns reading (memory-mapped zero-copy
// views, and streamed loading to a device through pinned staging) and atomic writing of
// .safetensors files and of sharded model directories with model.safetensors.index.json.
// Parsing of untrusted bytes lives in safetensors_header.h (no LibTorch, fuzzed); nothing here
// ever executes or unpickles file content.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "io/safetensors_header.h"

namespace dflash::io {

at::ScalarType to_scalar_type(Dtype dtype);
// Throws naming `what` (a tensor and file) if ATen's type has no safetensors equivalent here.
Dtype from_scalar_type(at::ScalarType type, const std::string& what);

struct TensorInfo {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t offset;  // relative to the file's data section start
  uint64_t nbytes;
};

// One .safetensors file, memory-mapped read-only.
class SafetensorsFile : public std::enable_shared_from_this<SafetensorsFile> {
 public:
  // Throws dflash::Error naming the file if it cannot be opened or fails validation.
  static std::shared_ptr<SafetensorsFile> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }  // in file order
  const TensorInfo* find(const std::string& name) const;               // nullptr if absent
  // Zero-copy CPU tensor over the mapping that keeps the mapping alive. The mapping is
  // read-only: clone before writing in place. A tensor whose bytes are not aligned to its
  // element size (legal in the format, rare in practice) is returned as an aligned copy.
  at::Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  uint64_t file_size() const { return file_size_; }
  uint64_t data_start() const { return data_start_; }  // absolute offset of the data section
  int fd() const { return fd_; }                       // for pread; owned by this object

 private:
  SafetensorsFile() = default;
  const TensorInfo& at_name(const std::string& name) const;

  std::filesystem::path path_;
  int fd_ = -1;
  const char* map_ = nullptr;
  uint64_t file_size_ = 0;
  uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::map<std::string, std::string> metadata_;
};

// A model directory: model.safetensors, or shards listed by model.safetensors.index.json.
class Checkpoint {
 public:
  // `dir` may also be a single .safetensors file. A directory with model.safetensors uses it
  // (as transformers does), else the index; every shard the index names must exist and hold
  // every tensor the index places in it. Tensors a shard holds but the index does not name
  // are ignored, as transformers ignores them.
  static Checkpoint open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // throws naming the tensor if absent
  at::Tensor tensor(const std::string& name) const;       // zero-copy CPU view
  // Loads tensors straight to `device` converting to `dtype`. Bytes are read with pread into a
  // pinned double buffer of `staging_bytes` and copied on a side stream while the next chunk is
  // read, so peak host memory is the staging size, not the checkpoint size. pread rather than
  // the mapping: mapped pages would fault in 4 KiB at a time and stay resident in this process.
  // On a CPU device bytes are read straight into the result when no conversion is needed.
  // Returns when every copy has finished; names may repeat and come in any order.
  std::map<std::string, at::Tensor> load(const std::vector<std::string>& names, at::Device device,
                                         at::ScalarType dtype,
                                         size_t staging_bytes = 256 << 20) const;
  uint64_t total_bytes() const;  // sum of the tensors' byte sizes
  const std::vector<std::shared_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  const Entry& entry(const std::string& name) const;

  std::filesystem::path dir_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> entries_;
};

// Writes `tensors` (CPU or CUDA, any strides) in the given order with `metadata` as
// __metadata__, atomically: a temporary file beside `path`, fsynced, then renamed. Tensors are
// copied to the host in chunks, so no more than one chunk of the model is held twice.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes a model directory as transformers does: model.safetensors when everything fits in
// `max_shard_bytes`, else model-0000i-of-0000n.safetensors shards (in the given order, a tensor
// larger than the limit alone in its shard) plus model.safetensors.index.json, written last.
// Each file gets `metadata` with "format": "pt" added unless given, because transformers
// refuses safetensors metadata without a format. Files of the other layout and stale shards
// left by an earlier save to `dir` are removed, so readers cannot pick up old weights.
void write_checkpoint(const std::filesystem::path& dir,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      uint64_t max_shard_bytes = 5ull << 30,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace dflash::io
