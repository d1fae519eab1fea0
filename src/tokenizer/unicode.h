// UTF-8 and Unicode helpers the tokenizer and the chat renderer need: validation, lossy
// decoding with the same replacement rule as Rust's String::from_utf8_lossy (which HF
// tokenizers uses to decode), NFC normalization without ICU, and Python's str.isspace().
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dflash::tok {

// Byte offset of the first invalid UTF-8 sequence in `s`, or npos when `s` is valid
// (surrogates and overlong forms are invalid, as in Rust and Python).
size_t find_invalid_utf8(std::string_view s);

// Replaces each maximal invalid subsequence with U+FFFD (the Unicode "maximal subpart" rule
// that Rust's from_utf8_lossy implements).
std::string utf8_lossy(std::string_view s);

// Decodes the code point at s[i] (valid UTF-8 assumed) and advances i past it.
char32_t next_code_point(std::string_view s, size_t& i);
void append_utf8(std::string& out, char32_t c);

// Unicode Normalization Form C of valid UTF-8, with the Unicode tables of HF tokenizers'
// normalizer (older than current Unicode; see gen_nfc_data.py), because matching HF is the
// point.
std::string nfc(std::string_view s);
bool is_nfc_quick(std::string_view s);  // true when nfc(s) == s is certain without work (ASCII)

// Python's str.isspace() for one code point: what Jinja's `trim` (str.strip()) removes.
bool is_python_space(char32_t c);

}  // namespace dflash::tok
