#include "data/dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/crc32c.h"
#include "common/error.h"
#include "common/file.h"
#include "common/random.h"

namespace dflash::data {
namespace {

constexpr char kMagic[8] = {'D', 'F', 'S', 'H', 'A', 'R', 'D', '1'};
constexpr uint64_t kHeaderBytes = 64;

uint64_t align8(uint64_t x) { return (x + 7) & ~uint64_t{7}; }

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t samples, tokens, ids_offset, mask_offset, index_offset, file_size;
};
static_assert(sizeof(Header) == kHeaderBytes);

Header layout(uint64_t samples, uint64_t tokens) {
  Header h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = kDatasetFormatVersion;
  h.header_bytes = kHeaderBytes;
  h.samples = samples;
  h.tokens = tokens;
  h.ids_offset = kHeaderBytes;
  h.mask_offset = align8(h.ids_offset + 4 * tokens);
  h.index_offset = align8(h.mask_offset + tokens);
  h.file_size = h.index_offset + 8 * (samples + 1);
  return h;
}

}  // namespace

void ShardWriter::add(std::span<const int32_t> ids, std::span<const uint8_t> mask) {
  if (ids.size() != mask.size())
    fail("sample has {} ids but {} mask entries", ids.size(), mask.size());
  ids_.insert(ids_.end(), ids.begin(), ids.end());
  mask_.insert(mask_.end(), mask.begin(), mask.end());
  index_.push_back(ids_.size());
}

nlohmann::json ShardWriter::write(const std::filesystem::path& path) {
  // Streamed section by section (no second copy of the shard in memory), CRC computed on the way.
  Header h = layout(samples(), tokens());
  uint32_t crc = 0;
  write_file_atomic(path, [&](int fd) {
    uint64_t at = 0;
    auto put = [&](const void* data, size_t n) {
      write_all(fd, data, n, path);
      crc = crc32c(data, n, crc);
      at += n;
    };
    auto pad_to = [&](uint64_t offset) {
      static const char zeros[8] = {};
      if (offset > at) put(zeros, offset - at);
    };
    put(&h, sizeof h);
    put(ids_.data(), 4 * ids_.size());
    pad_to(h.mask_offset);
    put(mask_.data(), mask_.size());
    pad_to(h.index_offset);
    put(index_.data(), 8 * index_.size());
    if (at != h.file_size) fail("{}: wrote {} bytes, expected {}", path.string(), at, h.file_size);
  });
  nlohmann::json entry = {{"file", path.filename().string()},
                          {"samples", h.samples},
                          {"tokens", h.tokens},
                          {"bytes", h.file_size},
                          {"crc32c", fmt::format("{:08x}", crc)}};
  ids_.clear();
  mask_.clear();
  index_.assign(1, 0);
  return entry;
}

DatasetWriter::DatasetWriter(std::filesystem::path dir, uint64_t shard_tokens, bool overwrite)
    : dir_(std::move(dir)), shard_tokens_(shard_tokens) {
  if (shard_tokens_ == 0) fail("shard size must be positive");
  std::filesystem::create_directories(dir_);
  auto manifest_path = dir_ / "manifest.json";
  if (std::filesystem::exists(manifest_path)) {
    if (!overwrite) {
      fail("{} already holds a prepared dataset; pass --overwrite to replace it", dir_.string());
    }
    std::filesystem::remove(manifest_path);
  }
  for (const auto& e : std::filesystem::directory_iterator(dir_)) {
    auto name = e.path().filename().string();
    if (name.starts_with("shard-") && name.ends_with(".bin")) {
      if (!overwrite) fail("{} holds shard files; pass --overwrite", dir_.string());
      std::filesystem::remove(e.path());
    }
  }
}

void DatasetWriter::add(std::span<const int32_t> ids, std::span<const uint8_t> mask) {
  if (shard_.tokens() > 0 && shard_.tokens() + ids.size() > shard_tokens_) flush();
  shard_.add(ids, mask);
}

void DatasetWriter::flush() {
  if (shard_.samples() == 0) return;
  shards_.push_back(shard_.write(dir_ / fmt::format("shard-{:05d}.bin", shards_.size())));
}

size_t DatasetWriter::finish(nlohmann::json fields) {
  flush();
  fields["format"] = "dflash-prepared";
  fields["format_version"] = kDatasetFormatVersion;
  fields["shards"] = shards_;
  write_file_atomic(dir_ / "manifest.json", fields.dump(2) + "\n");
  return shards_.size();
}

struct Dataset::Shard {
  std::string path;
  void* map = nullptr;
  size_t size = 0;
  Header header{};
  const int32_t* ids = nullptr;
  const uint8_t* mask = nullptr;
  const uint64_t* index = nullptr;
  ~Shard() {
    if (map) ::munmap(map, size);
  }
};

