#include "io/safetensors_header.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <unordered_set>

#include "common/error.h"

namespace dflash::io {
namespace {

using nlohmann::json;

struct DtypeRow {
  Dtype dtype;
  std::string_view name;
  uint64_t size;
};

constexpr DtypeRow kDtypes[] = {
    {Dtype::kBool, "BOOL", 1}, {Dtype::kU8, "U8", 1},          {Dtype::kI8, "I8", 1},
    {Dtype::kI16, "I16", 2},   {Dtype::kI32, "I32", 4},        {Dtype::kI64, "I64", 8},
    {Dtype::kF16, "F16", 2},   {Dtype::kBF16, "BF16", 2},      {Dtype::kF32, "F32", 4},
    {Dtype::kF64, "F64", 8},   {Dtype::kF8E4M3, "F8_E4M3", 1}, {Dtype::kF8E5M2, "F8_E5M2", 1},
};

const DtypeRow& row(Dtype dtype) {
  for (const auto& r : kDtypes) {
    if (r.dtype == dtype) return r;
  }
  fail("invalid Dtype value {}", static_cast<int>(dtype));
}

// The ATen shape limit is far above this, but no real tensor has more dimensions, and capping
// keeps a hostile header from making every consumer iterate over millions of dims.
constexpr size_t kMaxDims = 64;
// Real headers nest three deep; the cap bounds the work a hostile one can cause.
constexpr int kMaxJsonDepth = 64;

// A short rendering of a JSON value for error messages, so a hostile header cannot make the
// message itself huge.
std::string describe(const json& v) {
  if (v.is_object()) return "an object";
  if (v.is_array()) return fmt::format("an array of {}", v.size());
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

}  // namespace

std::string quote_name(std::string_view s) {
  std::string q = json(std::string(s)).dump(-1, ' ', false, json::error_handler_t::replace);
  if (q.size() > 200) q = q.substr(0, 197) + "...";
  return q;
}

namespace {

// nlohmann silently keeps the last of duplicate keys, so two tools could disagree about which
// tensor a name denotes; reject duplicates instead, and bound the nesting depth.
json parse_json_strict(std::string_view text, const std::string& filename, std::string_view what) {
  std::vector<std::unordered_set<std::string>> keys;  // one set per open object
  json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) {
          fail("{}: {} nests deeper than {} levels", filename, what, kMaxJsonDepth);
        }
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && parsed.is_string() &&
            !keys.back().insert(parsed.get_ref<const std::string&>()).second) {
          fail("{}: {} has the key {} twice in one object (duplicate tensor or field)", filename,
               what, quote_name(parsed.get_ref<const std::string&>()));
        }
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), check);
  } catch (const json::exception& e) {
    fail("{}: {} is not valid JSON: {}", filename, what, e.what());
  }
}

// Non-negative integers arrive as unsigned, but "-0" arrives as a signed zero.
std::optional<uint64_t> as_count(const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

HeaderEntry parse_entry(const std::string& name, const json& v, uint64_t data_bytes,
                        const std::string& file) {
  const std::string qn = quote_name(name);
  if (!v.is_object()) {
    fail("{}: tensor {}: expected an object with dtype, shape and data_offsets, got {}", file, qn,
         describe(v));
  }
  auto field = [&](const char* key) -> const json& {
    auto it = v.find(key);
    if (it == v.end()) fail("{}: tensor {}: missing \"{}\"", file, qn, key);
    return *it;
  };
  HeaderEntry e;
  e.name = name;

  const json& dtype = field("dtype");
  if (!dtype.is_string())
    fail("{}: tensor {}: dtype must be a string, got {}", file, qn, describe(dtype));
  auto parsed_dtype = dtype_from_name(dtype.get_ref<const std::string&>());
  if (!parsed_dtype) {
    fail("{}: tensor {}: unsupported dtype {} (supported: {})", file, qn, describe(dtype),
         supported_dtype_names());
  }
  e.dtype = *parsed_dtype;

  const json& shape = field("shape");
  if (!shape.is_array())
    fail("{}: tensor {}: shape must be an array, got {}", file, qn, describe(shape));
  if (shape.size() > kMaxDims) {
    fail("{}: tensor {}: shape has {} dimensions, more than the {} supported", file, qn,
         shape.size(), kMaxDims);
  }
  uint64_t numel = 1;
  bool overflow = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    auto dim = as_count(shape[i]);
    if (!dim || *dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("{}: tensor {}: shape[{}] must be a non-negative integer, got {}", file, qn, i,
           describe(shape[i]));
    }
    e.shape.push_back(static_cast<int64_t>(*dim));
    overflow = overflow || __builtin_mul_overflow(numel, *dim, &numel);
  }
  // A zero dimension makes the product 0 whatever overflowed before it.
  if (std::find(e.shape.begin(), e.shape.end(), 0) != e.shape.end()) {
    numel = 0;
    overflow = false;
  }
  uint64_t nbytes = 0;
  if (overflow || __builtin_mul_overflow(numel, dtype_size(e.dtype), &nbytes) ||
      numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    fail("{}: tensor {}: shape {} has too many elements to address", file, qn,
         shape_string(e.shape));
  }

  const json& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2) {
    fail("{}: tensor {}: data_offsets must be an array [begin, end], got {}", file, qn,
         describe(offsets));
  }
  auto begin = as_count(offsets[0]);
  auto end = as_count(offsets[1]);
  if (!begin || !end) {
    fail("{}: tensor {}: data_offsets must be two non-negative integers, got [{}, {}]", file, qn,
         describe(offsets[0]), describe(offsets[1]));
  }
  e.begin = *begin;
  e.end = *end;
  if (e.begin > e.end) {
    fail("{}: tensor {}: data_offsets [{}, {}] end before they begin", file, qn, e.begin, e.end);
  }
  if (e.end > data_bytes) {
    fail(
        "{}: tensor {}: data_offsets [{}, {}] extend past the end of the {}-byte data section "
        "(truncated file?)",
        file, qn, e.begin, e.end, data_bytes);
  }
  if (e.end - e.begin != nbytes) {
    fail("{}: tensor {}: dtype {} shape {} needs {} bytes, but data_offsets [{}, {}] span {}", file,
         qn, dtype_name(e.dtype), shape_string(e.shape), nbytes, e.begin, e.end, e.end - e.begin);
  }
  return e;
}

