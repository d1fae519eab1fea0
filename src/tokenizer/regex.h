// tokenizer: a PCRE2 regex with the semantics HF tokenizers gets from Oniguruma, for the
// Split pre-tokenizer patterns of Qwen2/Qwen3, Llama-3 and GPT-2.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace dflash::tok {

class SplitRegex {
 public:
  // Compiles `pattern` (Oniguruma syntax as in tokenizer.json) with UTF and Unicode
  // properties; throws dflash::Error for a pattern it cannot translate exactly.
  explicit SplitRegex(std::string_view pattern);
  ~SplitRegex();
  SplitRegex(const SplitRegex&) = delete;
  SplitRegex& operator=(const SplitRegex&) = delete;

  // Finds the first non-empty match in subject[from...]; false when none. `subject` must be
  // valid UTF-8 (not re-checked).
  bool find(std::string_view subject, size_t from, size_t& begin, size_t& end) const;

  // Rewrites the pattern so PCRE2 matches exactly what Oniguruma (in HF tokenizers) does: \s and
  // \S as Unicode's White_Space (PCRE2 10.42 lacks U+0085 and has U+180E), and each \p{NAME}
  // extended by the code points HF's newer Unicode tables have in it (regex_classes.inc, from
  // gen_regex_classes.py); other Unicode properties are refused. Exposed for tests.
  static std::string translate(std::string_view pattern);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::tok
