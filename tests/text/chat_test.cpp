// Chat rendering, ids and assistant masks against transformers' apply_chat_template with the
// official Qwen3 and Llama-3 templates (fixture: chat.json), and the per-line error reasons.
#include "data/chat.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "text_fixtures.h"

namespace dflash::data {
namespace {

using dflash::testing::load_fixture_json;
using dflash::testing::tokenizer_fixtures;

class ChatParity : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatParity, TextIdsAndMasksMatchTransformers) {
  auto ref = load_fixture_json(tokenizer_fixtures() / "chat.json");
  ASSERT_FALSE(ref.is_null());
  auto dir = tokenizer_fixtures() / GetParam();
  auto tokenizer = tok::Tokenizer::load(dir);
  ChatConfig config = detect_chat_config(dir);
  EXPECT_EQ(chat_format_name(config.format), GetParam());
  const auto& want = ref[GetParam()];
  size_t supervised = 0;
  for (size_t i = 0; i < ref["lines"].size(); ++i) {
    Conversation conv = parse_conversation(ref["lines"][i].get<std::string>());
    RenderedChat r = render_chat(conv, config);
    ASSERT_EQ(r.text, want["texts"][i].get<std::string>()) << "line " << i;
    TokenizedChat t;
    tokenize_chat(tokenizer, r, t);
    ASSERT_EQ(t.ids, want["ids"][i].get<std::vector<int32_t>>()) << "line " << i;
    ASSERT_EQ(t.mask, want["masks"][i].get<std::vector<uint8_t>>()) << "line " << i;
    for (uint8_t m : t.mask) supervised += m;
  }
  EXPECT_GT(supervised, 10000u);
}

TEST_P(ChatParity, GenerationPromptsMatchTransformers) {
  // add_generation_prompt=True for every history that ends before an assistant turn, with
  // Qwen3's enable_thinking on and off.
  auto ref = load_fixture_json(tokenizer_fixtures() / "chat.json");
  ASSERT_FALSE(ref.is_null());
  ChatConfig config = detect_chat_config(tokenizer_fixtures() / GetParam());
  const auto& cases = ref[GetParam()]["generation"];
  ASSERT_GT(cases.size(), 60u);
  for (const auto& c : cases) {
    const size_t line = c["line"].get<size_t>();
    Conversation conv = parse_conversation(ref["lines"][line].get<std::string>());
    conv.messages.resize(c["messages"].get<size_t>());
    SCOPED_TRACE("line " + std::to_string(line) + ", " + c["messages"].dump() + " messages");
    EXPECT_EQ(render_generation_prompt(conv, config), c["thinking"].get<std::string>());
    EXPECT_EQ(render_generation_prompt(conv, config, false), c["no_thinking"].get<std::string>());
  }
}

INSTANTIATE_TEST_SUITE_P(chat, ChatParity, ::testing::Values("qwen3", "llama3"));

// The plain lines and the tool lines (tool definitions, OpenAI-form calls, tool results,
// reasoning in several spellings) under each template and option set: text, ids and masks equal
// transformers', and a line the template cannot render is rejected.
class ChatCase : public ::testing::TestWithParam<std::string> {};

TEST_P(ChatCase, TextIdsAndMasksMatchTransformers) {
  auto ref = load_fixture_json(tokenizer_fixtures() / "chat.json");
  ASSERT_FALSE(ref.is_null());
  const auto& c = ref["cases"][GetParam()];
  auto dir = tokenizer_fixtures() / c["tokenizer"].get<std::string>();
  auto tokenizer = tok::Tokenizer::load(dir);
  ChatConfig config = detect_chat_config(dir);
  EXPECT_EQ(chat_format_name(config.format), GetParam().substr(0, GetParam().find('_')));
  config.enable_thinking = c["enable_thinking"].get<bool>();
  config.keep_history_reasoning = c["keep_history_reasoning"].get<bool>();
  config.validate();
  std::vector<std::string> lines = ref["lines"];
  for (const auto& l : ref["tool_lines"]) lines.push_back(l);
  const size_t plain = ref["lines"].size();
  ASSERT_EQ(c["results"].size(), lines.size());
  size_t supervised = 0, tool_lines_rendered = 0, rejected = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    SCOPED_TRACE("line " + std::to_string(i) + ": " + lines[i]);
    const auto& want = c["results"][i];
    if (want.is_null()) {
      EXPECT_THROW(render_chat(parse_conversation(lines[i]), config), ParseError);
      ++rejected;
      continue;
    }
    RenderedChat r = render_chat(parse_conversation(lines[i]), config);
    ASSERT_EQ(r.text, want["text"].get<std::string>());
    TokenizedChat t;
    tokenize_chat(tokenizer, r, t);
    ASSERT_EQ(t.ids, want["ids"].get<std::vector<int32_t>>());
    ASSERT_EQ(t.mask, want["mask"].get<std::vector<uint8_t>>());
    for (uint8_t m : t.mask) supervised += m;
    tool_lines_rendered += i >= plain;
  }
  EXPECT_GT(supervised, 15000u);
  if (GetParam() == "llama3") {
    EXPECT_GT(rejected, 75u);  // tool lines: the Llama-3 template has no tool turns
  } else {
    EXPECT_GT(tool_lines_rendered, 70u);
  }
  // Generation prompts (add_generation_prompt=True) of the tool lines' histories.
  for (const auto& g : c["generation"]) {
    Conversation conv = parse_conversation(lines[g["line"].get<size_t>()]);
    conv.messages.resize(g["messages"].get<size_t>());
    SCOPED_TRACE("generation prompt, line " + g["line"].dump() + ", " + g["messages"].dump());
    EXPECT_EQ(render_generation_prompt(conv, config), g["thinking"].get<std::string>());
    EXPECT_EQ(render_generation_prompt(conv, config, false), g["no_thinking"].get<std::string>());
  }
  if (GetParam() == "qwen3" || GetParam() == "llama3.1") {
    EXPECT_GT(c["generation"].size(), 150u);
  }
}

