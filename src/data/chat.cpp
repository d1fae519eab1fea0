#include "data/chat.h"

#include <nlohmann/json.hpp>

#include "chat/value.h"
#include "common/file.h"
#include "tokenizer/unicode.h"

namespace dflash::data {
namespace {

// Ordered: tool definitions and call arguments are re-serialized in the order the line gives
// their keys, as Python's json module keeps it.
using json = nlohmann::ordered_json;

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
  if (name == "tool") return Role::kTool;
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
    case Role::kTool:
      return "tool";
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

// Python's json.dumps(ensure_ascii=False) as the chat templates' `tojson` filter calls it:
// separators ", " and ": " (compact) or "," and ": " with newlines (indent > 0), strings with
// only quote, backslash and control characters escaped, floats as Python's repr.
void python_json(std::string& out, const json& v, int indent, int depth = 0) {
  auto newline = [&](int level) {
    out += '\n';
    out.append(static_cast<size_t>(indent * level), ' ');
  };
  const char* item_separator = indent > 0 ? "," : ", ";
  switch (v.type()) {
    case json::value_t::object:
    case json::value_t::array: {
      const bool object = v.is_object();
      if (v.empty()) {
        out += object ? "{}" : "[]";
        return;
      }
      out += object ? '{' : '[';
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) out += item_separator;
        first = false;
        if (indent > 0) newline(depth + 1);
        if (object) {
          chat::json_string(out, it.key());
          out += ": ";
        }
        python_json(out, *it, indent, depth + 1);
      }
      if (indent > 0) newline(depth);
      out += object ? '}' : ']';
      return;
    }
    case json::value_t::string:
      chat::json_string(out, v.get_ref<const std::string&>());
      return;
    case json::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      return;
    case json::value_t::number_integer:
      out += std::to_string(v.get<int64_t>());
      return;
    case json::value_t::number_unsigned:
      out += std::to_string(v.get<uint64_t>());
      return;
    case json::value_t::number_float:
      out += chat::python_float_repr(v.get<double>());
      return;
    default:
      out += "null";
  }
}

std::string python_json(const json& v, int indent = 0) {
  std::string out;
  python_json(out, v, indent);
  return out;
}

// OpenAI's content parts, [{"type": "text", "text": ...}...], joined; other part types (images,
// audio) have no text to train a text drafter on.
std::string text_parts(const json& parts, size_t index) {
  std::string out;
  for (size_t k = 0; k < parts.size(); ++k) {
    const json& part = parts[k];
    auto type = part.is_object() ? part.find("type") : part.end();
    if (!part.is_object() || type == part.end() || !type->is_string()) {
      bad(fmt::format("message {} content part {} is not an object with a \"type\"", index, k));
    }
    auto text = part.find("text");
    if (*type != "text" || text == part.end() || !text->is_string()) {
      bad(
          fmt::format("message {} content part {} is of type {}: only text parts (a \"text\" "
                      "string) are supported",
                      index, k, type->dump()));
    }
    out += text->get_ref<const std::string&>();
  }
  return out;
}

std::vector<ToolCall> parse_tool_calls(const json& calls, size_t index) {
  std::vector<ToolCall> out;
  if (calls.is_null()) return out;
  if (!calls.is_array()) bad(fmt::format("message {} tool_calls is not a list", index));
  for (size_t k = 0; k < calls.size(); ++k) {
    auto f = calls[k].is_object() ? calls[k].find("function") : calls[k].end();
    if (!calls[k].is_object() || f == calls[k].end() || !f->is_object()) {
      bad(fmt::format("message {} tool call {} has no \"function\" object", index, k));
    }
    auto name = f->find("name");
    if (name == f->end() || !name->is_string()) {
      bad(fmt::format("message {} tool call {} has no function name", index, k));
    }
    auto args = f->find("arguments");
    if (args == f->end()) bad(fmt::format("message {} tool call {} has no arguments", index, k));
    json parsed;
    if (args->is_string()) {
      try {
        parsed = json::parse(args->get_ref<const std::string&>());
      } catch (const json::exception&) {  // parse_error, or out_of_range for 1e999
        bad(fmt::format("message {} tool call {} arguments are not valid JSON", index, k));
      }
    }
    // Function arguments are an object (OpenAI); anything else renders differently per template.
    if (!(args->is_string() ? parsed : *args).is_object()) {
      bad(fmt::format("message {} tool call {} arguments are not a JSON object", index, k));
    }
    ToolCall call{name->get<std::string>(), python_json(args->is_string() ? parsed : *args)};
    if (auto id = calls[k].find("id"); id != calls[k].end() && id->is_string()) call.id = *id;
    out.push_back(std::move(call));
  }
  return out;
}

}  // namespace