Dataset Dataset::open(const std::filesystem::path& dir, bool verify) {
  auto manifest_path = dir / "manifest.json";
  if (!std::filesystem::exists(manifest_path)) {
    fail("{}: no manifest.json (not a prepared dataset, or `dflash prepare` did not finish)",
         dir.string());
  }
  Dataset d;
  try {
    d.manifest_ = nlohmann::json::parse(read_file(manifest_path));
    if (d.manifest_.at("format") != "dflash-prepared")
      fail("{}: not a dflash manifest", manifest_path.string());
    int version = d.manifest_.at("format_version").get<int>();
    if (version != kDatasetFormatVersion) {
      fail("{}: format version {} (this dflash reads version {})", manifest_path.string(), version,
           kDatasetFormatVersion);
    }
    for (const auto& entry : d.manifest_.at("shards")) {
      auto shard = std::make_shared<Shard>();
      shard->path = (dir / entry.at("file").get<std::string>()).string();
      const std::string& p = shard->path;
      int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) fail("{}: cannot open shard: {}", p, std::strerror(errno));
      struct stat st {};
      ::fstat(fd, &st);
      shard->size = static_cast<size_t>(st.st_size);
      uint64_t want_bytes = entry.at("bytes").get<uint64_t>();
      if (shard->size != want_bytes) {
        ::close(fd);
        fail("{}: shard is {} bytes, the manifest says {} (truncated or replaced)", p, shard->size,
             want_bytes);
      }
      if (shard->size < kHeaderBytes) {
        ::close(fd);
        fail("{}: shard is too short for a header", p);
      }
      shard->map = ::mmap(nullptr, shard->size, PROT_READ, MAP_SHARED, fd, 0);
      ::close(fd);
      if (shard->map == MAP_FAILED) {
        shard->map = nullptr;
        fail("{}: mmap failed: {}", p, std::strerror(errno));
      }
      auto base = static_cast<const char*>(shard->map);
      if (verify) {
        auto crc = fmt::format("{:08x}", crc32c(base, shard->size));
        if (crc != entry.at("crc32c").get<std::string>()) {
          fail(
              "{}: checksum mismatch (CRC-32C {} but the manifest says {}): the shard is "
              "corrupted",
              p, crc, entry["crc32c"].get<std::string>());
        }
      }
      std::memcpy(&shard->header, base, sizeof(Header));
      const Header& h = shard->header;
      Header want = layout(entry.at("samples").get<uint64_t>(), entry.at("tokens").get<uint64_t>());
      if (std::memcmp(h.magic, kMagic, 8) != 0 || h.version != want.version ||
          h.header_bytes != kHeaderBytes || h.samples != want.samples || h.tokens != want.tokens ||
          h.ids_offset != want.ids_offset || h.mask_offset != want.mask_offset ||
          h.index_offset != want.index_offset || h.file_size != shard->size) {
        fail("{}: shard header does not match the manifest", p);
      }
      shard->ids = reinterpret_cast<const int32_t*>(base + h.ids_offset);
      shard->mask = reinterpret_cast<const uint8_t*>(base + h.mask_offset);
      shard->index = reinterpret_cast<const uint64_t*>(base + h.index_offset);
      // The index must be monotone and end at the token count, or samples would read past it.
      if (shard->index[0] != 0 || shard->index[h.samples] != h.tokens) {
        fail("{}: shard index does not span its tokens", p);
      }
      for (uint64_t i = 0; i < h.samples; ++i) {
        if (shard->index[i] > shard->index[i + 1]) fail("{}: shard index is not monotone", p);
      }
      d.first_sample_.push_back(d.total_samples_);
      d.total_samples_ += h.samples;
      d.total_tokens_ += h.tokens;
      d.shards_.push_back(std::move(shard));
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: malformed manifest: {}", manifest_path.string(), e.what());
  }
  d.first_sample_.push_back(d.total_samples_);
  return d;
}

Dataset::Sample Dataset::operator[](size_t i) const {
  if (i >= total_samples_) fail("sample {} out of range (dataset has {})", i, total_samples_);
  auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), i);
  size_t s = static_cast<size_t>(it - first_sample_.begin()) - 1;
  const Shard& sh = *shards_[s];
  size_t local = i - first_sample_[s];
  uint64_t b = sh.index[local], e = sh.index[local + 1];
  return {{sh.ids + b, e - b}, {sh.mask + b, e - b}};
}

EpochSampler::EpochSampler(size_t num_samples, uint64_t seed, size_t rank, size_t world)
    : n_(num_samples), rank_(rank), world_(world), per_rank_(0), seed_(seed) {
  if (world == 0 || rank >= world) fail("sampler rank {} is not below world size {}", rank, world);
  if (num_samples > UINT32_MAX) fail("sampler supports up to 2^32-1 samples");
  per_rank_ = n_ / world_;
  if (per_rank_ == 0) fail("{} samples cannot be shared by {} ranks", n_, world_);
}

std::vector<uint32_t> EpochSampler::permutation(uint64_t epoch) const {
  std::vector<uint32_t> p(n_);
  for (size_t i = 0; i < n_; ++i) p[i] = static_cast<uint32_t>(i);
  uint64_t state = seed_ ^ (0xD1B54A32D192ED03ull * (epoch + 1));
  for (size_t i = n_; i > 1; --i) std::swap(p[i - 1], p[uniform_below(state, i)]);  // Fisher-Yates
  return p;
}

void EpochSampler::seek(Position p) {
  if (p.step > per_rank_) fail("sampler position {} is past the epoch ({})", p.step, per_rank_);
  pos_ = p;
}

size_t EpochSampler::next() {
  if (pos_.step == per_rank_) {
    ++pos_.epoch;
    pos_.step = 0;
  }
  if (perm_epoch_ != pos_.epoch) {
    perm_ = permutation(pos_.epoch);
    perm_epoch_ = pos_.epoch;
  }
  return perm_[pos_.step++ * world_ + rank_];
}

}  // namespace dflash::data
