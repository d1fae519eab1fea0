#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <nlohmann/json.hpp>
#include <optional>
#include <queue>
#include <thread>
#include <unordered_map>

#include "common/error.h"
#include "common/file.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace dflash::tok {
namespace {

using json = nlohmann::json;

// GPT-2's pre-tokenizer regex, used by ByteLevel when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// GPT-2's bytes_to_unicode(): printable bytes map to themselves, the rest to U+0100 onwards.
struct ByteMap {
  std::array<char32_t, 256> to_char{};
  std::array<int, 512> to_byte{};  // indexed by code point; -1 when not a byte's char
  ByteMap() {
    to_byte.fill(-1);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      to_byte[to_char[b]] = b;
    }
  }
};
const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// The raw bytes a byte-level vocabulary string stands for; nullopt when some character is not
// one of the 256 byte characters (such a token cannot come out of BPE over bytes).
std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  std::string out;
  for (size_t i = 0; i < token.size();) {
    char32_t c = next_code_point(token, i);
    if (c >= 512 || byte_map().to_byte[c] < 0) return std::nullopt;
    out.push_back(static_cast<char>(byte_map().to_byte[c]));
  }
  return out;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Leftmost-longest matching of added tokens, as HF's AddedVocabulary does with aho-corasick.
class AddedMatcher {
 public:
  void add(const std::string& content, int32_t id) {
    auto b = static_cast<unsigned char>(content[0]);
    first_[b] = true;
    auto& list = by_first_[b];
    list.push_back({content, id});
    std::stable_sort(list.begin(), list.end(),
                     [](const Entry& a, const Entry& c) { return a.text.size() > c.text.size(); });
    empty_ = false;
  }
  bool empty() const { return empty_; }
  // First match at or after `from`: sets begin/length/id.
  bool find(std::string_view s, size_t from, size_t& begin, size_t& length, int32_t& id) const {
    if (empty_) return false;
    for (size_t i = from; i < s.size(); ++i) {
      auto b = static_cast<unsigned char>(s[i]);
      if (!first_[b]) continue;
      for (const Entry& e : by_first_[b]) {
        if (s.compare(i, e.text.size(), e.text) == 0) {
          begin = i;
          length = e.text.size();
          id = e.id;
          return true;
        }
      }
    }
    return false;
  }

 private:
  struct Entry {
    std::string text;
    int32_t id;
  };
  std::array<bool, 256> first_{};
  std::array<std::vector<Entry>, 256> by_first_;
  bool empty_ = true;
};

std::atomic<uint64_t> next_tokenizer_serial{1};

// An entry of tokenizer.json's added_tokens.
struct AddedToken {
  std::string content;
  int32_t id;
  bool special, normalized;
};

}  // namespace

struct Tokenizer::Impl {
  uint64_t serial = next_tokenizer_serial.fetch_add(1);
  std::string source;
  // BPE model over raw bytes (the byte-level alphabet is undone once, at load).
  StringMap vocab;                                                   // bytes -> id
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (left,right) -> rank,id
  std::array<int32_t, 256> byte_id{};
  bool ignore_merges = false;
  // Everything indexed by id: decode bytes, token strings, special flags.
  std::vector<std::string> decode_bytes;
  std::vector<std::string> token_text;
  std::vector<uint8_t> special;
  std::vector<uint8_t> known;
  StringMap token_to_id;
  AddedMatcher added_raw;         // normalized: false, matched on the input text
  AddedMatcher added_normalized;  // normalized: true, matched after normalization
  bool nfc = false;
  std::vector<std::unique_ptr<SplitRegex>> splits;  // applied in order, Isolated behaviour
  // TemplateProcessing "single": ids before and after the sequence.
  std::vector<int32_t> prefix, suffix;

  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  // The pre-tokenizer's words of `piece` as byte ranges (each Split in order, Isolated).
  void split_words(std::string_view piece, std::vector<std::pair<size_t, size_t>>& words) const;
  void encode_piece(std::string_view piece, size_t base, std::vector<int32_t>& ids,
                    std::vector<uint32_t>* offsets) const;
  void encode_text_segment(std::string_view raw, size_t raw_begin, std::vector<int32_t>& ids,
                           std::vector<uint32_t>* offsets) const;

