#include "data/chat.h"

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "tokenizer/unicode.h"

namespace dflash::data {
namespace {

using json = nlohmann::json;

[[noreturn]] void bad(std::string message) { throw ParseError(std::move(message)); }

const json& field(const json& obj, const char* key, size_t index) {
  auto it = obj.find(key);
  if (it == obj.end()) bad(fmt::format("message {} has no \"{}\"", index, key));
  return *it;
}

Role role_of(std::string_view name, bool sharegpt, size_t index) {
  if (name == "system") return Role::kSystem;
  if (name == "user" || (sharegpt && name == "human")) return Role::kUser;
  if (name == "assistant" || (sharegpt && name == "gpt")) return Role::kAssistant;
  bad(fmt::format("message {} has unknown role {:?}", index, name));
}

std::string_view role_name(Role r) {
  switch (r) {
    case Role::kSystem:
      return "system";
    case Role::kUser:
      return "user";
    case Role::kAssistant:
      return "assistant";
  }
  return "";
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}
std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

// Jinja's `trim` filter: Python's str.strip(), which strips Unicode whitespace.
std::string_view python_strip(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e) {
    size_t i = b;
    if (!tok::is_python_space(tok::next_code_point(s, i))) break;
    b = i;
  }
  while (e > b) {
    size_t start = e - 1;
    while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    size_t i = start;
    if (!tok::is_python_space(tok::next_code_point(s, i))) break;
    e = start;
  }
  return s.substr(b, e - b);
}

bool only_python_space(std::string_view s) { return python_strip(s).empty(); }

}  // namespace

Conversation parse_conversation(std::string_view line) {
  if (size_t at = tok::find_invalid_utf8(line); at != std::string_view::npos) {
    bad(fmt::format("invalid UTF-8 at byte {}", at));
  }
  json j;
  try {
    j = json::parse(line);
  } catch (const json::parse_error& e) {
    bad(fmt::format("malformed JSON: {}", e.what()));
  }
  if (!j.is_object()) bad("a line must be a JSON object");
  bool has_messages = j.contains("messages"), has_conversations = j.contains("conversations");
  if (has_messages == has_conversations) {
    bad(has_messages ? "has both \"messages\" and \"conversations\""
                     : "has neither \"messages\" (OpenAI form) nor \"conversations\" (ShareGPT)");
  }
  bool sharegpt = has_conversations;
  const json& list = sharegpt ? j["conversations"] : j["messages"];
  if (!list.is_array())
    bad(fmt::format("\"{}\" is not an array", sharegpt ? "conversations" : "messages"));
  if (list.empty()) bad("no messages");
  Conversation conv;
  conv.messages.reserve(list.size());
  bool any_assistant = false;
  for (size_t i = 0; i < list.size(); ++i) {
    const json& m = list[i];
    if (!m.is_object()) bad(fmt::format("message {} is not an object", i));
    const json& role = field(m, sharegpt ? "from" : "role", i);
    const json& content = field(m, sharegpt ? "value" : "content", i);
    if (!role.is_string()) bad(fmt::format("message {} role is not a string", i));
    if (!content.is_string()) bad(fmt::format("message {} content is not a string", i));
    Message msg{role_of(role.get_ref<const std::string&>(), sharegpt, i),
                content.get<std::string>(), std::nullopt};
    if (auto r = m.find("reasoning_content"); r != m.end() && !r->is_null()) {
      if (!r->is_string()) bad(fmt::format("message {} reasoning_content is not a string", i));
      msg.reasoning = r->get<std::string>();
    }
    if (msg.role == Role::kAssistant) {
      if (only_python_space(msg.content)) bad(fmt::format("message {}: empty assistant turn", i));
      any_assistant = true;
    }
    conv.messages.push_back(std::move(msg));
  }
  if (!any_assistant) bad("no assistant turn");
  return conv;
}

std::string_view chat_format_name(ChatFormat f) {
  return f == ChatFormat::kQwen3 ? "qwen3" : "llama3";
}

std::optional<ChatFormat> chat_format_from_name(std::string_view name) {
  if (name == "qwen3") return ChatFormat::kQwen3;
  if (name == "llama3") return ChatFormat::kLlama3;
  return std::nullopt;
}