Conversation parse_conversation(std::string_view line) {
  if (size_t at = tok::find_invalid_utf8(line); at != std::string_view::npos) {
    bad(fmt::format("invalid UTF-8 at byte {}", at));
  }
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e999
    bad(fmt::format("malformed JSON: {}", e.what()));
  }
  if (!j.is_object()) bad("a line must be a JSON object");
  bool has_messages = j.contains("messages"), has_conversations = j.contains("conversations");
  if (!has_messages && !has_conversations && j.contains("question") && j.contains("answer")) {
    const json &q = j["question"], &a = j["answer"];
    if (!q.is_string() || !a.is_string()) bad("\"question\" and \"answer\" must be strings");
    if (only_python_space(a.get_ref<const std::string&>())) bad("empty answer");
    return {{{Role::kUser, q.get<std::string>(), std::nullopt},
             {Role::kAssistant, a.get<std::string>(), std::nullopt}}};
  }
  if (has_messages == has_conversations) {
    bad(has_messages ? "has both \"messages\" and \"conversations\""
                     : "has neither \"messages\" (OpenAI form) nor \"conversations\" (ShareGPT) "
                       "nor \"question\" and \"answer\" (GSM8K form)");
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
    Message msg{role_of(role.get_ref<const std::string&>(), sharegpt, i), "", std::nullopt};
    if (auto calls = m.find("tool_calls"); calls != m.end()) {
      if (msg.role != Role::kAssistant && !calls->is_null()) {
        bad(fmt::format("message {} has tool_calls but is not an assistant turn", i));
      }
      msg.tool_calls = parse_tool_calls(*calls, i);
    }
    // OpenAI's assistant turns that only call tools have "content": null.
    if (content.is_array() && !sharegpt) {
      msg.content = text_parts(content, i);
    } else if (!content.is_string() && !(content.is_null() && !msg.tool_calls.empty())) {
      bad(fmt::format("message {} content is not a string{}", i,
                      sharegpt ? "" : " or a list of text parts"));
    }
    if (content.is_string()) msg.content = content.get<std::string>();
    // transformers reads the first of these that is set as reasoning_content.
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      auto r = m.find(key);
      if (r == m.end() || r->is_null()) continue;
      if (!r->is_string()) bad(fmt::format("message {} {} is not a string", i, key));
      msg.reasoning = r->get<std::string>();
      break;
    }
    if (!sharegpt) {
      json extra = json::object();
      for (const auto& [k, v] : m.items()) {
        if (k != "role" && k != "content" && k != "tool_calls" && k != "reasoning_content" &&
            k != "thinking" && k != "reasoning" && !v.is_null()) {
          extra[k] = v;
        }
      }
      // Templates get content parts as the list they are (most join the text parts, some
      // render nothing for a list); the built-in renderers render the joined text.
      if (content.is_array()) extra["content"] = content;
      if (!extra.empty()) msg.extra = extra.dump();
    }
    if (msg.role == Role::kAssistant) {
      if (msg.tool_calls.empty() && only_python_space(msg.content)) {
        bad(fmt::format("message {}: empty assistant turn", i));
      }
      any_assistant = true;
    }
    conv.messages.push_back(std::move(msg));
  }
  if (!any_assistant) bad("no assistant turn");
  if (auto tools = j.find("tools"); tools != j.end() && !tools->is_null()) {
    if (!tools->is_array()) bad("\"tools\" is not a list");
    conv.tools.emplace();
    conv.tools_indented.emplace();
    for (const json& t : *tools) {
      if (!t.is_object()) bad("\"tools\" holds something other than a JSON object");
      conv.tools->push_back(python_json(t));
      conv.tools_indented->push_back(python_json(t, 4));
    }
  }
  return conv;
}

std::string_view chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::kQwen3:
      return "qwen3";
    case ChatFormat::kLlama3:
      return "llama3";
    case ChatFormat::kLlama31:
      return "llama3.1";
    case ChatFormat::kTemplate:
      return "template";
  }
  return "";
}

