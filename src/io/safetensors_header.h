// io: the byte-level half of the safetensors component: header and index-JSON parsing and
// header building. It depends only on nlohmann_json and fmt (no LibTorch), so the libFuzzer
// targets in tests/fuzz can drive it straight from bytes; safetensors.h adds files and tensors.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::io {

// The element types we accept. Others (U16/U32/U64, F8_E8M0, F4, complex) are rejected with an
// error naming them, because ATen support for them is too thin to load models with.
enum class Dtype : uint8_t {
  kBool,
  kU8,
  kI8,
  kI16,
  kI32,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,
  kF8E5M2
};

std::string_view dtype_name(Dtype dtype);  // the safetensors spelling, e.g. "BF16"
uint64_t dtype_size(Dtype dtype);          // bytes per element
std::optional<Dtype> dtype_from_name(std::string_view name);
// "BOOL, U8, ..." for error messages.
std::string supported_dtype_names();
// A name as it appears in error messages: JSON-quoted (so control bytes and quotes stay
// visible) and cut at 200 characters.
std::string quote_name(std::string_view name);

// One tensor as the header describes it; begin/end are relative to the data section.
struct HeaderEntry {
  std::string name;
  Dtype dtype = Dtype::kU8;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

struct ParsedHeader {
  uint64_t header_bytes = 0;                    // the JSON length N from the first 8 bytes
  uint64_t data_start = 0;                      // 8 + N: where offsets count from
  uint64_t data_bytes = 0;                      // file_size - data_start
  std::vector<HeaderEntry> tensors;             // ordered by (begin, end, name): file order
  std::map<std::string, std::string> metadata;  // "__metadata__"
};

// A header bigger than this is rejected before anything is allocated for it; real headers are
// well under 1 MB even for models with tens of thousands of tensors.
inline constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// Reads and checks the 8-byte little-endian header length against the file size and the cap;
// `prefix` must hold at least the first 8 bytes the file has. Returns N.
uint64_t parse_header_length(std::string_view prefix, uint64_t file_size,
                             const std::string& filename);

// Parses and validates the header of a safetensors file of `file_size` bytes. `bytes` is the
// file or a prefix of it holding at least the 8 + N header bytes. Every tensor is checked:
// supported dtype, non-negative shape whose element count times the element size equals its
// byte range, range within the data section, no two non-empty ranges overlapping, no duplicate
// names. Throws dflash::Error naming `filename`, the tensor and what was expected.
ParsedHeader parse_safetensors_header(std::string_view bytes, uint64_t file_size,
                                      const std::string& filename);

// The 8-byte length, the JSON ("__metadata__" first, then tensors in the given order) and the
// space padding that makes the data section start 8-byte aligned. Entries must describe a
// contiguous data section starting at 0 in the given order, as every safetensors reader expects.
std::string build_safetensors_header(const std::vector<HeaderEntry>& tensors,
                                     const std::map<std::string, std::string>& metadata,
                                     const std::string& filename);

// model.safetensors.index.json as transformers writes it.
struct ParsedIndex {
  std::map<std::string, std::string> weight_map;  // tensor name -> shard file name
  std::vector<std::string> shards;                // distinct shard file names, sorted
  std::optional<uint64_t> total_size;             // metadata.total_size when present
};

// Validates that weight_map is an object of strings and that each shard is a plain file name in
// the index's directory (no path separators, no "..", so an index cannot point elsewhere).
ParsedIndex parse_index_json(std::string_view text, const std::string& filename);

std::string build_index_json(const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

}  // namespace dflash::io
