#include "io/safetensors.h"

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <set>

#include "common/error.h"
#include "common/file.h"

namespace dflash::io {

// The format is little-endian and we hand its bytes to ATen unconverted.
static_assert(std::endian::native == std::endian::little);

namespace {

namespace fs = std::filesystem;

// Writes and conversions go through host chunks of this size, so saving or converting never
// holds more than this much of a tensor twice.
constexpr uint64_t kWriteChunkBytes = 64ull << 20;
// Staging offsets are rounded to this so every chunk is aligned for any element type and for
// fast DMA.
constexpr uint64_t kStagingAlign = 64;

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

// Reads exactly `n` bytes at `offset`, retrying short reads (pread returns at most ~2 GiB).
void pread_exact(const SafetensorsFile& file, uint64_t offset, void* dst, uint64_t n,
                 const std::string& tensor) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(n, 1ull << 30));
    ssize_t got = ::pread(file.fd(), p, want, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail("{}: reading tensor {} at byte {} failed: {}", file.path().string(), quote_name(tensor),
           offset, std::strerror(errno));
    }
    if (got == 0) {
      fail("{}: file ended at byte {} while reading tensor {} (truncated after it was opened?)",
           file.path().string(), offset, quote_name(tensor));
    }
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
}

bool is_shard_name(const std::string& name) {
  // model-00001-of-00002.safetensors, the pattern transformers and write_checkpoint use.
  auto digits = [&](size_t pos) {
    return std::all_of(name.begin() + pos, name.begin() + pos + 5,
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  return name.size() == 32 && name.starts_with("model-") && digits(6) &&
         name.compare(11, 4, "-of-") == 0 && digits(15) && name.ends_with(".safetensors");
}

void remove_file(const fs::path& path) {
  std::error_code ec;
  fs::remove(path, ec);
  if (ec) fail("cannot remove stale checkpoint file {}: {}", path.string(), ec.message());
}

// Streams the row-major bytes of `t` to `fd`, copying to the host at most a chunk at a time.
// Row-major order of a tensor is the concatenation of its dim-0 slices, so splitting along
// dim 0 (recursing into a slice when one row alone is too big) never materialises it whole.
void write_tensor_data(int fd, const at::Tensor& t, const fs::path& path) {
  if (t.numel() == 0) return;
  if (t.is_cpu() && t.is_contiguous()) {
    write_all(fd, t.data_ptr(), t.nbytes(), path);
    return;
  }
  if (t.dim() == 0) {
    at::Tensor host = t.contiguous().cpu();
    write_all(fd, host.data_ptr(), host.nbytes(), path);
    return;
  }
  const int64_t rows = t.size(0);
  const uint64_t row_bytes = t.nbytes() / static_cast<uint64_t>(rows);
  if (row_bytes > kWriteChunkBytes && t.dim() > 1) {
    for (int64_t i = 0; i < rows; ++i) write_tensor_data(fd, t.select(0, i), path);
    return;
  }
  const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(kWriteChunkBytes / row_bytes));
  for (int64_t i = 0; i < rows; i += step) {
    at::Tensor host = t.narrow(0, i, std::min(step, rows - i)).contiguous().cpu();
    write_all(fd, host.data_ptr(), host.nbytes(), path);
  }
}

struct LoadJob {
  const SafetensorsFile* file;
  const TensorInfo* info;
  at::Tensor dst;  // contiguous, in the requested dtype and device
};

void load_cpu(const std::vector<LoadJob>& jobs, uint64_t chunk) {
  at::Tensor staging;  // only needed when converting
  for (const auto& job : jobs) {
    const TensorInfo& info = *job.info;
    const uint64_t base = job.file->data_start() + info.offset;
    if (info.nbytes == 0) continue;
    if (info.dtype == job.dst.scalar_type()) {
      pread_exact(*job.file, base, job.dst.data_ptr(), info.nbytes, info.name);
      continue;
    }
    if (!staging.defined()) staging = at::empty({static_cast<int64_t>(chunk)}, at::kByte);
    at::Tensor flat = job.dst.view(-1);
    const uint64_t item = c10::elementSize(info.dtype);
    for (uint64_t off = 0; off < info.nbytes; off += chunk) {
      const uint64_t n = std::min(chunk, info.nbytes - off);
      pread_exact(*job.file, base + off, staging.data_ptr(), n, info.name);
      flat.narrow(0, static_cast<int64_t>(off / item), static_cast<int64_t>(n / item))
          .copy_(staging.narrow(0, 0, static_cast<int64_t>(n)).view(info.dtype));
    }
  }
}

// Two pinned halves alternate: while the side stream copies one half to the device, the host
// preads the next chunks into the other; an event per half says when it may be overwritten.
// Chunks of several small tensors share a half, so events are per half-fill, not per tensor.
// A conversion goes through a device staging buffer of the source dtype: copy_ from a host
// tensor of another dtype would convert on the CPU into pageable memory.
void load_cuda(const std::vector<LoadJob>& jobs, at::Device device, uint64_t half) {
  c10::cuda::CUDAGuard device_guard(device);
  if (!device.has_index()) device = at::Device(at::kCUDA, c10::cuda::current_device());
  const bool convert = std::any_of(jobs.begin(), jobs.end(), [](const LoadJob& j) {
    return j.info->dtype != j.dst.scalar_type();
  });
  at::Tensor pinned = at::empty({static_cast<int64_t>(2 * half)},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  at::Tensor device_stage;
  if (convert) {
    device_stage = at::empty({static_cast<int64_t>(2 * half)},
                             at::TensorOptions().dtype(at::kByte).device(device));
  }
  // The destinations may reuse memory the current stream still works on; order after it.
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(side);

  c10::cuda::CUDAStreamGuard stream_guard(side);
  at::cuda::CUDAEvent done[2];
  int h = 0;
  uint64_t used = 0;
  for (const auto& job : jobs) {
    const TensorInfo& info = *job.info;
    if (info.nbytes == 0) continue;
    const uint64_t base = job.file->data_start() + info.offset;
    const uint64_t item = c10::elementSize(info.dtype);
    at::Tensor flat = job.dst.view(-1);
    at::Tensor flat_bytes =
        info.dtype == job.dst.scalar_type() ? flat.view(at::kByte) : at::Tensor();
    for (uint64_t off = 0; off < info.nbytes;) {
      const uint64_t n = std::min(half, info.nbytes - off);
      if (used + n > half) {
        done[h].record(side);
        h ^= 1;
        done[h].synchronize();  // returns at once if the half was never used
        used = 0;
      }
      const uint64_t pos = h * half + used;
      pread_exact(*job.file, base + off, static_cast<char*>(pinned.data_ptr()) + pos, n, info.name);
      at::Tensor src = pinned.narrow(0, static_cast<int64_t>(pos), static_cast<int64_t>(n));
      if (flat_bytes.defined()) {
        flat_bytes.narrow(0, static_cast<int64_t>(off), static_cast<int64_t>(n))
            .copy_(src, /*non_blocking=*/true);
      } else {
        at::Tensor stage =
            device_stage.narrow(0, static_cast<int64_t>(pos), static_cast<int64_t>(n));
        stage.copy_(src, /*non_blocking=*/true);
        flat.narrow(0, static_cast<int64_t>(off / item), static_cast<int64_t>(n / item))
            .copy_(stage.view(info.dtype), /*non_blocking=*/true);
      }
      used = round_up(used + n, kStagingAlign);
      off += n;
    }
  }
  // Loading is a bulk step: finishing here keeps the staging buffers' lifetime trivial and
  // lets callers use the tensors on any stream.
  side.synchronize();
}

}  // namespace

at::ScalarType to_scalar_type(Dtype dtype) {
  switch (dtype) {
    case Dtype::kBool:
      return at::kBool;
    case Dtype::kU8:
      return at::kByte;
    case Dtype::kI8:
      return at::kChar;
    case Dtype::kI16:
      return at::kShort;
    case Dtype::kI32:
      return at::kInt;
    case Dtype::kI64:
      return at::kLong;
    case Dtype::kF16:
      return at::kHalf;
    case Dtype::kBF16:
      return at::kBFloat16;
    case Dtype::kF32:
      return at::kFloat;
    case Dtype::kF64:
      return at::kDouble;
    case Dtype::kF8E4M3:
      return at::kFloat8_e4m3fn;
    case Dtype::kF8E5M2:
      return at::kFloat8_e5m2;
  }
  fail("invalid Dtype value {}", static_cast<int>(dtype));
}

Dtype from_scalar_type(at::ScalarType type, const std::string& what) {
  switch (type) {
    case at::kBool:
      return Dtype::kBool;
    case at::kByte:
      return Dtype::kU8;
    case at::kChar:
      return Dtype::kI8;
    case at::kShort:
      return Dtype::kI16;
    case at::kInt:
      return Dtype::kI32;
    case at::kLong:
      return Dtype::kI64;
    case at::kHalf:
      return Dtype::kF16;
    case at::kBFloat16:
      return Dtype::kBF16;
    case at::kFloat:
      return Dtype::kF32;
    case at::kDouble:
      return Dtype::kF64;
    case at::kFloat8_e4m3fn:
      return Dtype::kF8E4M3;
    case at::kFloat8_e5m2:
      return Dtype::kF8E5M2;
    default:
      fail("{}: dtype {} has no safetensors equivalent here (supported: {})", what,
           c10::toString(type), supported_dtype_names());
  }
}

// ---- SafetensorsFile ----

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const fs::path& path) {
  std::shared_ptr<SafetensorsFile> f(new SafetensorsFile());
  f->path_ = path;
  const std::string name = path.string();
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd_ < 0) fail("cannot open {}: {}", name, std::strerror(errno));
  struct stat st {};
  if (::fstat(f->fd_, &st) != 0) fail("cannot stat {}: {}", name, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("{} is not a regular file", name);
  f->file_size_ = static_cast<uint64_t>(st.st_size);
  // Checked before mapping: mmap rejects empty files, and the message should say why.
  if (f->file_size_ < 8) parse_header_length({}, f->file_size_, name);
  void* map = ::mmap(nullptr, f->file_size_, PROT_READ, MAP_PRIVATE, f->fd_, 0);
  if (map == MAP_FAILED) fail("cannot map {}: {}", name, std::strerror(errno));
  f->map_ = static_cast<const char*>(map);

  ParsedHeader header =
      parse_safetensors_header(std::string_view(f->map_, f->file_size_), f->file_size_, name);
  f->data_start_ = header.data_start;
  f->metadata_ = std::move(header.metadata);
  f->tensors_.reserve(header.tensors.size());
  for (auto& e : header.tensors) {
    f->by_name_.emplace(e.name, f->tensors_.size());
    f->tensors_.push_back(TensorInfo{std::move(e.name), to_scalar_type(e.dtype), std::move(e.shape),
                                     e.begin, e.end - e.begin});
  }
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(const_cast<char*>(map_), file_size_);
  if (fd_ >= 0) ::close(fd_);
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& SafetensorsFile::at_name(const std::string& name) const {
  const TensorInfo* info = find(name);
  if (!info)
    fail("{}: no tensor {} (the file has {})", path_.string(), quote_name(name), tensors_.size());
  return *info;
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& info = at_name(name);
  auto options = at::TensorOptions().dtype(info.dtype).device(at::kCPU);
  if (info.nbytes == 0) return at::empty(info.shape, options);
  const char* data = map_ + data_start_ + info.offset;
  // ATen's kernels assume naturally aligned elements.
  if (reinterpret_cast<uintptr_t>(data) % c10::elementSize(info.dtype) != 0) {
    at::Tensor copy = at::empty(info.shape, options);
    std::memcpy(copy.data_ptr(), data, info.nbytes);
    return copy;
  }
  return at::from_blob(
      const_cast<char*>(data), info.shape,
      [keep = shared_from_this()](void*) mutable { keep.reset(); }, options);
}

// ---- Checkpoint ----

Checkpoint Checkpoint::open(const fs::path& dir) {
  Checkpoint c;
  c.dir_ = dir;
  auto add_all = [&](std::shared_ptr<SafetensorsFile> f) {
    for (const auto& info : f->tensors()) c.entries_.emplace(info.name, Entry{f.get(), &info});
    c.files_.push_back(std::move(f));
  };
  std::error_code ec;
  if (fs::is_regular_file(dir, ec)) {
    add_all(SafetensorsFile::open(dir));
    return c;
  }
  if (!fs::is_directory(dir, ec)) {
    fail(
        "checkpoint {} does not exist (expected a directory with model.safetensors or "
        "model.safetensors.index.json, or a .safetensors file)",
        dir.string());
  }
  const fs::path single = dir / "model.safetensors";
  const fs::path index_path = dir / "model.safetensors.index.json";
  if (fs::exists(single, ec)) {
    add_all(SafetensorsFile::open(single));
    return c;
  }
  if (!fs::exists(index_path, ec)) {
    fail("checkpoint {} has neither model.safetensors nor model.safetensors.index.json",
         dir.string());
  }
  const std::string index_name = index_path.string();
  uint64_t index_size = fs::file_size(index_path, ec);
  if (ec) fail("cannot stat {}: {}", index_name, ec.message());
  if (index_size > kMaxHeaderBytes) {
    fail("{}: index is {} bytes, over the {}-byte limit", index_name, index_size, kMaxHeaderBytes);
  }
  ParsedIndex index = parse_index_json(read_file(index_path), index_name);
  std::map<std::string, const SafetensorsFile*> shards;
  for (const auto& shard : index.shards) {
    const fs::path p = dir / shard;
    if (!fs::exists(p, ec)) {
      fail("{}: shard {} named in the index does not exist (incomplete download?)", index_name,
           p.string());
    }
    c.files_.push_back(SafetensorsFile::open(p));
    shards.emplace(shard, c.files_.back().get());
  }
  for (const auto& [name, shard] : index.weight_map) {
    const SafetensorsFile* f = shards.at(shard);
    const TensorInfo* info = f->find(name);
    if (!info) {
      fail("{}: the index places tensor {} in {}, but that shard has no such tensor", index_name,
           quote_name(name), f->path().string());
    }
    c.entries_.emplace(name, Entry{f, info});
  }
  return c;
}

const Checkpoint::Entry& Checkpoint::entry(const std::string& name) const {
  auto it = entries_.find(name);
  if (it == entries_.end()) {
    fail("checkpoint {}: no tensor {} (it has {} tensors)", dir_.string(), quote_name(name),
         entries_.size());
  }
  return it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, e] : entries_) out.push_back(name);
  return out;
}