  // from_json's steps, in its order (errors name `source`).
  void add_vocab(const std::vector<std::pair<std::string, int32_t>>& entries,
                 const std::vector<AddedToken>& added);
  void read_merges(const json& model);
  void add_added(const std::vector<AddedToken>& added);
  void read_normalizer(const json& j);
  void read_pre_tokenizer(const json& j);
  void read_post_processor(const json& j);
};

namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Word -> ids cache per thread, as HF caches per model; keyed by tokenizer serial so a new
// tokenizer at a reused address never sees stale entries.
struct WordCache {
  uint64_t serial = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};
constexpr size_t kCacheMaxEntries = 1 << 16;
constexpr size_t kCacheMaxWordBytes = 256;

}  // namespace

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges) {  // Llama-3: a word that is itself a token is not split
    auto it = vocab.find(word);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  thread_local WordCache cache;
  if (cache.serial != serial) {
    cache.map.clear();
    cache.serial = serial;
  }
  bool cacheable = word.size() <= kCacheMaxWordBytes;
  if (cacheable) {
    auto it = cache.map.find(word);
    if (it != cache.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  // HF's Word::merge_all: a heap of candidate merges ordered by (rank, position); stale
  // entries (a side already merged away) are skipped when popped.
  struct Sym {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  for (char ch : word) {
    int32_t id = byte_id[static_cast<unsigned char>(ch)];
    if (id < 0) continue;  // no token for this byte and no unk: HF drops it
    int32_t n = static_cast<int32_t>(syms.size());
    syms.push_back({id, n - 1, n + 1, true});
  }
  if (!syms.empty()) syms.back().next = -1;
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t pos) {
    int32_t nx = syms[pos].next;
    if (nx < 0) return;
    auto it = merges.find(pair_key(syms[pos].id, syms[nx].id));
    if (it != merges.end()) heap.push({it->second.first, pos, it->second.second});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) push(i);
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& s = syms[c.pos];
    if (!s.alive || s.next < 0) continue;
    auto it = merges.find(pair_key(s.id, syms[s.next].id));
    if (it == merges.end() || it->second.second != c.new_id) continue;
    Sym& right = syms[s.next];
    right.alive = false;
    s.id = c.new_id;
    s.next = right.next;
    if (s.next >= 0) syms[s.next].prev = c.pos;
    if (s.prev >= 0) push(s.prev);
    push(c.pos);
  }
  size_t start = out.size();
  for (int32_t i = syms.empty() ? -1 : 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
  if (cacheable) {
    if (cache.map.size() >= kCacheMaxEntries) cache.map.clear();
    cache.map.emplace(std::string(word), std::vector<int32_t>(out.begin() + start, out.end()));
  }
}

void Tokenizer::Impl::split_words(std::string_view piece,
                                  std::vector<std::pair<size_t, size_t>>& words) const {
  thread_local std::vector<std::pair<size_t, size_t>> next;
  thread_local std::string storage;
  const std::string_view subject = SplitRegex::pcre2_view(piece, storage);
  words.assign(1, {0, piece.size()});
  for (const auto& re : splits) {
    next.clear();
    for (auto [b, e] : words) {
      std::string_view sub = subject.substr(b, e - b);
      size_t pos = 0, mb, me;
      while (pos < sub.size() && re->find(sub, pos, mb, me)) {
        if (mb > pos) next.push_back({b + pos, b + mb});  // Isolated keeps the gaps too
        next.push_back({b + mb, b + me});
        pos = me;
      }
      if (pos < sub.size()) next.push_back({b + pos, e});
    }
    words.swap(next);
  }
}

// Pre-tokenizes one piece of normalized text and runs BPE over each word. Offsets are pushed
// in normalized coordinates (`base` + position in the piece).
void Tokenizer::Impl::encode_piece(std::string_view piece, size_t base, std::vector<int32_t>& ids,
                                   std::vector<uint32_t>* offsets) const {
  if (piece.empty()) return;
  thread_local std::vector<std::pair<size_t, size_t>> words;
  split_words(piece, words);
  for (auto [b, e] : words) {
    size_t first = ids.size();
    bpe(piece.substr(b, e - b), ids);
    if (!offsets) continue;
    size_t at = base + b;
    for (size_t k = first; k < ids.size(); ++k) {
      offsets->push_back(static_cast<uint32_t>(at));
      at += decode_bytes[ids[k]].size();
    }
  }
}

// One stretch of input between added tokens: normalize, split out `normalized` added tokens,
// encode the rest. Offsets of tokens map back from normalized to input coordinates through the
// unchanged prefix and suffix of the stretch; that is exact wherever normalization left the text
// alone, which covers every chat-span boundary (they sit next to ASCII or added tokens).
void Tokenizer::Impl::encode_text_segment(std::string_view raw, size_t raw_begin,
                                          std::vector<int32_t>& ids,
                                          std::vector<uint32_t>* offsets) const {
  std::string storage;
  std::string_view norm = raw;
  if (nfc && !is_nfc_quick(raw)) {
    storage = tok::nfc(raw);
    norm = storage;
  }
  size_t first_offset = offsets ? offsets->size() : 0;
  size_t pos = 0, mb = 0, ml = 0;
  int32_t id = 0;
  while (pos < norm.size()) {
    bool found = added_normalized.find(norm, pos, mb, ml, id);
    size_t stop = found ? mb : norm.size();
    encode_piece(norm.substr(pos, stop - pos), pos, ids, offsets);
    if (!found) break;
    ids.push_back(id);
    if (offsets) offsets->push_back(static_cast<uint32_t>(mb));
    pos = mb + ml;
  }
  if (!offsets) return;
  size_t n = norm.size(), r = raw.size();
  size_t prefix = 0, suffix = 0;
  if (norm.data() != raw.data()) {
    size_t limit = std::min(n, r);
    while (prefix < limit && norm[prefix] == raw[prefix]) ++prefix;
    while (suffix < limit - prefix && norm[n - 1 - suffix] == raw[r - 1 - suffix]) ++suffix;
  }
  for (size_t k = first_offset; k < offsets->size(); ++k) {
    size_t o = (*offsets)[k];
    if (norm.data() != raw.data()) o = o <= prefix ? o : o >= n - suffix ? o - n + r : prefix;
    (*offsets)[k] = static_cast<uint32_t>(raw_begin + o);
  }
}

void Tokenizer::encode(std::string_view text, bool add_special_tokens, std::vector<int32_t>& ids,
                       std::vector<uint32_t>* offsets) const {
  const Impl& m = *impl_;
  ids.clear();
  if (offsets) offsets->clear();
  if (text.size() > UINT32_MAX) fail("text of {} bytes is too long to encode", text.size());
  if (size_t bad = find_invalid_utf8(text); bad != std::string_view::npos) {
    fail("cannot encode text: invalid UTF-8 at byte {}", bad);
  }
  if (add_special_tokens) {
    ids.insert(ids.end(), m.prefix.begin(), m.prefix.end());
    if (offsets) offsets->resize(ids.size(), 0);
  }
  // Added tokens that are not `normalized` are split out of the raw text first (HF order).
  size_t pos = 0, mb = 0, ml = 0;
  int32_t id = 0;
  while (pos < text.size()) {
    bool found = m.added_raw.find(text, pos, mb, ml, id);
    size_t stop = found ? mb : text.size();
    if (stop > pos) m.encode_text_segment(text.substr(pos, stop - pos), pos, ids, offsets);
    if (!found) break;
    ids.push_back(id);
    if (offsets) offsets->push_back(static_cast<uint32_t>(mb));
    pos = mb + ml;
  }
  if (add_special_tokens && !m.suffix.empty()) {
    ids.insert(ids.end(), m.suffix.begin(), m.suffix.end());
    if (offsets) offsets->resize(ids.size(), static_cast<uint32_t>(text.size()));
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  encode(text, add_special_tokens, ids, nullptr);
  return ids;
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(std::span<const std::string_view> texts,
                                                          bool add_special_tokens,
                                                          int threads) const {
  std::vector<std::vector<int32_t>> out(texts.size());
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(1, texts.size() / 4)));
  // Small chunks taken from a shared counter keep threads busy when text lengths vary.
  std::atomic<size_t> next{0};
  constexpr size_t kChunk = 16;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto work = [&] {
    try {
      for (size_t b; !failed && (b = next.fetch_add(kChunk)) < texts.size();) {
        for (size_t i = b; i < std::min(b + kChunk, texts.size()); ++i) {
          encode(texts[i], add_special_tokens, out[i], nullptr);
        }
      }
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& m = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= m.known.size() || !m.known[id]) continue;
    if (skip_special_tokens && m.special[id]) continue;
    bytes += m.decode_bytes[id];
  }
  return utf8_lossy(bytes);
}

std::vector<std::pair<size_t, size_t>> Tokenizer::pre_tokenize(std::string_view text) const {
  if (size_t bad = find_invalid_utf8(text); bad != std::string_view::npos) {
    fail("cannot pre-tokenize text: invalid UTF-8 at byte {}", bad);
  }
  std::vector<std::pair<size_t, size_t>> words;
  if (!text.empty()) impl_->split_words(text, words);
  return words;
}

int32_t Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->token_to_id.find(token);
  return it == impl_->token_to_id.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->token_text.size()) return {};
  return impl_->token_text[id];
}