std::optional<ChatFormat> chat_format_from_name(std::string_view name) {
  for (auto f :
       {ChatFormat::kQwen3, ChatFormat::kLlama3, ChatFormat::kLlama31, ChatFormat::kTemplate}) {
    if (name == chat_format_name(f)) return f;
  }
  return std::nullopt;
}

std::string_view chat_format_names() { return "qwen3, llama3, llama3.1 or template"; }

namespace {

// FNV-1a: identifies the official templates the built-in renderers reproduce.
uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// Templates the built-in renderers are proven byte-identical to (tests/text/chat_test.cpp,
// BuiltinRenderersEqualTheirTemplates): Qwen3 (Qwen/Qwen3-8B), Llama-3
// (Meta-Llama-3-8B-Instruct), Llama-3.1 (Llama-3.1-8B-Instruct).
std::optional<ChatFormat> builtin_for(std::string_view tmpl) {
  switch (fnv1a(tmpl)) {
    case 0x959a4551391a6549ull:
      return ChatFormat::kQwen3;
    case 0x0e60067a5537498eull:
      return ChatFormat::kLlama3;
    case 0x60848a05837ce656ull:
      return ChatFormat::kLlama31;
    default:
      return std::nullopt;
  }
}

// tokenizer_config.json's special tokens: a string or an AddedToken object {"content": ...}.
std::optional<std::string> special_token(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

// A "chat_template" value: a string, or a list of {"name", "template"} (the "default" one).
std::string template_from(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    for (const json& t : v) {
      if (t.is_object() && t.value("name", "") == "default") return t.value("template", "");
    }
  }
  return "";
}

json read_json(const std::filesystem::path& path) {
  try {
    return json::parse(read_file(path));
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", path.string(), e.what());
  }
}

}  // namespace

ChatConfig detect_chat_config(const std::filesystem::path& model_dir,
                              std::optional<ChatFormat> forced, const ChatTemplateChoice& choice) {
  auto path = model_dir / "tokenizer_config.json";
  json cfg = json::object();
  if (std::filesystem::exists(path)) {
    cfg = read_json(path);
  } else if (!forced && !choice.file) {
    fail("{}: missing; pass --chat-template FILE or --chat-format to choose the chat template",
         path.string());
  }
  const std::string bos = special_token(cfg, "bos_token").value_or("");
  if (forced && *forced != ChatFormat::kTemplate) {
    if (choice.file || !choice.args.empty()) {
      fail(
          "--chat-format {} is a built-in renderer; it takes no --chat-template or "
          "--chat-template-arg",
          chat_format_name(*forced));
    }
    if (*forced != ChatFormat::kQwen3 && bos.empty()) {
      fail("{}: a Llama-3 template needs bos_token", path.string());
    }
    return {*forced, bos};
  }
  std::string tmpl, origin;
  if (choice.file) {
    origin = choice.file->string();
    if (!std::filesystem::exists(*choice.file)) fail("--chat-template {}: no such file", origin);
    tmpl = read_file(*choice.file);
    if (choice.file->extension() == ".json")
      tmpl = template_from(read_json(*choice.file).value("chat_template", json()));
    if (tmpl.empty()) fail("--chat-template {}: no chat_template in it", origin);
  } else if (tmpl = template_from(cfg.value("chat_template", json())); !tmpl.empty()) {
    origin = path.string();
  } else if (auto jinja = model_dir / "chat_template.jinja"; std::filesystem::exists(jinja)) {
    origin = jinja.string();  // newer checkpoints keep it separately
    tmpl = read_file(jinja);
  } else if (auto js = model_dir / "chat_template.json"; std::filesystem::exists(js)) {
    origin = js.string();
    tmpl = template_from(read_json(js).value("chat_template", json()));
  }
  if (tmpl.empty()) {
    fail(
        "{}: no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja "
        "or chat_template.json); pass --chat-template FILE or --chat-format {}",
        model_dir.string(), chat_format_names());
  }
  if (!forced && !choice.file && choice.args.empty()) {
    if (auto builtin = builtin_for(tmpl);
        builtin && (*builtin == ChatFormat::kQwen3 || !bos.empty())) {
      return {*builtin, bos};
    }
  }
  ChatConfig c{ChatFormat::kTemplate, bos};
  try {
    c.chat_template = std::make_shared<const chat::Template>(tmpl, origin);
  } catch (const chat::TemplateError& e) {
    fail("{} (pass --chat-template FILE with a template this renderer supports, or --chat-format)",
         e.what());
  }
  // The final channel's header, which every harmony template writes and no other does.
  c.harmony = tmpl.find("<|channel|>final<|message|>") != std::string::npos;
  // apply_chat_template passes the tokenizer's special tokens map, then the kwargs.
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    if (auto t = special_token(cfg, key)) c.template_args.emplace_back(key, chat::Value(*t));
  }
  for (const std::string& arg : choice.args) {
    const size_t eq = arg.find('=');
    if (eq == std::string::npos || eq == 0) {
      fail("--chat-template-arg {}: expected KEY=VALUE (VALUE as JSON, e.g. enable_thinking=false)",
           arg);
    }
    const std::string key = arg.substr(0, eq), text = arg.substr(eq + 1);
    // JSON when it parses (false, 3, {"a": 1}, "quoted"), else the text as a string.
    json v = json::parse(text, nullptr, false);
    chat::Value value = v.is_discarded() ? chat::Value(text) : chat::Value::from_json(v);
    bool replaced = false;
    for (auto& kv : c.template_args) {
      if (kv.first == key) {
        kv.second = value;
        replaced = true;
      }
    }
    if (!replaced) c.template_args.emplace_back(key, std::move(value));
  }
  return c;
}