uint64_t load_le64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

// A shard must sit beside its index: a name with a path in it could read any file.
bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos;
}

}  // namespace

std::string_view dtype_name(Dtype dtype) { return row(dtype).name; }

uint64_t dtype_size(Dtype dtype) { return row(dtype).size; }

std::optional<Dtype> dtype_from_name(std::string_view name) {
  for (const auto& r : kDtypes) {
    if (r.name == name) return r.dtype;
  }
  return std::nullopt;
}

std::string supported_dtype_names() {
  std::vector<std::string_view> names;
  for (const auto& r : kDtypes) names.push_back(r.name);
  return fmt::format("{}", fmt::join(names, ", "));
}

uint64_t parse_header_length(std::string_view prefix, uint64_t file_size,
                             const std::string& filename) {
  if (file_size < 8) {
    fail(
        "{}: file is {} bytes, too short for the 8-byte header length a safetensors file starts "
        "with",
        filename, file_size);
  }
  if (prefix.size() < 8) {
    fail("{}: only {} bytes given, need 8 to read the header length", filename, prefix.size());
  }
  uint64_t n = load_le64(prefix.data());
  if (n > kMaxHeaderBytes) {
    fail("{}: header length {} exceeds the limit of {} bytes (not a safetensors file?)", filename,
         n, kMaxHeaderBytes);
  }
  if (n > file_size - 8) {
    fail("{}: header length {} runs past the end of the {}-byte file (truncated?)", filename, n,
         file_size);
  }
  return n;
}

