#include "tokenizer/builtin.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <string_view>

#include "common/error.h"
#include "common/file.h"
#include "common/mask_token.h"

namespace dflash::tok {
namespace {

// kTokenizerJson and kTokenizerConfigJson, the files as raw string literals (src/CMakeLists.txt).
#include "tokenizer/builtin_data.inc"

using json = nlohmann::json;

constexpr int64_t kByteSymbols = 256;

}  // namespace

int64_t builtin_vocab_size() {
  const json j = json::parse(kTokenizerJson);
  return static_cast<int64_t>(j["model"]["vocab"].size() + j["added_tokens"].size());
}

std::string builtin_tokenizer_json(int64_t vocab_size,
                                   const std::vector<std::string>& extra_tokens) {
  json j = json::parse(kTokenizerJson);
  json& vocab = j["model"]["vocab"];
  json& merges = j["model"]["merges"];
  json& added = j["added_tokens"];
  for (const std::string& token : extra_tokens) {
    json entry = added.back();  // <|MASK|>'s flags: special, matched whole
    entry["content"] = token;
    added.insert(added.end() - 1, entry);
  }
  const auto n_added = static_cast<int64_t>(added.size());
  if (vocab_size < kByteSymbols + n_added) {
    fail("tokenizer: a vocabulary of {} ids cannot hold the {} byte symbols and {} added tokens",
         vocab_size, kByteSymbols, n_added);
  }
  const int64_t mask_id = std::min(vocab_size - 1, kQwen3MaskToken);
  const int64_t first_added = mask_id - n_added + 1;
  const int64_t bpe = std::min(static_cast<int64_t>(vocab.size()), first_added);
  json kept = json::object();
  for (const auto& [token, id] : vocab.items()) {
    if (id.get<int64_t>() < bpe) kept[token] = id;
  }
  for (int64_t id = bpe; id < vocab_size; ++id) {
    if (id >= first_added && id <= mask_id) continue;
    const std::string pad = fmt::format("<|pad_{}|>", id);
    if (kept.contains(pad)) fail("tokenizer: padding entry {} is already a BPE token", pad);
    kept[pad] = id;
  }
  vocab = std::move(kept);
  merges.erase(merges.begin() + (bpe - kByteSymbols), merges.end());
  for (int64_t i = 0; i < n_added; ++i) added[i]["id"] = first_added + i;
  return j.dump(2);
}

void write_builtin_tokenizer(const std::filesystem::path& dir, int64_t vocab_size) {
  std::filesystem::create_directories(dir);
  write_file_atomic(dir / "tokenizer.json", builtin_tokenizer_json(vocab_size));
  write_file_atomic(dir / "tokenizer_config.json", kTokenizerConfigJson);
}

void write_builtin_harmony_tokenizer(const std::filesystem::path& dir,
                                     const std::string& chat_template) {
  std::filesystem::create_directories(dir);
  write_file_atomic(
      dir / "tokenizer.json",
      builtin_tokenizer_json(builtin_vocab_size() + static_cast<int64_t>(kHarmonyTokens.size()),
                             kHarmonyTokens));
  json config = json::parse(kTokenizerConfigJson);
  config["chat_template"] = chat_template;
  config["eos_token"] = "<|return|>";
  config["pad_token"] = "<|endoftext|>";
  write_file_atomic(dir / "tokenizer_config.json", config.dump(2));
}

}  // namespace dflash::tok