namespace {

bool has_tool_turns(const Conversation& conv) {
  for (const Message& m : conv.messages) {
    if (m.role == Role::kTool || !m.tool_calls.empty()) return true;
  }
  return conv.tools.has_value();
}

// {% set content = '<|start_header_id|>' + role + '<|end_header_id|>\n\n' +
//    message['content'] | trim + '<|eot_id|>' %}, BOS before the first message.
void render_llama3(const Conversation& conv, const ChatConfig& config, RenderedChat& r) {
  if (has_tool_turns(conv)) {
    bad("the llama3 chat template has no tool calls or tool results (it would render them as "
        "plain turns); use llama3.1 or qwen3");
  }
  std::string& out = r.text;
  const auto& msgs = conv.messages;
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
}

// The official Llama-3.1 template with its defaults (no builtin tools, tools_in_user_message,
// date_string "26 Jul 2024"), branch by branch.
void render_llama31(const Conversation& conv, const ChatConfig& config, RenderedChat& r) {
  std::string& out = r.text;
  const auto& msgs = conv.messages;
  size_t first = 0;
  std::string_view system;
  if (msgs[0].role == Role::kSystem) system = python_strip(msgs[first++].content);
  out += config.bos_token;
  out += "<|start_header_id|>system<|end_header_id|>\n\n";
  if (conv.tools) out += "Environment: ipython\n";
  out += "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  out += system;
  out += "<|eot_id|>";
  if (conv.tools) {
    // The template takes the first message after the system prompt as the user's, whatever its
    // role; only a user message renders as what it was.
    if (first == msgs.size() || msgs[first].role != Role::kUser) {
      bad("llama3.1: with tools, the first message after the system prompt must be the user's "
          "(the template puts the tools into it)");
    }
    out += "<|start_header_id|>user<|end_header_id|>\n\n";
    out +=
        "Given the following functions, please respond with a JSON for a function call with "
        "its proper arguments that best answers the given prompt.\n\n";
    out +=
        "Respond in the format {\"name\": function name, \"parameters\": dictionary of "
        "argument name and its value}.Do not use variables.\n\n";
    for (const std::string& t : *conv.tools_indented) out += t + "\n\n";
    out += python_strip(msgs[first++].content);
    out += "<|eot_id|>";
  }
  for (size_t i = first; i < msgs.size(); ++i) {
    const Message& m = msgs[i];
    if (m.role == Role::kTool) {
      // `message.content is iterable` holds for a string, so tool results are JSON-quoted.
      out += "<|start_header_id|>ipython<|end_header_id|>\n\n";
      chat::json_string(out, m.content);
      out += "<|eot_id|>";
      continue;
    }
    if (!m.tool_calls.empty()) {
      if (m.tool_calls.size() != 1) {
        bad(
            fmt::format("llama3.1: message {} has {} tool calls; the template takes one per turn "
                        "(\"This model only supports single tool-calls at once!\")",
                        i, m.tool_calls.size()));
      }
      // The turn's content, if any, is not rendered.
      out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      size_t start = out.size();
      out += "{\"name\": \"" + m.tool_calls[0].name + "\", \"parameters\": ";
      out += m.tool_calls[0].arguments + "}<|eot_id|>";
      r.assistant_spans.emplace_back(start, out.size());
      continue;
    }
    out += "<|start_header_id|>";
    out += role_name(m.role);
    out += "<|end_header_id|>\n\n";
    size_t start = out.size();
    out += python_strip(m.content);
    out += "<|eot_id|>";
    if (m.role == Role::kAssistant) r.assistant_spans.emplace_back(start, out.size());
  }
}

// The official Qwen3 template, line by line, plus ChatConfig's thinking options.
void render_qwen3(const Conversation& conv, const ChatConfig& config, RenderedChat& r) {
  std::string& out = r.text;
  const auto& msgs = conv.messages;
  if (conv.tools && !conv.tools->empty()) {
    out += "<|im_start|>system\n";
    if (msgs[0].role == Role::kSystem) out += msgs[0].content + "\n\n";
    out +=
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
        "provided with function signatures within <tools></tools> XML tags:\n<tools>";
    for (const std::string& t : *conv.tools) out += "\n" + t;
    out +=
        "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
  } else if (msgs[0].role == Role::kSystem) {
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
    const bool last = i + 1 == msgs.size();
    if (m.role == Role::kUser || (m.role == Role::kSystem && i != 0)) {
      out += "<|im_start|>";
      out += role_name(m.role);
      out += "\n" + m.content + "<|im_end|>\n";
      continue;
    }
    if (m.role == Role::kTool) {
      if (i == 0 || msgs[i - 1].role != Role::kTool) out += "<|im_start|>user";
      out += "\n<tool_response>\n" + m.content + "\n</tool_response>";
      if (last || msgs[i + 1].role != Role::kTool) out += "<|im_end|>\n";
      continue;
    }
    if (m.role != Role::kAssistant) continue;
    std::string_view content = m.content, reasoning;
    if (m.reasoning && config.enable_thinking) {
      reasoning = *m.reasoning;
    } else if (size_t end = content.find("</think>"); end != std::string_view::npos) {
      // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
      std::string_view before = rstrip_nl(content.substr(0, end));
      size_t open = before.rfind("<think>");
      reasoning = lstrip_nl(open == std::string_view::npos ? before : before.substr(open + 7));
      // content.split('</think>')[-1].lstrip('\n')
      content = lstrip_nl(content.substr(content.rfind("</think>") + 8));
    }
    if (!config.enable_thinking) reasoning = {};
    out += "<|im_start|>assistant\n";
    size_t start = out.size();
    const bool after_query = i > last_query || config.keep_history_reasoning;
    if (after_query && (last || !reasoning.empty())) {
      out += "<think>\n";
      out += lstrip_nl(rstrip_nl(reasoning));
      out += "\n</think>\n\n";
      // With thinking off the empty think block ends the generation prompt: not learned.
      if (!config.enable_thinking) start = out.size();
      out += lstrip_nl(content);
    } else {
      out += content;
    }
    for (size_t k = 0; k < m.tool_calls.size(); ++k) {
      if (k > 0 || !content.empty()) out += "\n";
      out += "<tool_call>\n{\"name\": \"" + m.tool_calls[k].name + "\", \"arguments\": ";
      out += m.tool_calls[k].arguments + "}\n</tool_call>";
    }
    out += "<|im_end|>";
    r.assistant_spans.emplace_back(start, out.size());
    out += "\n";
  }
}

// The messages and tools as the template sees them (OpenAI form): tool-call arguments as
// objects (strings were parsed, as vLLM does), the message's other keys as given.
json template_messages(const Conversation& conv) {
  json msgs = json::array();
  for (const Message& m : conv.messages) {
    json j = json::object();
    j["role"] = role_name(m.role);
    j["content"] = m.content;
    if (m.reasoning) j["reasoning_content"] = *m.reasoning;
    if (!m.tool_calls.empty()) {
      json calls = json::array();
      for (const ToolCall& c : m.tool_calls) {
        json call = json::object();
        if (!c.id.empty()) call["id"] = c.id;
        call["type"] = "function";
        json fn = json::object();
        fn["name"] = c.name;
        fn["arguments"] = json::parse(c.arguments);
        call["function"] = std::move(fn);
        calls.push_back(std::move(call));
      }
      j["tool_calls"] = std::move(calls);
    }
    if (!m.extra.empty()) {
      const json extra = json::parse(m.extra);
      for (const auto& [k, v] : extra.items()) j[k] = v;
    }
    msgs.push_back(std::move(j));
  }
  return msgs;
}

json template_tools(const Conversation& conv) {
  if (!conv.tools) return nullptr;
  json tools = json::array();
  for (const std::string& t : *conv.tools) tools.push_back(json::parse(t));
  return tools;
}

chat::Rendered render_template(const json& messages, const json& tools, bool add_generation_prompt,
                               const ChatConfig& config) {
  chat::Dict kwargs = config.template_args;
  if (!config.enable_thinking) kwargs.emplace_back("enable_thinking", chat::Value(false));
  try {
    return config.chat_template->render(
        chat::hf_template_variables(messages, tools, add_generation_prompt, kwargs));
  } catch (const chat::TemplateError& e) {
    throw ParseError(e.raised_by_template()
                         ? fmt::format("the chat template refused it: {}", e.what())
                         : fmt::format("chat template error: {}", e.what()));
  }
}

// Assistant spans from prefix renders: turn i is what render(messages[:i+1]) adds to
// render(messages[:i], add_generation_prompt=True), where both are prefixes of the full render.
// Templates that render history differently once later turns follow (Qwen3.5 drops the think
// block of turns before the last user message) break that for the earlier turns: those stay in
// the text as context, unsupervised. No supervisable turn at all is an error.
void prefix_spans(const json& msgs, const json& tools, const ChatConfig& config, RenderedChat& r) {
  size_t assistants = 0;
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (msgs[i]["role"] != "assistant") continue;
    ++assistants;
    json head = json::array();
    for (size_t k = 0; k < i; ++k) head.push_back(msgs[k]);
    json upto = head;
    upto.push_back(msgs[i]);
    const std::string prompt =
        i == 0 ? std::string() : render_template(head, tools, true, config).text;
    const std::string turn = render_template(upto, tools, false, config).text;
    if (turn.size() > prompt.size() && turn.compare(0, prompt.size(), prompt) == 0 &&
        r.text.compare(0, turn.size(), turn) == 0) {
      r.assistant_spans.emplace_back(prompt.size(), turn.size());
    } else {
      ++r.unlocated_turns;
    }
  }
  if (assistants > 0 && r.assistant_spans.empty()) {
    throw ParseError(fmt::format(
        "chat template {}: no assistant turn can be located by rendering prefixes (the template "
        "renders a turn differently once later messages follow); add {{% generation %}} tags "
        "around assistant output in a copy of the template and pass it with --chat-template "
        "(see docs/CHAT_TEMPLATES.md)",
        config.chat_template->name()));
  }
}