ParsedHeader parse_safetensors_header(std::string_view bytes, uint64_t file_size,
                                      const std::string& filename) {
  ParsedHeader out;
  out.header_bytes = parse_header_length(bytes, file_size, filename);
  out.data_start = 8 + out.header_bytes;
  out.data_bytes = file_size - out.data_start;
  if (bytes.size() < out.data_start) {
    fail("{}: only {} bytes given, need the {} bytes of the header", filename, bytes.size(),
         out.data_start);
  }
  std::string_view text = bytes.substr(8, out.header_bytes);
  // Checked first so that a pickle or other file with a .safetensors name gets a clear message.
  if (text.empty() || text.front() != '{') {
    fail("{}: header does not start with '{{' (not a safetensors file?)", filename);
  }
  json header = parse_json_strict(text, filename, "safetensors header");
  if (!header.is_object()) {
    fail("{}: safetensors header must be a JSON object, got {}", filename, describe(header));
  }
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        fail("{}: __metadata__ must be an object of strings, got {}", filename, describe(value));
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          fail("{}: __metadata__ entry {} must be a string, got {}", filename, quote_name(mk),
               describe(mv));
        }
        out.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    out.tensors.push_back(parse_entry(key, value, out.data_bytes, filename));
  }
  std::sort(out.tensors.begin(), out.tensors.end(), [](const HeaderEntry& a, const HeaderEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  // Gaps are tolerated (nothing reads them), overlaps are not: two tensors sharing bytes means
  // the header is corrupt, and a write through one would change the other.
  const HeaderEntry* last = nullptr;
  for (const auto& e : out.tensors) {
    if (e.begin == e.end) continue;
    if (last && e.begin < last->end) {
      fail("{}: tensors {} (bytes [{}, {})) and {} (bytes [{}, {})) overlap", filename,
           quote_name(last->name), last->begin, last->end, quote_name(e.name), e.begin, e.end);
    }
    if (!last || e.end > last->end) last = &e;
  }
  return out;
}

std::string build_safetensors_header(const std::vector<HeaderEntry>& tensors,
                                     const std::map<std::string, std::string>& metadata,
                                     const std::string& filename) {
  // Built by hand rather than through an ordered json object, whose inserts are linear.
  std::string js = "{";
  try {
    if (!metadata.empty()) js += "\"__metadata__\":" + json(metadata).dump();
    std::unordered_set<std::string_view> seen;
    uint64_t expect = 0;
    for (const auto& e : tensors) {
      const std::string qn = quote_name(e.name);
      if (e.name == "__metadata__") {
        fail("{}: a tensor cannot be named __metadata__ (the key is reserved)", filename);
      }
      if (!seen.insert(e.name).second) fail("{}: tensor {} given twice", filename, qn);
      uint64_t numel = 1;
      for (int64_t d : e.shape) {
        if (d < 0)
          fail("{}: tensor {}: negative dimension in shape {}", filename, qn,
               shape_string(e.shape));
        numel *= static_cast<uint64_t>(d);
      }
      if (e.begin != expect || e.end - e.begin != numel * dtype_size(e.dtype)) {
        fail(
            "{}: tensor {}: data_offsets [{}, {}] do not follow the previous tensor at {} with "
            "the size of dtype {} shape {}",
            filename, qn, e.begin, e.end, expect, dtype_name(e.dtype), shape_string(e.shape));
      }
      expect = e.end;
      if (js.size() > 1) js += ',';
      js += fmt::format("{}:{{\"dtype\":\"{}\",\"shape\":{},\"data_offsets\":[{},{}]}}",
                        json(e.name).dump(), dtype_name(e.dtype),
                        fmt::format("[{}]", fmt::join(e.shape, ",")), e.begin, e.end);
    }
  } catch (const json::exception& e) {
    fail("{}: cannot encode the header ({}); tensor names and metadata must be valid UTF-8",
         filename, e.what());
  }
  js += '}';
  // The data section must start 8-byte aligned; the format pads the JSON with spaces.
  js.append((8 - (8 + js.size()) % 8) % 8, ' ');
  if (js.size() > kMaxHeaderBytes) {
    fail("{}: header would be {} bytes, over the {}-byte limit readers accept", filename, js.size(),
         kMaxHeaderBytes);
  }
  std::string out(8, '\0');
  uint64_t n = js.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + js;
}

ParsedIndex parse_index_json(std::string_view text, const std::string& filename) {
  json index = parse_json_strict(text, filename, "checkpoint index");
  if (!index.is_object()) {
    fail("{}: checkpoint index must be a JSON object with \"weight_map\", got {}", filename,
         describe(index));
  }
  ParsedIndex out;
  auto wm = index.find("weight_map");
  if (wm == index.end()) fail("{}: checkpoint index has no \"weight_map\"", filename);
  if (!wm->is_object()) {
    fail("{}: \"weight_map\" must be an object mapping tensor names to shard files, got {}",
         filename, describe(*wm));
  }
  std::set<std::string> shards;
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string()) {
      fail("{}: weight_map entry for tensor {} must be a shard file name, got {}", filename,
           quote_name(name), describe(shard));
    }
    const auto& s = shard.get_ref<const std::string&>();
    if (!plain_file_name(s)) {
      fail("{}: weight_map puts tensor {} in {}, which is not a plain file name beside the index",
           filename, quote_name(name), quote_name(s));
    }
    out.weight_map.emplace(name, s);
    shards.insert(s);
  }
  out.shards.assign(shards.begin(), shards.end());
  auto meta = index.find("metadata");
  if (meta != index.end() && !meta->is_null()) {
    if (!meta->is_object()) {
      fail("{}: \"metadata\" must be an object, got {}", filename, describe(*meta));
    }
    auto total = meta->find("total_size");
    if (total != meta->end()) {
      if (auto n = as_count(*total)) {
        out.total_size = *n;
      } else if (total->is_number_float() && std::isfinite(total->get<double>()) &&
                 total->get<double>() >= 0 && total->get<double>() < 0x1p63) {
        // Some writers store the size as a float; it is informational only.
        out.total_size = static_cast<uint64_t>(total->get<double>());
      } else {
        fail("{}: metadata.total_size must be a non-negative number, got {}", filename,
             describe(*total));
      }
    }
  }
  return out;
}

std::string build_index_json(const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  json index;
  index["metadata"]["total_size"] = total_size;
  index["weight_map"] = weight_map;
  return index.dump(2) + "\n";
}

}  // namespace dflash::io
