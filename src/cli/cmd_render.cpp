// `dflash render MODEL_DIR --data FILE`: each conversation as the target will see it (the
// model's chat template, or --chat-template), with the supervised spans marked, so users can
// check their data before a long run. Also home of the --chat-template options every command
// that renders chat shares.
#include <fmt/format.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "common/error.h"
#include "data/chat.h"
#include "tokenizer/tokenizer.h"

namespace dflash::cli {

void add_chat_template_options(CLI::App& cmd, data::ChatTemplateChoice& choice) {
  cmd.add_option_function<std::string>(
      "--chat-template", [&choice](const std::string& f) { choice.file = f; },
      "Jinja chat template to render with instead of the model's own (a .jinja file, or a JSON "
      "file with a \"chat_template\" string)");
  cmd.add_option("--chat-template-arg", choice.args,
                 "KEY=VALUE passed to the chat template (VALUE as JSON, else a string), e.g. "
                 "enable_thinking=false or reasoning_effort=high; repeatable")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

namespace {

struct RenderCliOptions {
  std::string model;
  std::string data;
  std::optional<std::string> chat_format;
  data::ChatTemplateChoice chat_template;
  bool enable_thinking = true;
  bool supervise_reasoning = false;
  int64_t limit = 0;
  bool json = false;
  bool ids = false;
};

// The text with supervised spans wrapped: colour on a terminal, [[...]] otherwise.
std::string marked(const data::RenderedChat& r, bool colour) {
  const char* open = colour ? "\x1b[1;32m" : "[[";
  const char* close = colour ? "\x1b[0m" : "]]";
  std::string out;
  size_t at = 0;
  for (const auto& [b, e] : r.assistant_spans) {
    out.append(r.text, at, b - at);
    out += open;
    out.append(r.text, b, e - b);
    out += close;
    at = e;
  }
  out.append(r.text, at);
  return out;
}

void run_render(const RenderCliOptions& o) {
  std::optional<data::ChatFormat> forced;
  if (o.chat_format) {
    forced = data::chat_format_from_name(*o.chat_format);
    if (!forced) fail("render: --chat-format must be {}", data::chat_format_names());
  }
  data::ChatConfig config = data::detect_chat_config(o.model, forced, o.chat_template);
  config.enable_thinking = o.enable_thinking;
  config.supervise_reasoning = o.supervise_reasoning;
  config.validate();
  std::optional<tok::Tokenizer> tokenizer;
  if (o.ids) tokenizer = tok::Tokenizer::load(o.model);
  std::ifstream in(o.data);
  if (!in) fail("render: cannot read --data {}", o.data);
  const bool colour = !o.json && ::isatty(STDOUT_FILENO) != 0;
  if (!o.json) {
    fmt::print("# {} via {}; supervised spans {}\n", o.data,
               config.chat_template
                   ? config.chat_template->name()
                   : std::string(data::chat_format_name(config.format)) + " (built-in)",
               colour ? "in green" : "in [[...]]");
  }
  std::string line;
  int64_t number = 0, shown = 0, failed = 0;
  while (std::getline(in, line) && (o.limit <= 0 || shown < o.limit)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    ++shown;
    nlohmann::ordered_json j;
    j["line"] = number;
    try {
      const data::RenderedChat r = data::render_chat(data::parse_conversation(line), config);
      j["text"] = r.text;
      j["spans"] = r.assistant_spans;
      if (r.unlocated_turns > 0) j["unsupervised_assistant_turns"] = r.unlocated_turns;
      data::TokenizedChat t;
      if (tokenizer) {
        data::tokenize_chat(*tokenizer, r, t);
        j["ids"] = t.ids;
        j["mask"] = t.mask;
      }
      if (!o.json) {
        size_t supervised = 0;
        for (uint8_t m : t.mask) supervised += m;
        fmt::print(
            "\n## line {}{}\n{}\n", number,
            tokenizer ? fmt::format(" ({} tokens, {} supervised)", t.ids.size(), supervised) : "",
            marked(r, colour));
      }
    } catch (const dflash::Error& e) {
      ++failed;
      j["error"] = e.what();
      if (!o.json) fmt::print(stderr, "{}:{}: {}\n", o.data, number, e.what());
    }
    if (o.json)
      fmt::print("{}\n", j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace));
  }
  if (failed > 0) {
    fail("render: {} of {} conversation(s) in {} could not be rendered", failed, shown, o.data);
  }
}

}  // namespace

void add_render_command(CLI::App& app) {
  auto o = std::make_shared<RenderCliOptions>();
  auto* cmd = app.add_subcommand(
      "render",
      "Print chat JSONL conversations as the target sees them (the model's chat template), with "
      "the spans the drafter learns marked");
  cmd->add_option("model,--tokenizer", o->model,
                  "model directory (tokenizer_config.json with the chat template, tokenizer.json "
                  "for --ids)")
      ->required();
  cmd->add_option("--data,--messages", o->data,
                  "chat JSONL: {\"messages\": [...]} (OpenAI), {\"conversations\": [...]} "
                  "(ShareGPT) or {\"question\", \"answer\"}")
      ->required();
  add_chat_template_options(*cmd, o->chat_template);
  cmd->add_option("--chat-format", o->chat_format,
                  "qwen3, llama3 or llama3.1 (built-in renderers), or template (default: the "
                  "model's template)");
  cmd->add_option("--enable-thinking", o->enable_thinking,
                  "false renders as served with enable_thinking=False")
      ->capture_default_str();
  cmd->add_flag("--supervise-reasoning", o->supervise_reasoning,
                "harmony templates (gpt-oss): also learn the analysis channel");
  cmd->add_option("--limit", o->limit, "render at most N conversations (0: all)")
      ->capture_default_str();
  cmd->add_flag("--json", o->json,
                "one JSON object per conversation: line, text, spans ([begin, end) bytes of the "
                "supervised text), and ids/mask with --ids, or error");
  cmd->add_flag("--ids", o->ids, "also tokenize: token ids and the loss mask");
  cmd->callback([o] { run_render(*o); });
}

}  // namespace dflash::cli
