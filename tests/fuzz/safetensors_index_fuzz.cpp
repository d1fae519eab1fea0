// libFuzzer target: arbitrary bytes as model.safetensors.index.json. Checks that accepted
// indexes only name plain shard files and that building an index from the result parses back.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
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
  std::string_view text(reinterpret_cast<const char*>(data), size);
  ParsedIndex index;
  try {
    index = parse_index_json(text, "fuzz.index.json");
  } catch (const dflash::Error&) {
    return 0;  // rejecting is fine; any other exception escapes and is reported as a crash
  }
  for (const auto& [name, shard] : index.weight_map) {
    check(!shard.empty() && shard.find('/') == std::string::npos && shard != "..", "plain shard");
    check(std::binary_search(index.shards.begin(), index.shards.end(), shard), "shard listed");
  }
  ParsedIndex again =
      parse_index_json(build_index_json(index.weight_map, index.total_size.value_or(0)), "rebuilt");
  check(again.weight_map == index.weight_map, "weight_map round trip");
  check(again.shards == index.shards, "shards round trip");
  return 0;
}
