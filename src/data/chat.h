// data: chat JSONL (ShareGPT and OpenAI-messages forms) to token ids with assistant-only loss
// masks, rendered by the model's own Jinja chat template (src/chat), exactly as transformers'
// apply_chat_template renders it; the official Qwen3 and Llama-3 templates have built-in
// renderers as a fast path (tests prove them byte-identical to the templates). The
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

#include "chat/template.h"
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
  std::string id = {};  // the call's "id", if given (some templates check or print it)
};

struct Message {
  Role role;
  std::string content;  // "" for an assistant turn with tool calls and "content": null
  // `reasoning_content` (else `thinking`, else `reasoning`: transformers' aliases), if given.
  std::optional<std::string> reasoning;
  std::vector<ToolCall> tool_calls = {};  // assistant turns only
  // The message's other keys (OpenAI form: tool_call_id, name...) as a JSON object text, passed
  // to Jinja templates as given; "" when none.
  std::string extra = {};
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

// kTemplate: the model's Jinja template, through the interpreter; the others: the built-in
// renderers of the official templates (chosen when the model's template is byte-identical to
// one of them, or forced with --chat-format).
enum class ChatFormat { kQwen3, kLlama3, kLlama31, kTemplate };
std::string_view chat_format_name(ChatFormat f);
std::optional<ChatFormat> chat_format_from_name(std::string_view name);
// "qwen3, llama3, llama3.1 or template", for messages.
std::string_view chat_format_names();

// How the user chose the template: --chat-template FILE (a .jinja file, or a JSON file with a
// "chat_template" string such as chat_template.json or tokenizer_config.json) and
// --chat-template-arg KEY=VALUE (VALUE parsed as JSON, else taken as a string).
struct ChatTemplateChoice {
  std::optional<std::filesystem::path> file;
  std::vector<std::string> args;
};

// What a model directory says about rendering chat: its template (tokenizer_config.json's
// chat_template, else chat_template.jinja, else chat_template.json) and special tokens; then how
// to render (prepare's options).
struct ChatConfig {
  ChatFormat format;
  std::string bos_token;
  // Qwen3's `enable_thinking`. The template only reads it for the generation prompt, where false
  // appends the empty "<think>\n\n</think>\n\n" the model then answers after. Training data
  // rendered for thinking off is what such a prompt plus the response renders to: reasoning is
  // dropped from every assistant turn, and the final turn's empty think block is prompt, not
  // learned. kTemplate: passed to the template as enable_thinking=false when off.
  bool enable_thinking = true;
  // Qwen3: assistant turns before the last user query keep their reasoning as a think block
  // (the template drops it): more reasoning to learn from, in a context the template never
  // renders. Needs enable_thinking.
  bool keep_history_reasoning = false;
  // kTemplate: the parsed template and the variables it gets besides the conversation (the
  // special tokens of tokenizer_config.json, then --chat-template-arg values).
  std::shared_ptr<const chat::Template> chat_template = nullptr;
  chat::Dict template_args = {};
  // kTemplate: the template writes OpenAI's harmony format (gpt-oss: an assistant turn is
  // messages "<|channel|>C<|message|>BODY" each ended by <|end|>, <|return|> or <|call|>), so a
  // turn's span is narrowed to the message bodies the drafter learns (render_chat).
  bool harmony = false;
  // Harmony: also learn the analysis channel (the reasoning); by default only the final answer
  // and tool calls are learned.
  bool supervise_reasoning = false;

  // Throws if the options do not fit the format or each other.
  void validate() const;
};
// `forced` (--chat-format qwen3|llama3|llama3.1) picks a built-in renderer; otherwise the
// template (the model's, or choice.file) is used, through the built-in renderer when it is
// byte-identical to an official template that has one and no args are given.
ChatConfig detect_chat_config(const std::filesystem::path& model_dir,
                              std::optional<ChatFormat> forced = std::nullopt,
                              const ChatTemplateChoice& choice = {});

// The text the template renders (add_generation_prompt=False), with the byte spans of what the
// model must learn. Built-in renderers: each assistant body (with its tool calls) through its
// end-of-turn token (<|im_end|> or <|eot_id|>), excluding the role header; tool results are not
// learned. kTemplate: the template's {% generation %} blocks when it has them, else for each
// assistant turn i what the render of messages[:i+1] adds to the render of messages[:i] with the
// generation prompt, for the turns where both are prefixes of the full render (a template that
// rewrites history leaves earlier turns unsupervised; none at all is a ParseError; see
// docs/CHAT_TEMPLATES.md). Harmony templates (config.harmony): within each such turn only the
// bodies of its final and commentary (tool call) messages with their end tokens, and of its
// analysis messages with supervise_reasoning. Template errors (raise_exception included) are
// ParseErrors.
// For Qwen3 the body of the assistant turn after the last user query includes the template's
// empty "<think>\n\n</think>\n\n" block (with thinking on). Throws ParseError for what the
// template cannot render (tool turns in the Llama-3 template, several calls in one Llama-3.1
// turn).
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> assistant_spans;
  // Assistant turns that stay in the text as context only: the template renders them otherwise
  // once later turns follow, so prefix renders cannot locate them.
  size_t unlocated_turns = 0;
};
RenderedChat render_chat(const Conversation& conv, const ChatConfig& config);

// The text alone (no spans), add_generation_prompt=False: what render_chat(...).text is, also
// for templates whose turns cannot be located by rendering prefixes.
std::string render_chat_text(const Conversation& conv, const ChatConfig& config);

// The prompt from which a model writes its next assistant turn: `history` (ending with a user
// turn) rendered as the template renders it with add_generation_prompt=True. For
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