INSTANTIATE_TEST_SUITE_P(chat, ChatCase,
                         ::testing::Values("qwen3", "qwen3_thinking_off", "qwen3_history_reasoning",
                                           "llama3", "llama3.1"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '.', '_');
                           return name;
                         });

std::string reason(std::string_view line) {
  try {
    parse_conversation(line);
  } catch (const ParseError& e) {
    return e.what();
  }
  return "accepted";
}

TEST(ChatParse, Gsm8kLineIsOneUserTurnAndItsAnswer) {
  auto conv = parse_conversation(R"({"question": "How many?", "answer": "2 + 2 = 4\n#### 4"})");
  ASSERT_EQ(conv.messages.size(), 2u);
  EXPECT_EQ(conv.messages[0].role, Role::kUser);
  EXPECT_EQ(conv.messages[0].content, "How many?");
  EXPECT_EQ(conv.messages[1].role, Role::kAssistant);
  EXPECT_EQ(conv.messages[1].content, "2 + 2 = 4\n#### 4");
  EXPECT_EQ(reason(R"({"question": "q", "answer": " \n"})"), "empty answer");
  EXPECT_EQ(reason(R"({"question": 1, "answer": "a"})"),
            "\"question\" and \"answer\" must be strings");
}

TEST(ChatParse, BadLinesSayWhy) {
  EXPECT_EQ(reason("{\"messages\": ["), "malformed JSON: " + reason("{\"messages\": [").substr(16));
  EXPECT_NE(reason("{\"messages\": [").find("malformed JSON"), std::string::npos);
  EXPECT_EQ(reason("[1, 2]"), "a line must be a JSON object");
  EXPECT_NE(reason("{\"text\": \"x\"}").find("has neither"), std::string::npos);
  EXPECT_EQ(reason("{\"messages\": []}"), "no messages");
  EXPECT_EQ(reason("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}"),
            "no assistant turn");
  EXPECT_EQ(reason(R"({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": " \n"}]})"),
            "message 1: empty assistant turn");
  EXPECT_EQ(reason(R"({"messages": [{"role": "function", "content": "x"}]})"),
            "message 0 has unknown role \"function\"");
  EXPECT_EQ(reason(R"({"conversations": [{"from": "bot", "value": "x"}]})"),
            "message 0 has unknown role \"bot\"");
  EXPECT_EQ(reason(R"({"messages": [{"role": "user", "content": ["x"]}]})"),
            "message 0 content part 0 is not an object with a \"type\"");
  EXPECT_EQ(reason(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})"),
            "message 0 content part 0 is of type \"image_url\": only text parts (a \"text\" "
            "string) are supported");
  EXPECT_EQ(reason(R"({"messages": [{"role": "user", "content": 3}]})"),
            "message 0 content is not a string or a list of text parts");
  EXPECT_EQ(reason(R"({"messages": [{"content": "x"}]})"), "message 0 has no \"role\"");
  EXPECT_EQ(reason("{\"messages\": \"\xC3(\"}"), "invalid UTF-8 at byte 14");
  // nlohmann reports a number beyond double's range as out_of_range, not parse_error.
  EXPECT_NE(reason(R"({"messages": [{"role": "user", "content": "q", "x": 2e999}]})")
                .find("malformed JSON"),
            std::string::npos);
  EXPECT_NE(reason(R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
      "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{\"x\": 1e999}"}}]}]})")
                .find("arguments are not valid JSON"),
            std::string::npos);
  EXPECT_EQ(reason(R"({"messages": [], "conversations": []})"),
            "has both \"messages\" and \"conversations\"");
  EXPECT_EQ(reason(R"({"conversations": [{"from": "human", "value": "q"},
                                         {"from": "gpt", "value": "a"}]})"),
            "accepted");
}

