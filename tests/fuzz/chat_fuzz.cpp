// libFuzzer target for the chat JSONL parser and renderer: a line either parses or is rejected
// with ParseError; a parsed line renders in every format (or is rejected by it with
// ParseError), tokenizes, and its mask covers exactly the tokens of its assistant spans. Build and
// run: scripts/fuzz_text.sh.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "data/chat.h"
#include "tokenizer/tokenizer.h"

namespace {

dflash::tok::Tokenizer* qwen;
dflash::tok::Tokenizer* llama;

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
  qwen = new dflash::tok::Tokenizer(dflash::tok::Tokenizer::load(base + "/qwen3"));
  llama = new dflash::tok::Tokenizer(dflash::tok::Tokenizer::load(base + "/llama3"));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view line(reinterpret_cast<const char*>(data), size);
  dflash::data::Conversation conv;
  try {
    conv = dflash::data::parse_conversation(line);
  } catch (const dflash::data::ParseError&) {
    return 0;
  }
  size_t assistants = 0;
  for (const auto& m : conv.messages) assistants += m.role == dflash::data::Role::kAssistant;
  using dflash::data::ChatFormat;
  for (int variant = 0; variant < 4; ++variant) {
    const ChatFormat format = variant < 2    ? ChatFormat::kQwen3
                              : variant == 2 ? ChatFormat::kLlama3
                                             : ChatFormat::kLlama31;
    dflash::data::ChatConfig cfg{format, "<|begin_of_text|>"};
    cfg.enable_thinking = variant != 1;
    dflash::data::RenderedChat r;
    try {  // a template may be unable to render a line (tool turns in Llama-3)
      r = dflash::data::render_chat(conv, cfg);
    } catch (const dflash::data::ParseError&) {
      continue;
    }
    check(r.assistant_spans.size() == assistants, "one span per assistant turn");
    for (auto [b, e] : r.assistant_spans) check(b < e && e <= r.text.size(), "span in text");
    dflash::data::TokenizedChat t;
    dflash::data::tokenize_chat(format == dflash::data::ChatFormat::kQwen3 ? *qwen : *llama, r, t);
    check(t.ids.size() == t.mask.size(), "mask per id");
    size_t masked = 0;
    for (uint8_t m : t.mask) masked += m;
    check(masked >= assistants, "every assistant turn supervised (its end-of-turn token)");
  }
  return 0;
}
