#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include <algorithm>
#include <iterator>

#include "common/error.h"
#include "tokenizer/unicode.h"

namespace dflash::tok {

struct SplitRegex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
};

namespace {

// Code points first..last are classed by HF's regex engine as stand_in is by PCRE2.
struct StandIn {
  char32_t first, last, stand_in;
};
#include "tokenizer/regex_classes.inc"

// Oniguruma's \s: Unicode's White_Space (PCRE2 10.42's \s lacks U+0085 and has U+180E).
constexpr std::string_view kSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

}  // namespace

std::string SplitRegex::translate(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[i + 1];
      ++i;
      if (e == 's' || e == 'S') {
        if (e == 'S' && in_class)
          fail("regex {:?}: \\S inside a character class is not supported", p);
        out += in_class ? "" : e == 's' ? "[" : "[^";
        out += kSpace;
        out += in_class ? "" : "]";
      } else if (e == 'p' || e == 'P') {
        // \p{NAME} or \pN: only general categories whose tables pcre2_view makes agree.
        const size_t from = i - 1;
        std::string_view name;
        if (i + 1 < p.size() && p[i + 1] == '{') {
          const size_t close = p.find('}', i + 2);
          if (close == std::string_view::npos) fail("regex {:?}: unterminated \\{}{{", p, e);
          name = p.substr(i + 2, close - i - 2);
          i = close;
        } else if (i + 1 < p.size()) {
          name = p.substr(++i, 1);
        }
        if (std::find(std::begin(kMatchedProperties), std::end(kMatchedProperties), name) ==
            std::end(kMatchedProperties)) {
          fail(
              "regex {:?}: \\{}{{{}}} is not supported (dflash matches HF's Unicode tables for "
              "the general categories {} only)",
              p, e, name, fmt::join(kMatchedProperties, ", "));
        }
        out += p.substr(from, i + 1 - from);
      } else {
        out += '\\';
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[') fail("regex {:?}: nested character classes are not supported", p);
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

std::string_view SplitRegex::pcre2_view(std::string_view text, std::string& storage) {
  bool copied = false;
  for (size_t i = 0; i < text.size();) {
    // Every stand-in replaces a code point of U+0800 or above: 3- and 4-byte sequences.
    if (static_cast<unsigned char>(text[i]) < 0xE0) {
      ++i;
      continue;
    }
    const size_t at = i;
    const char32_t c = next_code_point(text, i);
    const auto* it = std::upper_bound(std::begin(kStandIns), std::end(kStandIns), c,
                                      [](char32_t v, const StandIn& s) { return v < s.first; });
    if (it == std::begin(kStandIns) || c > std::prev(it)->last) continue;
    if (!copied) storage.assign(text);
    copied = true;
    std::string utf8;
    append_utf8(utf8, std::prev(it)->stand_in);
    storage.replace(at, utf8.size(), utf8);  // the same UTF-8 length (gen_regex_classes.py)
  }
  return copied ? std::string_view(storage) : text;
}

SplitRegex::SplitRegex(std::string_view pattern) : impl_(std::make_unique<Impl>()) {
  std::string translated = translate(pattern);
  int err = 0;
  PCRE2_SIZE err_off = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail("cannot compile pre-tokenizer regex {:?} at offset {}: {}", pattern, err_off,
         reinterpret_cast<const char*>(msg));
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

SplitRegex::~SplitRegex() {
  if (impl_ && impl_->code) pcre2_code_free(impl_->code);
}

namespace {
// One match-data block per thread and pattern size: encode() runs on many threads at once.
struct MatchData {
  pcre2_match_data* data = nullptr;
  MatchData() : data(pcre2_match_data_create(16, nullptr)) {}
  ~MatchData() { pcre2_match_data_free(data); }
};
}  // namespace

bool SplitRegex::find(std::string_view s, size_t from, size_t& begin, size_t& end) const {
  thread_local MatchData md;
  auto subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  while (from <= s.size()) {
    int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, s.size(), from, 0, md.data, nullptr)
                        : pcre2_match(impl_->code, subject, s.size(), from, PCRE2_NO_UTF_CHECK,
                                      md.data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail("pre-tokenizer regex match failed: {}", reinterpret_cast<const char*>(msg));
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.data);
    if (ov[1] > ov[0]) {
      begin = ov[0];
      end = ov[1];
      return true;
    }
    // An empty match splits nothing; retry one code point further on.
    from = ov[0] + 1;
    while (from < s.size() && (static_cast<unsigned char>(s[from]) & 0xC0) == 0x80) ++from;
  }
  return false;
}

}  // namespace dflash::tok