// Harmony turns (gpt-oss). A located turn starts after the generation prompt
// "<|start|>assistant" and holds one or more assistant messages "[ to=RECIPIENT]<|channel|>
// CHANNEL[ TYPE]<|message|>BODY", each ended by <|end|>, <|return|> or <|call|>, later ones after
// a new "<|start|>assistant". Kept: the bodies with their end token of messages on every channel
// but analysis (final: the answer, commentary: tool calls), and of analysis messages (the
// reasoning) with supervise_reasoning; message headers stay prompt, as other templates' role
// headers do. A body holding one of the end tokens as text cannot be told from its end (the
// tokenizer makes it that token): such a turn is refused rather than split wrongly.
void narrow_harmony_spans(const ChatConfig& config, RenderedChat& r) {
  constexpr std::string_view kMessage = "<|message|>", kChannel = "<|channel|>";
  constexpr std::string_view kStart = "<|start|>", kAssistant = "<|start|>assistant";
  std::vector<std::pair<size_t, size_t>> kept;
  for (const auto& [begin, end] : r.assistant_spans) {
    const std::string_view turn = std::string_view(r.text).substr(begin, end - begin);
    for (size_t at = 0; at < turn.size();) {
      const size_t header_end = turn.find(kMessage, at);
      const std::string_view header = turn.substr(at, header_end - at);
      const size_t channel_at = header.find(kChannel);
      size_t stop = std::string_view::npos, stop_len = 0;
      const bool assistant_header =
          at == 0 ? header.find(kStart) == std::string_view::npos : starts_with(header, kAssistant);
      if (header_end != std::string_view::npos && channel_at != std::string_view::npos &&
          assistant_header) {
        for (std::string_view e : {"<|end|>", "<|return|>", "<|call|>"}) {
          if (const size_t p = turn.find(e, header_end); p < stop) {
            stop = p;
            stop_len = e.size();
          }
        }
      }
      if (stop == std::string_view::npos) {
        bad(fmt::format(
            "harmony chat template {}: the assistant turn at byte {} is not a run of assistant "
            "messages <|channel|>...<|message|>... ended by <|end|>, <|return|> or <|call|> "
            "(does its text hold one of these special tokens?)",
            config.chat_template->name(), begin));
      }
      std::string_view channel = header.substr(channel_at + kChannel.size());
      channel = channel.substr(0, channel.find(' '));
      if (channel != "analysis" || config.supervise_reasoning) {
        kept.emplace_back(begin + header_end + kMessage.size(), begin + stop + stop_len);
      }
      at = stop + stop_len;
    }
  }
  r.assistant_spans = std::move(kept);
}

}  // namespace