bool Checkpoint::contains(const std::string& name) const { return entries_.count(name) != 0; }

const TensorInfo& Checkpoint::info(const std::string& name) const { return *entry(name).info; }

at::Tensor Checkpoint::tensor(const std::string& name) const {
  return entry(name).file->tensor(name);
}

uint64_t Checkpoint::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, e] : entries_) total += e.info->nbytes;
  return total;
}

std::map<std::string, at::Tensor> Checkpoint::load(const std::vector<std::string>& names,
                                                   at::Device device, at::ScalarType dtype,
                                                   size_t staging_bytes) const {
  if (!device.is_cpu() && !device.is_cuda()) {
    fail("checkpoint {}: cannot load to device {} (CPU or CUDA only)", dir_.string(), device.str());
  }
  // Every name is checked before any memory is allocated.
  std::vector<const Entry*> wanted;
  for (const auto& name : names) wanted.push_back(&entry(name));
  std::map<std::string, at::Tensor> out;
  std::vector<LoadJob> jobs;
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  for (const Entry* e : wanted) {
    if (out.count(e->info->name)) continue;
    at::Tensor dst = at::empty(e->info->shape, options);
    out.emplace(e->info->name, dst);
    jobs.push_back(LoadJob{e->file, e->info, dst});
  }
  // File order makes the reads sequential, whatever order the caller asked in.
  std::sort(jobs.begin(), jobs.end(), [](const LoadJob& a, const LoadJob& b) {
    if (a.file != b.file) return a.file->path() < b.file->path();
    return a.info->offset < b.info->offset;
  });
  const uint64_t half =
      std::max<uint64_t>(kStagingAlign, staging_bytes / 2 / kStagingAlign * kStagingAlign);
  if (device.is_cpu()) {
    load_cpu(jobs, 2 * half);
  } else {
    load_cuda(jobs, device, half);
  }
  return out;
}