size_t Tokenizer::vocab_size() const { return impl_->token_text.size(); }

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->special.size() && impl_->special[id];
}

bool Tokenizer::has_normalizer() const { return impl_->nfc; }

// ---- loading ------------------------------------------------------------------------------

namespace {

[[noreturn]] void unsupported(const std::string& source, std::string_view what, const json& value) {
  fail(
      "{}: unsupported {}: {} (dflash supports byte-level BPE tokenizers as used by "
      "Qwen2/Qwen3, Llama-3 and GPT-2)",
      source, what, value.dump().substr(0, 200));
}

bool is_null_or(const json& j, const char* key, const json& expected) {
  return !j.contains(key) || j[key].is_null() || j[key] == expected;
}

}  // namespace

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(file)) file /= "tokenizer.json";
  if (!std::filesystem::exists(file)) fail("{}: no such tokenizer file", file.string());
  return from_json(read_file(file), file.string());
}

namespace {

// Model: byte-level BPE only.
void check_model(const std::string& src, const json& model) {
  if (model.value("type", "BPE") != "BPE") unsupported(src, "model type", model.at("type"));
  if (!is_null_or(model, "dropout", json(0.0)) && !is_null_or(model, "dropout", json(0))) {
    unsupported(src, "BPE dropout", model["dropout"]);
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!is_null_or(model, key, json(""))) unsupported(src, key, model[key]);
  }
  if (model.value("byte_fallback", false)) unsupported(src, "byte_fallback", true);
  if (!is_null_or(model, "unk_token", json(nullptr))) {
    unsupported(src, "BPE unk_token (byte-level BPE never needs one)", model["unk_token"]);
  }
}