TEST(ChatParse, ToolLinesSayWhatIsWrong) {
  const std::string user = R"({"role": "user", "content": "q"}, )";
  auto with = [&](const std::string& assistant) {
    return reason(R"({"messages": [)" + user + assistant + "]}");
  };
  EXPECT_EQ(with(R"({"role": "assistant", "content": null})"),
            "message 1 content is not a string or a list of text parts");
  EXPECT_EQ(with(R"({"role": "assistant", "content": "", "tool_calls": []})"),
            "message 1: empty assistant turn");
  EXPECT_EQ(with(R"({"role": "assistant", "content": null, "tool_calls": [{"name": "f"}]})"),
            "message 1 tool call 0 has no \"function\" object");
  EXPECT_EQ(with(R"({"role": "assistant", "content": null, "tool_calls": [
                     {"function": {"name": "f", "arguments": "{\"a\": "}}]})"),
            "message 1 tool call 0 arguments are not valid JSON");
  EXPECT_EQ(with(R"({"role": "assistant", "content": null, "tool_calls": [
                     {"function": {"name": "f", "arguments": "[1]"}}]})"),
            "message 1 tool call 0 arguments are not a JSON object");
  EXPECT_EQ(with(R"({"role": "assistant", "content": null, "tool_calls": [
                     {"function": {"arguments": {}}}]})"),
            "message 1 tool call 0 has no function name");
  EXPECT_EQ(reason(R"({"messages": [{"role": "user", "content": "q", "tool_calls": [{}]},
                                    {"role": "assistant", "content": "a"}]})"),
            "message 0 has tool_calls but is not an assistant turn");
  EXPECT_EQ(reason(R"({"tools": {}, "messages": [{"role": "assistant", "content": "a"}]})"),
            "\"tools\" is not a list");
  EXPECT_EQ(with(R"({"role": "assistant", "content": "a", "reasoning": 3})"),
            "message 1 reasoning is not a string");
  // Arguments given as a JSON string are re-serialized as json.dumps writes them.
  Conversation c = parse_conversation(R"({"messages": [)" + user + R"(
      {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function":
       {"name": "f", "arguments": "{\"b\":1e5,\"a\":[true,null,\"\\u00e9\\n\"]}"}}]}]})");
  ASSERT_EQ(c.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(c.messages[1].tool_calls[0].arguments,
            "{\"b\": 100000.0, \"a\": [true, null, \"\u00e9\\n\"]}");
}

TEST(ChatRender, TemplatesThatCannotRenderALineRejectIt) {
  auto reject = [](ChatFormat format, std::string_view line) {
    try {
      render_chat(parse_conversation(line), ChatConfig{format, "<|begin_of_text|>"});
    } catch (const ParseError& e) {
      return std::string(e.what());
    }
    return std::string("rendered");
  };
  const char* tool_result = R"({"messages": [{"role": "user", "content": "q"},
      {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]})";
  EXPECT_THAT(reject(ChatFormat::kLlama3, tool_result),
              ::testing::HasSubstr("the llama3 chat template has no tool calls"));
  EXPECT_EQ(reject(ChatFormat::kLlama31, tool_result), "rendered");
  const char* two_calls = R"({"messages": [{"role": "user", "content": "q"},
      {"role": "assistant", "content": null, "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}, {"function": {"name": "g", "arguments": {}}}]}]})";
  EXPECT_THAT(reject(ChatFormat::kLlama31, two_calls),
              ::testing::HasSubstr("message 1 has 2 tool calls; the template takes one per turn"));
  EXPECT_EQ(reject(ChatFormat::kQwen3, two_calls), "rendered");
}