// ---- writers ----

void write_safetensors(const fs::path& path,
                       const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  std::vector<HeaderEntry> entries;
  std::vector<at::Tensor> data;
  entries.reserve(tensors.size());
  data.reserve(tensors.size());
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) fail("{}: tensor {} is undefined", file, quote_name(name));
    if (tensor.layout() != at::kStrided || tensor.is_meta()) {
      fail("{}: tensor {} has no dense data to save (layout {}, device {})", file, quote_name(name),
           c10::toString(tensor.layout()), tensor.device().str());
    }
    HeaderEntry e;
    e.name = name;
    e.dtype = from_scalar_type(tensor.scalar_type(),
                               fmt::format("{}: tensor {}", file, quote_name(name)));
    e.shape = tensor.sizes().vec();
    e.begin = offset;
    e.end = offset + tensor.nbytes();
    offset = e.end;
    entries.push_back(std::move(e));
    // A lazily negated view's memory holds the un-negated values.
    data.push_back(tensor.detach().resolve_neg().resolve_conj());
  }
  const std::string header = build_safetensors_header(entries, metadata, file);
  write_file_atomic(path, [&](int fd) {
    write_all(fd, header.data(), header.size(), path);
    for (const auto& t : data) write_tensor_data(fd, t, path);
  });
}

