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

enum class Role { kSystem, kUser, kAssistant, kTool };

// An assistant's function call (OpenAI form: {"type": "function", "function": {"name",
// "arguments"}}).
struct ToolCall {
  std::string name;
  // The arguments as the templates' `tojson` writes them (Python's json.dumps). Arguments given
  // as a JSON string, as the OpenAI API sends them, are parsed first, as vLLM does before it
  // applies a chat template.
  std::string arguments;
};

struct Message {
  Role role;
  std::string content;  // "" for an assistant turn with tool calls and "content": null
  // `reasoning_content` (else `thinking`, else `reasoning`: transformers' aliases), if given.
  std::optional<std::string> reasoning;
  std::vector<ToolCall> tool_calls = {};  // assistant turns only
};

struct Conversation {
  std::vector<Message> messages;
  // The line's "tools" (function definitions), each as json.dumps writes it, compact (Qwen3)
  // and with indent=4 (Llama-3.1). nullopt: no "tools" key; an empty list is not the same for
  // Llama-3.1's template.
  std::optional<std::vector<std::string>> tools = std::nullopt, tools_indented = std::nullopt;
};

// Parses one JSONL line: {"messages": [{"role", "content"}...]} or
// {"conversations": [{"from", "value"}...]} (ShareGPT: human/gpt/system, also user/assistant),
// or {"question", "answer"} (GSM8K form: one user turn and its answer).
// Roles: system, user, assistant, tool (ShareGPT also human, gpt). Assistant turns may carry
// "tool_calls" (null or [] is none; "content" may then be null), the line a "tools" list.
// Throws ParseError for invalid UTF-8, malformed JSON, a wrong schema, unknown roles, tool-call
// arguments that are not a JSON object, and conversations without a non-empty assistant turn.
Conversation parse_conversation(std::string_view line);

enum class ChatFormat { kQwen3, kLlama3, kLlama31 };
std::string_view chat_format_name(ChatFormat f);
std::optional<ChatFormat> chat_format_from_name(std::string_view name);
// "qwen3, llama3 or llama3.1", for messages.
std::string_view chat_format_names();

// What a model directory's tokenizer_config.json says: the chat format recognized from its
// chat_template and the BOS text the template uses; then how to render (prepare's options).
// Unrecognized templates are an error that says to pass --chat-format.
struct ChatConfig {
  ChatFormat format;
  std::string bos_token;
  // Qwen3's `enable_thinking`. The template only reads it for the generation prompt, where false
  // appends the empty "<think>\n\n</think>\n\n" the model then answers after. Training data
  // rendered for thinking off is what such a prompt plus the response renders to: reasoning is
  // dropped from every assistant turn, and the final turn's empty think block is prompt, not
  // learned.
  bool enable_thinking = true;
  // Qwen3: assistant turns before the last user query keep their reasoning as a think block
  // (the template drops it): more reasoning to learn from, in a context the template never
  // renders. Needs enable_thinking.
  bool keep_history_reasoning = false;

  // Throws if the options do not fit the format or each other.
  void validate() const;
};
ChatConfig detect_chat_config(const std::filesystem::path& model_dir,
                              std::optional<ChatFormat> forced = std::nullopt);

// The text the official template renders (add_generation_prompt=False), with the byte spans of
// what the model must learn: each assistant body (with its tool calls) through its end-of-turn
// token (<|im_end|> or <|eot_id|>), excluding the role header; tool results are not learned.
// For Qwen3 the body of the assistant turn after the last user query includes the template's
// empty "<think>\n\n</think>\n\n" block (with thinking on). Throws ParseError for what the
// template cannot render (tool turns in the Llama-3 template, several calls in one Llama-3.1
// turn).
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