TEST(ChatRender, OptionsCheckTheFormat) {
  ChatConfig llama{ChatFormat::kLlama31, "<|begin_of_text|>"};
  llama.enable_thinking = false;
  EXPECT_THROW(llama.validate(), dflash::Error);
  ChatConfig qwen{ChatFormat::kQwen3, ""};
  qwen.keep_history_reasoning = true;
  qwen.validate();
  qwen.enable_thinking = false;
  EXPECT_THROW(qwen.validate(), dflash::Error);
}

TEST(ChatRender, Qwen3ThinkBlockConvention) {
  ChatConfig cfg{ChatFormat::kQwen3, ""};
  Conversation c = parse_conversation(R"({"messages": [
      {"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r1</think>a1"},
      {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]})");
  RenderedChat r = render_chat(c, cfg);
  // Earlier turns lose their reasoning; the final turn gets the empty think block.
  EXPECT_EQ(r.text,
            "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
            "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            "a2<|im_end|>\n");
  ASSERT_EQ(r.assistant_spans.size(), 2u);
  EXPECT_EQ(r.text.substr(r.assistant_spans[0].first,
                          r.assistant_spans[0].second - r.assistant_spans[0].first),
            "a1<|im_end|>");
}

constexpr const char* kTwoTurns =
    R"({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},)"
    R"( {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]})";

// gpt-oss's harmony template (the o200k fixture's tokenizer_config.json): only the bodies of
// final and commentary messages with their end tokens are learned, analysis with
// supervise_reasoning; template_parity checks the same against transformers on a corpus.
TEST(ChatRender, HarmonyLearnsMessageBodies) {
  ChatConfig config = detect_chat_config(tokenizer_fixtures() / "o200k");
  ASSERT_EQ(config.format, ChatFormat::kTemplate);
  EXPECT_TRUE(config.harmony);
  auto learned = [&](const char* line) {
    const RenderedChat r = render_chat(parse_conversation(line), config);
    std::vector<std::string> out;
    for (const auto& [b, e] : r.assistant_spans) out.push_back(r.text.substr(b, e - b));
    return out;
  };
  const char* reasoning = R"({"messages": [{"role": "user", "content": "q"},
      {"role": "assistant", "content": "a", "reasoning_content": "r"}]})";
  const char* call = R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant",
      "content": "", "thinking": "t", "tool_calls": [{"type": "function", "function": {
      "name": "f", "arguments": {"x": 1}}}]}]})";
  using V = std::vector<std::string>;
  EXPECT_EQ(learned(reasoning), V{"a<|return|>"});
  EXPECT_EQ(learned(call), V{"{\"x\": 1}<|call|>"});
  config.supervise_reasoning = true;
  config.validate();
  EXPECT_EQ(learned(reasoning), (V{"r<|end|>", "a<|return|>"}));
  EXPECT_EQ(learned(call), (V{"t<|end|>", "{\"x\": 1}<|call|>"}));
  // The earlier turn ends with <|end|> once a later one follows: context only.
  const RenderedChat two = render_chat(parse_conversation(kTwoTurns), config);
  EXPECT_EQ(two.unlocated_turns, 1u);
  ASSERT_EQ(two.assistant_spans.size(), 1u);
  EXPECT_THAT(
      [&] {
        learned(R"({"messages": [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a<|end|>b"}]})");
      },
      ::testing::ThrowsMessage<ParseError>(::testing::HasSubstr("harmony chat template")));
  // The mask covers the tokens of the learned text, the harmony tokens of the header do not.
  const tok::Tokenizer tokenizer = tok::Tokenizer::load(tokenizer_fixtures() / "o200k");
  TokenizedChat t;
  tokenize_chat(tokenizer, render_chat(parse_conversation(reasoning), config), t);
  std::vector<int32_t> learned_ids;
  for (size_t k = 0; k < t.ids.size(); ++k) {
    if (t.mask[k]) learned_ids.push_back(t.ids[k]);
  }
  std::vector<int32_t> want = tokenizer.encode("r<|end|>", false);
  for (int32_t id : tokenizer.encode("a<|return|>", false)) want.push_back(id);
  EXPECT_EQ(learned_ids, want);
  // Other formats learn the reasoning they render already: the option is refused.
  ChatConfig qwen{ChatFormat::kQwen3, ""};
  qwen.supervise_reasoning = true;
  EXPECT_THROW(qwen.validate(), dflash::Error);
}