void ChatConfig::validate() const {
  if (supervise_reasoning && !(format == ChatFormat::kTemplate && chat_template && harmony &&
                               !chat_template->has_generation())) {
    fail(
        "chat: supervising reasoning is an option of harmony chat templates (gpt-oss), which "
        "learn only the final answer by default; {} already learns the reasoning it renders as "
        "part of the assistant turn",
        chat_template ? "the template " + chat_template->name()
                      : std::string("the built-in ") + std::string(chat_format_name(format)));
  }
  if (format == ChatFormat::kTemplate) {
    if (!chat_template) fail("chat: the template format needs a chat template");
    if (keep_history_reasoning) {
      fail(
          "chat: keeping history reasoning is an option of the built-in qwen3 renderer, not of "
          "a Jinja template (edit a copy of the template and pass it with --chat-template)");
    }
    return;
  }
  if (format != ChatFormat::kQwen3 && (!enable_thinking || keep_history_reasoning)) {
    fail(
        "chat: thinking off and keeping history reasoning are options of the qwen3 chat format, "
        "not of {}",
        chat_format_name(format));
  }
  if (!enable_thinking && keep_history_reasoning) {
    fail("chat: keeping history reasoning contradicts thinking off (which drops all reasoning)");
  }
}

RenderedChat render_chat(const Conversation& conv, const ChatConfig& config) {
  RenderedChat r;
  switch (config.format) {
    case ChatFormat::kTemplate: {
      const json msgs = template_messages(conv), tools = template_tools(conv);
      chat::Rendered out = render_template(msgs, tools, false, config);
      r.text = std::move(out.text);
      if (config.chat_template->has_generation()) {
        r.assistant_spans = std::move(out.generation_spans);
      } else {
        prefix_spans(msgs, tools, config, r);
        if (config.harmony) narrow_harmony_spans(config, r);
      }
      break;
    }
    case ChatFormat::kLlama3:
      render_llama3(conv, config, r);
      break;
    case ChatFormat::kLlama31:
      render_llama31(conv, config, r);
      break;
    case ChatFormat::kQwen3:
      render_qwen3(conv, config, r);
      break;
  }
  return r;
}

std::string render_chat_text(const Conversation& conv, const ChatConfig& config) {
  if (config.format != ChatFormat::kTemplate) return render_chat(conv, config).text;
  return render_template(template_messages(conv), template_tools(conv), false, config).text;
}

std::string render_generation_prompt(const Conversation& history, const ChatConfig& config,
                                     bool enable_thinking) {
  if (history.messages.empty()) fail("chat: a generation prompt needs at least one message");
  if (config.format == ChatFormat::kTemplate) {
    ChatConfig c = config;
    c.enable_thinking = enable_thinking && config.enable_thinking;
    return render_template(template_messages(history), template_tools(history), true, c).text;
  }
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