void write_checkpoint(const fs::path& dir,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      uint64_t max_shard_bytes,
                      const std::map<std::string, std::string>& metadata) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create checkpoint directory {}: {}", dir.string(), ec.message());
  std::map<std::string, std::string> meta = metadata;
  meta.emplace("format", "pt");

  // Duplicates in different shards would each pass the per-file check.
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (!seen.insert(name).second)
      fail("checkpoint {}: tensor {} given twice", dir.string(), quote_name(name));
  }
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards;
  uint64_t shard_bytes = 0;
  uint64_t total = 0;
  for (const auto& item : tensors) {
    const uint64_t n = item.second.defined() ? item.second.nbytes() : 0;
    if (shards.empty() || (!shards.back().empty() && shard_bytes + n > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(item);
    shard_bytes += n;
    total += n;
  }

  const fs::path single = dir / "model.safetensors";
  const fs::path index_path = dir / "model.safetensors.index.json";
  std::set<std::string> keep;
  if (shards.size() <= 1) {
    write_safetensors(single, tensors, meta);
    if (fs::exists(index_path, ec)) remove_file(index_path);
  } else {
    std::map<std::string, std::string> weight_map;
    for (size_t i = 0; i < shards.size(); ++i) {
      const std::string name =
          fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
      write_safetensors(dir / name, shards[i], meta);
      for (const auto& item : shards[i]) weight_map.emplace(item.first, name);
      keep.insert(name);
    }
    // Last, so a crash mid-save never leaves an index pointing at missing shards.
    write_file_atomic(index_path, build_index_json(weight_map, total));
    if (fs::exists(single, ec)) remove_file(single);
  }
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (is_shard_name(name) && !keep.count(name)) remove_file(entry.path());
  }
}

}  // namespace dflash::io
