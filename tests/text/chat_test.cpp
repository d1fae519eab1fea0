// Chat rendering, ids and assistant masks against transformers' apply_chat_template with the
// official Qwen3 and Llama-3 templates (fixture: chat.json), and the per-line error reasons.
#include "data/chat.h"

#include <gtest/gtest.h>

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

std::string reason(std::string_view line) {
  try {
    parse_conversation(line);
  } catch (const ParseError& e) {
    return e.what();
  }
  return "accepted";
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
  EXPECT_EQ(reason(R"({"messages": [{"role": "tool", "content": "x"}]})"),
            "message 0 has unknown role \"tool\"");
  EXPECT_EQ(reason(R"({"conversations": [{"from": "bot", "value": "x"}]})"),
            "message 0 has unknown role \"bot\"");
  EXPECT_EQ(reason(R"({"messages": [{"role": "user", "content": ["x"]}]})"),
            "message 0 content is not a string");
  EXPECT_EQ(reason(R"({"messages": [{"content": "x"}]})"), "message 0 has no \"role\"");
  EXPECT_EQ(reason("{\"messages\": \"\xC3(\"}"), "invalid UTF-8 at byte 14");
  EXPECT_EQ(reason(R"({"messages": [], "conversations": []})"),
            "has both \"messages\" and \"conversations\"");
  EXPECT_EQ(reason(R"({"conversations": [{"from": "human", "value": "q"},
                                         {"from": "gpt", "value": "a"}]})"),
            "accepted");
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

TEST(ChatRender, ForcedFormatAndUnknownTemplate) {
  auto dir = tokenizer_fixtures() / "gpt2";  // its tokenizer_config.json has no chat template
  EXPECT_THROW(detect_chat_config(dir), dflash::Error);
  EXPECT_EQ(detect_chat_config(dir, ChatFormat::kQwen3).format, ChatFormat::kQwen3);
  EXPECT_EQ(chat_format_from_name("llama3"), ChatFormat::kLlama3);
  EXPECT_FALSE(chat_format_from_name("chatml").has_value());
}

}  // namespace
}  // namespace dflash::data