std::vector<std::pair<std::string, int32_t>> vocab_entries(const std::string& src,
                                                           const json& model) {
  std::vector<std::pair<std::string, int32_t>> entries;
  for (const auto& [token, idj] : model.at("vocab").items()) {
    int32_t id = idj.get<int32_t>();
    if (id < 0) fail("{}: negative token id {} for {:?}", src, id, token);
    entries.emplace_back(token, id);
  }
  return entries;
}

std::vector<AddedToken> added_tokens(const std::string& src, const json& j) {
  std::vector<AddedToken> added;
  for (const json& a : j.value("added_tokens", json::array())) {
    AddedToken t{a.at("content").get<std::string>(), a.at("id").get<int32_t>(),
                 a.value("special", false), a.value("normalized", false)};
    if (t.content.empty()) fail("{}: empty added token (id {})", src, t.id);
    if (t.id < 0) fail("{}: negative added token id {}", src, t.id);
    for (const char* flag : {"single_word", "lstrip", "rstrip"}) {
      if (a.value(flag, false)) {
        unsupported(src, fmt::format("added token flag {} on {:?}", flag, t.content), true);
      }
    }
    added.push_back(std::move(t));
  }
  return added;
}

// The parts of a component that may come alone or as a Sequence of them (`list` names the
// Sequence's array).
std::vector<json> sequence_parts(const json& component, const char* list) {
  if (component.at("type") != "Sequence") return {component};
  std::vector<json> parts;
  for (const json& p : component.at(list)) parts.push_back(p);
  return parts;
}

