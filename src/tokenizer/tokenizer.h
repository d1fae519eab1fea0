// tokenizer: byte-level BPE tokenizers loaded from a HF tokenizer.json (Qwen2/Qwen3, Llama-3,
// GPT-2 style), exact against HF tokenizers: added tokens split out first, optional NFC,
// Split/ByteLevel pre-tokenizers, BPE merges by rank, TemplateProcessing, ByteLevel decoding.
// Anything else in a tokenizer.json is rejected with an error naming the unsupported part, so a
// silently different tokenization cannot happen. Also owns unicode.h (NFC, UTF-8 helpers).
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash::tok {

class Tokenizer {
 public:
  // `path` is a tokenizer.json or a directory holding one.
  static Tokenizer load(const std::filesystem::path& path);
  // `source` names the origin in error messages.
  static Tokenizer from_json(std::string_view json, std::string_view source = "tokenizer.json");

  // Ids HF's `Tokenizer.encode(text, add_special_tokens=...).ids` returns. `text` must be valid
  // UTF-8 (dflash::Error otherwise). With `offsets`, also the byte offset in `text` where each
  // token starts (post-processor tokens get the offset of the text they precede); this is what
  // chat masks use to tell which tokens belong to an assistant turn.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;
  void encode(std::string_view text, bool add_special_tokens, std::vector<int32_t>& ids,
              std::vector<uint32_t>* offsets) const;

  // Encodes each text on `threads` threads (0: all hardware threads); same ids as encode().
  std::vector<std::vector<int32_t>> encode_batch(std::span<const std::string_view> texts,
                                                 bool add_special_tokens, int threads = 0) const;

  // HF's `Tokenizer.decode`: invalid UTF-8 from partial byte tokens becomes U+FFFD.
  // Ids outside the vocabulary are skipped, as HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // The words the pre-tokenizer alone splits `text` into, as [begin, end) byte ranges: what HF's
  // `pre_tokenizer.pre_tokenize_str(text)` returns (no normalizer, no added tokens). Lets tests
  // check the split regexes directly, where BPE over a small vocabulary would hide a boundary.
  std::vector<std::pair<size_t, size_t>> pre_tokenize(std::string_view text) const;

  int32_t token_to_id(std::string_view token) const;  // -1 when absent
  std::string id_to_token(int32_t id) const;          // "" when absent
  size_t vocab_size() const;                          // highest id + 1, added tokens included
  bool is_special(int32_t id) const;
  bool has_normalizer() const;

 private:
  struct Impl;
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace dflash::tok