ChatConfig detect_chat_config(const std::filesystem::path& model_dir,
                              std::optional<ChatFormat> forced) {
  auto path = model_dir / "tokenizer_config.json";
  json cfg = json::object();
  if (std::filesystem::exists(path)) {
    try {
      cfg = json::parse(read_file(path));
    } catch (const json::exception& e) {
      fail("{}: not valid JSON: {}", path.string(), e.what());
    }
  } else if (!forced) {
    fail("{}: missing; pass --chat-format to choose the chat format", path.string());
  }
  std::string bos;
  if (auto it = cfg.find("bos_token"); it != cfg.end()) {
    if (it->is_string()) bos = it->get<std::string>();
    if (it->is_object() && it->contains("content")) bos = (*it)["content"].get<std::string>();
  }
  if (forced) return {*forced, bos};
  std::string tmpl;
  if (auto it = cfg.find("chat_template"); it != cfg.end()) {
    if (it->is_string()) tmpl = it->get<std::string>();
    if (it->is_array()) {
      for (const json& t : *it) {
        if (t.value("name", "") == "default") tmpl = t.value("template", "");
      }
    }
  }
  if (tmpl.empty()) {
    auto jinja = model_dir / "chat_template.jinja";  // newer checkpoints keep it separately
    if (std::filesystem::exists(jinja)) tmpl = read_file(jinja);
  }
  auto has = [&](std::string_view s) { return tmpl.find(s) != std::string::npos; };
  if (has("<|im_start|>") && has("last_query_index") && has("reasoning_content")) {
    return {ChatFormat::kQwen3, bos};
  }
  if (has("<|start_header_id|>") && has("<|eot_id|>") && !has("Cutting Knowledge Date")) {
    if (bos.empty()) fail("{}: a Llama-3 template needs bos_token", path.string());
    return {ChatFormat::kLlama3, bos};
  }
  fail(
      "{}: chat_template not recognized as Qwen3 or Llama-3 (Llama-3.1's dated system block "
      "and Qwen2.5's default system prompt are not supported); pass --chat-format qwen3|llama3 "
      "to choose one",
      path.string());
}

RenderedChat render_chat(const Conversation& conv, const ChatConfig& config) {
  RenderedChat r;
  const auto& msgs = conv.messages;
  std::string& out = r.text;
  if (config.format == ChatFormat::kLlama3) {
    // {% set content = '<|start_header_id|>' + role + '<|end_header_id|>\n\n' +
    //    message['content'] | trim + '<|eot_id|>' %}, BOS before the first message.
    for (size_t i = 0; i < msgs.size(); ++i) {
      if (i == 0) out += config.bos_token;
      out += "<|start_header_id|>";
      out += role_name(msgs[i].role);
      out += "<|end_header_id|>\n\n";
      size_t start = out.size();
      out += python_strip(msgs[i].content);
      out += "<|eot_id|>";
      if (msgs[i].role == Role::kAssistant) r.assistant_spans.emplace_back(start, out.size());
    }
    return r;
  }
  // Qwen3, following the official template line by line (tools are not part of the input).
  if (msgs[0].role == Role::kSystem) {
    out += "<|im_start|>system\n" + msgs[0].content + "<|im_end|>\n";
  }
  size_t last_query = msgs.size() - 1;
  for (size_t k = msgs.size(); k-- > 0;) {
    const auto& c = msgs[k].content;
    if (msgs[k].role == Role::kUser &&
        !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < msgs.size(); ++i) {
    const Message& m = msgs[i];
    if (m.role == Role::kUser || (m.role == Role::kSystem && i != 0)) {
      out += "<|im_start|>";
      out += role_name(m.role);
      out += "\n" + m.content + "<|im_end|>\n";
      continue;
    }
    if (m.role != Role::kAssistant) continue;
    std::string_view content = m.content, reasoning;
    if (m.reasoning) {
      reasoning = *m.reasoning;
    } else if (size_t end = content.find("</think>"); end != std::string_view::npos) {
      // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
      std::string_view before = rstrip_nl(content.substr(0, end));
      size_t open = before.rfind("<think>");
      reasoning = lstrip_nl(open == std::string_view::npos ? before : before.substr(open + 7));
      // content.split('</think>')[-1].lstrip('\n')
      content = lstrip_nl(content.substr(content.rfind("</think>") + 8));
    }
    out += "<|im_start|>assistant\n";
    size_t start = out.size();
    bool last = i + 1 == msgs.size();
    if (i > last_query && (last || !reasoning.empty())) {
      out += "<think>\n";
      out += lstrip_nl(rstrip_nl(reasoning));
      out += "\n</think>\n\n";
      out += lstrip_nl(content);
    } else {
      out += content;
    }
    out += "<|im_end|>";
    r.assistant_spans.emplace_back(start, out.size());
    out += "\n";
  }
  return r;
}

std::string render_generation_prompt(const Conversation& history, const ChatConfig& config,
                                     bool enable_thinking) {
  if (history.messages.empty()) fail("chat: a generation prompt needs at least one message");
  std::string text = render_chat(history, config).text;
  if (config.format != ChatFormat::kQwen3) {
    return text + "<|start_header_id|>assistant<|end_header_id|>\n\n";
  }
  text += "<|im_start|>assistant\n";
  if (!enable_thinking) text += "<think>\n\n</think>\n\n";
  return text;
}

void tokenize_chat(const tok::Tokenizer& tokenizer, const RenderedChat& chat, TokenizedChat& out) {
  thread_local std::vector<uint32_t> offsets;
  tokenizer.encode(chat.text, false, out.ids, &offsets);
  out.mask.assign(out.ids.size(), 0);
  size_t s = 0;
  const auto& spans = chat.assistant_spans;
  for (size_t k = 0; k < out.ids.size(); ++k) {
    size_t begin = offsets[k];
    size_t end = k + 1 < out.ids.size() ? offsets[k + 1] : chat.text.size();
    if (end == begin) end = begin + 1;  // a zero-width token still sits at its offset
    while (s < spans.size() && spans[s].second <= begin) ++s;
    if (s < spans.size() && spans[s].first < end) out.mask[k] = 1;
  }
}

}  // namespace dflash::data
