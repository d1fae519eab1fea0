// libFuzzer target for the tokenizer: arbitrary bytes through encode (the three fixture
// tokenizers), decode of arbitrary ids, and tokenizer.json loading. Any exception other than
// dflash::Error, any sanitizer report or a broken invariant is a crash.
// Build and run: scripts/fuzz_text.sh (needs the fixtures from the make_fixtures test).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"

namespace {

std::vector<dflash::tok::Tokenizer>* tokenizers;

void check(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "invariant broken: %s\n", what);
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* dir = getenv("DFLASH_FUZZ_FIXTURES");
  std::string base = dir ? dir : "build-text/fixtures/tokenizer";
  tokenizers = new std::vector<dflash::tok::Tokenizer>();
  for (const char* kind : {"qwen3", "llama3", "gpt2"}) {
    tokenizers->push_back(dflash::tok::Tokenizer::load(base + "/" + kind));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  uint8_t mode = data[0];
  std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const auto& tok = (*tokenizers)[mode % tokenizers->size()];
  if (mode >= 0xF0) {  // loading: must accept or reject with dflash::Error
    try {
      dflash::tok::Tokenizer::from_json(text, "fuzz.json");
    } catch (const dflash::Error&) {
    }
    return 0;
  }
  if (mode >= 0xE0) {  // decode arbitrary ids
    std::vector<int32_t> ids(text.size() / 4);
    if (!ids.empty()) memcpy(ids.data(), text.data(), ids.size() * 4);
    for (auto& id : ids) id %= static_cast<int32_t>(tok.vocab_size() + 8);
    std::string out = tok.decode(ids, mode & 1);
    check(dflash::tok::find_invalid_utf8(out) == std::string_view::npos, "decode gives UTF-8");
    return 0;
  }
  bool valid = dflash::tok::find_invalid_utf8(text) == std::string_view::npos;
  std::vector<int32_t> ids;
  std::vector<uint32_t> offsets;
  try {
    tok.encode(text, false, ids, &offsets);
  } catch (const dflash::Error&) {
    check(!valid, "only invalid UTF-8 is rejected");
    return 0;
  }
  check(valid, "invalid UTF-8 is rejected");
  check(ids.size() == offsets.size(), "one offset per id");
  for (size_t k = 0; k < ids.size(); ++k) {
    check(ids[k] >= 0 && static_cast<size_t>(ids[k]) < tok.vocab_size(), "id in range");
    check(offsets[k] <= text.size() && (k == 0 || offsets[k - 1] <= offsets[k]), "offsets");
  }
  std::string back = tok.decode(ids, false);
  // With NFC, each stretch between added tokens is normalized on its own (HF's order), so the
  // round trip is exact up to normalization of the whole.
  if (tok.has_normalizer()) {
    check(dflash::tok::nfc(back) == dflash::tok::nfc(text), "nfc(decode(encode(t))) == nfc(t)");
  } else {
    check(back == text, "decode(encode(text)) == text");
  }
  if (mode & 1) {  // the post-processor only adds tokens around the same ids
    auto with = tok.encode(text, true);
    check(with.size() >= ids.size(), "special tokens only add");
  }
  return 0;
}