// Decoder: ByteLevel.
void check_decoder(const std::string& src, const json& j) {
  if (!j.contains("decoder") || j["decoder"].is_null() || j["decoder"].at("type") != "ByteLevel") {
    unsupported(src, "decoder", j.value("decoder", json()));
  }
}

}  // namespace

// The id-indexed tables sized for the highest id, then the vocabulary's tokens.
void Tokenizer::Impl::add_vocab(const std::vector<std::pair<std::string, int32_t>>& entries,
                                const std::vector<AddedToken>& added) {
  int32_t max_id = -1;
  for (const auto& entry : entries) max_id = std::max(max_id, entry.second);
  for (const AddedToken& t : added) max_id = std::max(max_id, t.id);
  size_t n = static_cast<size_t>(max_id + 1);
  decode_bytes.assign(n, {});
  token_text.assign(n, {});
  special.assign(n, 0);
  known.assign(n, 0);
  byte_id.fill(-1);
  for (const auto& [token, id] : entries) {
    // The ByteLevel decoder turns each token's characters back into bytes, or keeps the token's
    // own UTF-8 when some character is not a byte character (HF's rule).
    auto bytes = byte_level_to_bytes(token);
    decode_bytes[id] = bytes ? *bytes : token;
    token_text[id] = token;
    known[id] = 1;
    token_to_id[token] = id;
    if (bytes) {
      vocab.emplace(*bytes, id);
      if (bytes->size() == 1) byte_id[static_cast<unsigned char>((*bytes)[0])] = id;
    }
  }
}

void Tokenizer::Impl::read_merges(const json& model) {
  int32_t rank = 0;
  for (const json& mj : model.at("merges")) {
    std::string a, b;
    if (mj.is_string()) {
      auto s = mj.get<std::string>();
      auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        fail("{}: merge {:?} is not two tokens separated by one space", source, s);
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      a = mj.at(0).get<std::string>();
      b = mj.at(1).get<std::string>();
    }
    auto ia = token_to_id.find(a), ib = token_to_id.find(b), ic = token_to_id.find(a + b);
    if (ia == token_to_id.end() || ib == token_to_id.end() || ic == token_to_id.end()) {
      fail("{}: merge {:?} + {:?} refers to a token not in the vocabulary", source, a, b);
    }
    // First occurrence wins, as in HF (later duplicates keep the earlier rank).
    merges.emplace(pair_key(ia->second, ib->second), std::make_pair(rank, ic->second));
    ++rank;
  }
}

// After the merges: a merge may only name vocabulary tokens.
void Tokenizer::Impl::add_added(const std::vector<AddedToken>& added) {
  for (const AddedToken& t : added) {
    decode_bytes[t.id] = byte_level_to_bytes(t.content).value_or(t.content);
    token_text[t.id] = t.content;
    known[t.id] = 1;
    special[t.id] = t.special;
    token_to_id[t.content] = t.id;
    (t.normalized ? added_normalized : added_raw).add(t.content, t.id);
  }
}

