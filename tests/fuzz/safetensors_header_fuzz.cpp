// libFuzzer target: arbitrary bytes as a whole .safetensors file. Beyond "no crash", it checks
// what a successful parse promises (ranges inside the data section, sizes matching shapes, no
// overlaps) and that building a header from the result parses back to the same tensors.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string_view>

#include "common/error.h"
#include "io/safetensors_header.h"

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace dflash::io;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ParsedHeader h;
  try {
    h = parse_safetensors_header(bytes, size, "fuzz.safetensors");
  } catch (const dflash::Error&) {
    return 0;  // rejecting is fine; any other exception escapes and is reported as a crash
  }
  check(h.data_start == 8 + h.header_bytes && h.data_start + h.data_bytes == size, "layout");
  uint64_t max_end = 0;
  uint64_t packed = 0;
  std::vector<HeaderEntry> repacked;
  for (const auto& e : h.tensors) {
    check(e.begin <= e.end && e.end <= h.data_bytes, "range inside data section");
    uint64_t numel = 1;
    for (int64_t d : e.shape) {
      check(d >= 0, "non-negative dims");
      numel *= static_cast<uint64_t>(d);
    }
    check(numel * dtype_size(e.dtype) == e.end - e.begin, "size matches shape");
    if (e.begin != e.end) {
      check(e.begin >= max_end, "no overlap");
      max_end = e.end;
    }
    HeaderEntry r = e;
    r.begin = packed;
    r.end = packed + (e.end - e.begin);
    packed = r.end;
    repacked.push_back(r);
  }
  // The writer needs a gap-free data section, so compact the offsets before rebuilding.
  std::string header = build_safetensors_header(repacked, h.metadata, "fuzz-rebuilt");
  check(header.size() % 8 == 0, "header padded to 8 bytes");
  ParsedHeader again = parse_safetensors_header(header, header.size() + packed, "fuzz-rebuilt");
  check(again.metadata == h.metadata, "metadata round trip");
  check(again.tensors.size() == repacked.size(), "tensor count round trip");
  std::map<std::string, const HeaderEntry*> by_name;
  for (const auto& e : again.tensors) by_name[e.name] = &e;
  for (const auto& e : repacked) {
    auto it = by_name.find(e.name);
    check(it != by_name.end(), "name round trip");
    const HeaderEntry& a = *it->second;
    check(a.dtype == e.dtype && a.shape == e.shape && a.begin == e.begin && a.end == e.end,
          "entry round trip");
  }
  return 0;
}
