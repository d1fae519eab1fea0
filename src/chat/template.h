// chat: Hugging Face chat templates (Jinja2) rendered in C++, byte-identical to transformers'
// apply_chat_template. The interpreter covers what chat templates use, configured as
// transformers configures jinja2: ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True, loopcontrols, the {% generation %} tag), with its globals
// `raise_exception`, `strftime_now`, `namespace`, `dict` and its `tojson` (json.dumps,
// ensure_ascii=False). Values follow Python's semantics (see value.h). What is not supported
// (template inheritance, include/import, autoescape, the `do` and i18n extensions, str.format)
// fails at parse or render time with the template name, line and column.
#pragma once
#include <ctime>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/value.h"
#include "common/error.h"

namespace dflash::chat {

namespace ast {
struct Node;
}

// A syntax error, a failed evaluation or the template's own raise_exception(), as
// "NAME:LINE:COL: what".
class TemplateError : public dflash::Error {
 public:
  TemplateError(const std::string& what, bool raised_by_template)
      : dflash::Error(what), raised_by_template_(raised_by_template) {}
  // True for raise_exception(msg) (the template refuses the input, e.g. an unsupported role).
  bool raised_by_template() const { return raised_by_template_; }

 private:
  bool raised_by_template_;
};

struct RenderOptions {
  // What strftime_now() formats (local time, as datetime.now()); nullopt: the current time.
  std::optional<std::time_t> now;
  // Bounds against runaway templates (deep macro recursion, output explosion).
  size_t max_depth = 256;
  size_t max_output = size_t{1} << 30;
};

struct Rendered {
  std::string text;
  // Byte ranges [begin, end) of the output produced inside {% generation %} blocks.
  std::vector<std::pair<size_t, size_t>> generation_spans;
};

class Template {
 public:
  // Parses `source`; `name` (a file name) prefixes every error. Throws TemplateError.
  Template(std::string_view source, std::string name);
  ~Template();
  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;

  const std::string& name() const { return name_; }
  bool has_generation() const { return has_generation_; }

  // Renders with the template's variables (messages, tools, add_generation_prompt, bos_token,
  // chat-template kwargs...). Throws TemplateError.
  Rendered render(const Dict& variables, const RenderOptions& options = {}) const;

 private:
  std::string name_;
  std::shared_ptr<const std::vector<std::unique_ptr<ast::Node>>> body_;
  bool has_generation_ = false;
};

// The variables apply_chat_template(tokenize=False) passes to a template: `messages` with each
// message's null-valued keys dropped (_normalize_chat_messages) and reasoning aliased as
// transformers does (the first non-null of reasoning_content / thinking / reasoning is also set as
// `thinking` and `reasoning_content`), `tools` (None when null), `documents` (None),
// `add_generation_prompt`, then `kwargs` (special tokens such as bos_token and eos_token, and
// chat-template kwargs such as enable_thinking).
Dict hf_template_variables(const nlohmann::ordered_json& messages,
                           const nlohmann::ordered_json& tools, bool add_generation_prompt,
                           const Dict& kwargs);

}  // namespace dflash::chat
