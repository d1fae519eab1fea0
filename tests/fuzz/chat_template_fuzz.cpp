// libFuzzer target for the Jinja chat-template interpreter (src/chat): any bytes as a template,
// rendered against a conversation with tools. Parsing and rendering either succeed or throw
// TemplateError naming the place; anything else (another exception, a crash, UB, unbounded
// recursion or output) is a bug. Build and run: scripts/fuzz_text.sh (seeds: the real
// templates in tests/data/chat_templates).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>

#include "chat/template.h"

namespace {

const dflash::chat::Dict& variables() {
  static const dflash::chat::Dict vars = [] {
    const auto messages = nlohmann::ordered_json::parse(R"([
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather in Zürich?"},
      {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
       "tool_calls": [{"id": "call00001", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
      {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 3.5}"},
      {"role": "assistant", "content": "3.5 °C."}])");
    const auto tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {
      "name": "get_weather", "description": "Weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])");
    dflash::chat::Dict kwargs{{"bos_token", dflash::chat::Value("<s>")},
                              {"eos_token", dflash::chat::Value("</s>")},
                              {"enable_thinking", dflash::chat::Value(false)}};
    return dflash::chat::hf_template_variables(messages, tools, true, kwargs);
  }();
  return vars;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  dflash::chat::RenderOptions options;
  options.now = 1785067200;
  options.max_depth = 64;
  options.max_output = 1 << 20;
  try {
    const dflash::chat::Template t(source, "fuzz.jinja");
    const auto r = t.render(variables(), options);
    if (r.text.size() > options.max_output) {
      fprintf(stderr, "output of %zu bytes passed the limit\n", r.text.size());
      abort();
    }
    for (const auto& [b, e] : r.generation_spans) {
      if (b > e || e > r.text.size()) abort();
    }
  } catch (const dflash::chat::TemplateError& e) {
    if (std::string(e.what()).rfind("fuzz.jinja:", 0) != 0) {
      fprintf(stderr, "error without the template's place: %s\n", e.what());
      abort();
    }
  }
  return 0;
}
