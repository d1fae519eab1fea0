// data: chat JSONL (ShareGPT and OpenAI-messages forms) to token ids with assistant-only loss
// masks, rendered exactly as the official Qwen3 and Llama-3 chat templates render them; the
// prepared-dataset format (shards, index, manifest) and its memory-mapped reader live in
// dataset.h, the parallel `prepare` pipeline in prepare.h.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/error.h"
#include "tokenizer/tokenizer.h"

namespace dflash::data {

// A bad input line: the message is the reason only; callers add "file:line: ".
class ParseError : public dflash::Error {
 public:
  using dflash::Error::Error;
};

enum class Role { kSystem, kUser, kAssistant };

struct Message {
  Role role;
  std::string content;
  std::optional<std::string> reasoning;  // OpenAI-form `reasoning_content`, if given
};

struct Conversation {
  std::vector<Message> messages;
};

// Parses one JSONL line: {"messages": [{"role", "content"}...]} or
// {"conversations": [{"from", "value"}...]} (ShareGPT: human/gpt/system, also user/assistant).
// Throws ParseError for invalid UTF-8, malformed JSON, a wrong schema, unknown roles, and
// conversations without a non-empty assistant turn.
Conversation parse_conversation(std::string_view line);

enum class ChatFormat { kQwen3, kLlama3 };
std::string_view chat_format_name(ChatFormat f);
std::optional<ChatFormat> chat_format_from_name(std::string_view name);

// What a model directory's tokenizer_config.json says: the chat format recognized from its
// chat_template and the BOS text the template uses. Unrecognized templates are an error that
// says to pass --chat-format.
struct ChatConfig {
  ChatFormat format;
  std::string bos_token;
};
ChatConfig detect_chat_config(const std::filesystem::path& model_dir,
                              std::optional<ChatFormat> forced = std::nullopt);

// The text the official template renders (add_generation_prompt=False), with the byte spans of
// what the model must learn: each assistant body through its end-of-turn token (<|im_end|> or
// <|eot_id|>), excluding the role header. For Qwen3 the body of the assistant turn after the
// last user query includes the template's empty "<think>\n\n</think>\n\n" block.
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant_spans;
};
RenderedChat render_chat(const Conversation& conv, const ChatConfig& config);

// The prompt from which a model writes its next assistant turn: `history` (ending with a user
// turn) rendered as the official template renders it with add_generation_prompt=True. For
// Qwen3, enable_thinking=false ends the prompt with the template's empty think block
// ("<think>\n\n</think>\n\n"), which switches reasoning off; Llama-3 ignores it.
std::string render_generation_prompt(const Conversation& history, const ChatConfig& config,
                                     bool enable_thinking = true);

// Tokenizes the whole rendered text at once (as apply_chat_template does, so ids match even
// where a token crosses a turn boundary) and marks every token that overlaps an assistant span,
// which is transformers' return_assistant_tokens_mask rule.
struct TokenizedChat {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
};
void tokenize_chat(const tok::Tokenizer& tokenizer, const RenderedChat& chat, TokenizedChat& out);

}  // namespace dflash::data