// Normalizer: none, or NFC (alone or in a Sequence).
void Tokenizer::Impl::read_normalizer(const json& j) {
  if (!j.contains("normalizer") || j["normalizer"].is_null()) return;
  for (const json& p : sequence_parts(j["normalizer"], "normalizers")) {
    if (p.at("type") != "NFC") unsupported(source, "normalizer", p);
    nfc = true;
  }
}

// Pre-tokenizer: Split (Regex, Isolated) and ByteLevel steps, alone or in a Sequence.
void Tokenizer::Impl::read_pre_tokenizer(const json& j) {
  if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null()) {
    unsupported(source, "missing pre_tokenizer", nullptr);
  }
  const json& pj = j["pre_tokenizer"];
  bool byte_level = false;
  for (const json& p : sequence_parts(pj, "pretokenizers")) {
    std::string type = p.at("type").get<std::string>();
    if (type == "Split") {
      if (p.value("behavior", "") != "Isolated") unsupported(source, "Split behavior", p);
      if (p.value("invert", false)) unsupported(source, "inverted Split", p);
      const json& pat = p.at("pattern");
      if (!pat.contains("Regex")) unsupported(source, "Split pattern (only Regex)", pat);
      if (byte_level) unsupported(source, "Split after ByteLevel", p);
      splits.push_back(std::make_unique<SplitRegex>(pat["Regex"].get<std::string>()));
    } else if (type == "ByteLevel") {
      if (p.value("add_prefix_space", false)) unsupported(source, "ByteLevel add_prefix_space", p);
      if (p.value("use_regex", true)) splits.push_back(std::make_unique<SplitRegex>(kGpt2Pattern));
      byte_level = true;
    } else {
      unsupported(source, "pre_tokenizer", p);
    }
  }
  if (!byte_level) unsupported(source, "pre_tokenizer without ByteLevel", pj);
}

// Post-processor: ByteLevel (offsets only) and TemplateProcessing for the single case.
void Tokenizer::Impl::read_post_processor(const json& j) {
  if (!j.contains("post_processor") || j["post_processor"].is_null()) return;
  for (const json& p : sequence_parts(j["post_processor"], "processors")) {
    std::string type = p.at("type").get<std::string>();
    if (type == "ByteLevel") continue;
    if (type != "TemplateProcessing") unsupported(source, "post_processor", p);
    bool seen_sequence = false;
    prefix.clear();
    suffix.clear();
    for (const json& item : p.at("single")) {
      if (item.contains("Sequence")) {
        if (seen_sequence) unsupported(source, "template with two sequences", p);
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        std::string name = item["SpecialToken"].at("id").get<std::string>();
        const json& st = p.at("special_tokens").at(name);
        auto& dst = seen_sequence ? suffix : prefix;
        for (const json& id : st.at("ids")) dst.push_back(id.get<int32_t>());
      } else {
        unsupported(source, "template item", item);
      }
    }
    if (!seen_sequence) unsupported(source, "template without $A", p);
  }
}

Tokenizer Tokenizer::from_json(std::string_view text, std::string_view source_name) {
  auto m = std::make_shared<Impl>();
  m->source = std::string(source_name);
  const std::string& src = m->source;
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    fail("{}: not valid JSON: {}", src, e.what());
  }
  try {
    const json& model = j.at("model");
    check_model(src, model);
    m->ignore_merges = model.value("ignore_merges", false);
    auto entries = vocab_entries(src, model);
    auto added = added_tokens(src, j);
    m->add_vocab(entries, added);
    m->read_merges(model);
    m->add_added(added);
    m->read_normalizer(j);
    m->read_pre_tokenizer(j);
    check_decoder(src, j);
    m->read_post_processor(j);
    for (int b = 0; b < 256; ++b) {
      if (m->byte_id[b] < 0) {
        fail("{}: the vocabulary has no token for byte 0x{:02X}; not a byte-level BPE vocabulary",
             src, b);
      }
    }
  } catch (const json::exception& e) {
    fail("{}: unexpected structure: {}", src, e.what());
  }
  return Tokenizer(std::move(m));
}

}  // namespace dflash::tok