TEST(ChatRender, ForcedFormatAndUnknownTemplate) {
  auto dir = tokenizer_fixtures() / "gpt2";  // its tokenizer_config.json has no chat template
  EXPECT_THROW(detect_chat_config(dir), dflash::Error);
  EXPECT_EQ(detect_chat_config(dir, ChatFormat::kQwen3).format, ChatFormat::kQwen3);
  EXPECT_EQ(chat_format_from_name("llama3"), ChatFormat::kLlama3);
  EXPECT_EQ(chat_format_from_name("llama3.1"), ChatFormat::kLlama31);
  EXPECT_FALSE(chat_format_from_name("chatml").has_value());
  EXPECT_EQ(detect_chat_config(tokenizer_fixtures() / "llama31").format, ChatFormat::kLlama31);
}

TEST(ChatRender, Llama32TemplateRendersThroughTheInterpreter) {
  auto dir = dflash::testing::fresh_temp_dir("llama32");
  auto cfg = load_fixture_json(tokenizer_fixtures() / "llama31" / "tokenizer_config.json");
  std::string t = cfg["chat_template"];
  // Llama-3.2's template: the date from strftime_now when the renderer defines it.
  const std::string fixed = "{%- set date_string = \"26 Jul 2024\" %}";
  ASSERT_NE(t.find(fixed), std::string::npos);
  t.replace(t.find(fixed), fixed.size(),
            "{%- if strftime_now is defined %}{%- set date_string = strftime_now(\"%Y\") "
            "%}{%- else %}" +
                fixed + "{%- endif %}");
  cfg["chat_template"] = t;
  dflash::write_file_atomic(dir / "tokenizer_config.json", cfg.dump());
  const ChatConfig config = detect_chat_config(dir);
  EXPECT_EQ(config.format, ChatFormat::kTemplate);
  const RenderedChat r = render_chat(parse_conversation(kTwoTurns), config);
  const std::string year = std::to_string(1900 + [] {
    std::time_t now = std::time(nullptr);
    std::tm tm{};
    localtime_r(&now, &tm);
    return tm.tm_year;
  }());
  EXPECT_THAT(r.text, ::testing::HasSubstr("Today Date: " + year + "\n"));
  ASSERT_EQ(r.assistant_spans.size(), 2u);
  EXPECT_EQ(r.text.substr(r.assistant_spans[0].first,
                          r.assistant_spans[0].second - r.assistant_spans[0].first),
            "4<|eot_id|>");
  EXPECT_EQ(detect_chat_config(dir, ChatFormat::kLlama31).format, ChatFormat::kLlama31);
  std::filesystem::remove_all(dir);
}

// The built-in renderers are a fast path only: byte-identical to the Jinja interpreter running
// the official template they stand for, on every chat.json line both render, with and without
// the generation prompt and thinking.
TEST(ChatRender, BuiltinRenderersEqualTheirTemplates) {
  auto ref = load_fixture_json(tokenizer_fixtures() / "chat.json");
  ASSERT_FALSE(ref.is_null());
  for (const char* dir_name : {"qwen3", "llama3", "llama31"}) {
    SCOPED_TRACE(dir_name);
    const auto dir = tokenizer_fixtures() / dir_name;
    const ChatConfig builtin = detect_chat_config(dir);
    ASSERT_NE(builtin.format, ChatFormat::kTemplate);
    const ChatConfig jinja = detect_chat_config(dir, ChatFormat::kTemplate);
    ASSERT_EQ(jinja.format, ChatFormat::kTemplate);
    size_t compared = 0;
    for (size_t i = 0; i < ref["lines"].size(); ++i) {
      const Conversation conv = parse_conversation(ref["lines"][i].get<std::string>());
      std::string want;
      try {
        want = render_chat(conv, builtin).text;
      } catch (const ParseError&) {
        continue;  // the built-in renderer refuses what the template would render oddly
      }
      ASSERT_EQ(render_chat_text(conv, jinja), want) << "line " << i;
      Conversation history = conv;
      while (!history.messages.empty() && history.messages.back().role == Role::kAssistant) {
        history.messages.pop_back();
      }
      if (!history.messages.empty()) {
        for (bool thinking : {true, false}) {
          ASSERT_EQ(render_generation_prompt(history, jinja, thinking),
                    render_generation_prompt(history, builtin, thinking))
              << "line " << i << " thinking " << thinking;
        }
      }
      ++compared;
    }
    EXPECT_GT(compared, 100u);
  }
}

}  // namespace
}  // namespace dflash::data
