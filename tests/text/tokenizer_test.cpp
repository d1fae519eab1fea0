// Parity of dflash::tok::Tokenizer with HF tokenizers: ids (with and without special tokens),
// decoded text and round trips on GSM8K test, the stress corpus and text in the pre-tokenizers'
// tricky classes, for the Qwen3-, Llama-3-, GPT-2- and gpt-oss-style (o200k_harmony) tokenizers
// the fixture trains.
#include "tokenizer/tokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string_view>

#include "common/error.h"
#include "text_fixtures.h"
#include "tokenizer/regex.h"
#include "tokenizer/unicode.h"

namespace dflash::tok {
namespace {

using dflash::testing::load_fixture_json;
using dflash::testing::tokenizer_fixtures;

std::string show(std::string_view s) {
  nlohmann::json j = std::string(s);
  return j.dump().substr(0, 300);
}

class TokenizerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerParity, IdsMatchHfOnGsm8kAndStressCorpus) {
  auto dir = tokenizer_fixtures() / GetParam();
  auto ref = load_fixture_json(dir / "parity.json");
  ASSERT_FALSE(ref.is_null());
  Tokenizer tok = Tokenizer::load(dir);
  const auto& texts = ref["texts"];
  size_t gsm = ref["num_gsm8k"].get<size_t>(), mismatches = 0, tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    auto text = texts[i].get<std::string>();
    auto want = ref["ids"][i].get<std::vector<int32_t>>();
    auto got = tok.encode(text, false);
    tokens += got.size();
    if (got != want && ++mismatches <= 5) {
      ADD_FAILURE() << (i < gsm ? "gsm8k" : "stress") << " text " << i << " " << show(text)
                    << "\n got " << ::testing::PrintToString(got) << "\nwant "
                    << ::testing::PrintToString(want);
    }
    auto want_sp = ref["ids_special"][i].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text, true), want_sp) << "with special tokens, text " << i;
  }
  EXPECT_EQ(mismatches, 0u) << "of " << texts.size() << " texts";
  EXPECT_GT(texts.size(), gsm + 1000);  // the stress corpus is really there
  EXPECT_GT(tokens, 100000u);
}

// The split regexes alone, word by word: a boundary the BPE vocabulary would hide (no merge
// across it either way) still shows here.
TEST_P(TokenizerParity, PreTokenizerSplitsLikeHf) {
  auto dir = tokenizer_fixtures() / GetParam();
  auto ref = load_fixture_json(dir / "parity.json");
  ASSERT_FALSE(ref.is_null());
  Tokenizer tok = Tokenizer::load(dir);
  size_t mismatches = 0, words = 0;
  for (size_t i = 0; i < ref["texts"].size(); ++i) {
    auto text = ref["texts"][i].get<std::string>();
    auto want = ref["pretokens"][i].get<std::vector<std::pair<size_t, size_t>>>();
    auto got = tok.pre_tokenize(text);
    words += got.size();
    if (got != want && ++mismatches <= 5) {
      ADD_FAILURE() << "text " << i << " " << show(text) << "\n got "
                    << ::testing::PrintToString(got) << "\nwant " << ::testing::PrintToString(want);
    }
  }
  EXPECT_EQ(mismatches, 0u) << "of " << ref["texts"].size() << " texts";
  EXPECT_GT(words, 50000u);
}

TEST_P(TokenizerParity, DecodeMatchesHfAndRoundTrips) {
  auto dir = tokenizer_fixtures() / GetParam();
  auto ref = load_fixture_json(dir / "parity.json");
  ASSERT_FALSE(ref.is_null());
  Tokenizer tok = Tokenizer::load(dir);
  size_t bad = 0;
  for (size_t i = 0; i < ref["texts"].size(); ++i) {
    auto text = ref["texts"][i].get<std::string>();
    auto ids = ref["ids"][i].get<std::vector<int32_t>>();
    std::string decoded = tok.decode(ids, false);
    if (decoded != ref["decoded"][i].get<std::string>() && ++bad <= 5) {
      ADD_FAILURE() << "decode of text " << i << " " << show(text) << " -> " << show(decoded);
    }
    EXPECT_EQ(tok.decode(ids, true), ref["decoded_skip"][i].get<std::string>()) << i;
    // Round trip: the exact input, or its NFC where the tokenizer normalizes.
    EXPECT_EQ(decoded, tok.has_normalizer() ? nfc(text) : text) << "round trip of text " << i;
  }
  EXPECT_EQ(bad, 0u);
  for (size_t i = 0; i < ref["random_ids"].size(); ++i) {
    auto ids = ref["random_ids"][i].get<std::vector<int32_t>>();
    EXPECT_EQ(tok.decode(ids, false), ref["random_decoded"][i].get<std::string>())
        << "random ids " << ::testing::PrintToString(ids);
  }
}

TEST_P(TokenizerParity, BatchEncodingEqualsSequential) {
  auto dir = tokenizer_fixtures() / GetParam();
  auto ref = load_fixture_json(dir / "parity.json");
  ASSERT_FALSE(ref.is_null());
  Tokenizer tok = Tokenizer::load(dir);
  std::vector<std::string> owned;
  for (const auto& t : ref["texts"]) owned.push_back(t.get<std::string>());
  std::vector<std::string_view> views(owned.begin(), owned.end());
  for (int threads : {1, 3}) {
    auto batch = tok.encode_batch(views, false, threads);
    ASSERT_EQ(batch.size(), owned.size());
    for (size_t i = 0; i < owned.size(); ++i) {
      ASSERT_EQ(batch[i], ref["ids"][i].get<std::vector<int32_t>>()) << threads << " " << i;
    }
  }
}

TEST_P(TokenizerParity, OffsetsTileTheText) {
  auto dir = tokenizer_fixtures() / GetParam();
  auto ref = load_fixture_json(dir / "parity.json");
  ASSERT_FALSE(ref.is_null());
  Tokenizer tok = Tokenizer::load(dir);
  std::vector<int32_t> ids;
  std::vector<uint32_t> offsets;
  for (const auto& t : ref["texts"]) {
    auto text = t.get<std::string>();
    tok.encode(text, false, ids, &offsets);
    ASSERT_EQ(ids.size(), offsets.size());
    for (size_t k = 0; k < offsets.size(); ++k) {
      ASSERT_LE(offsets[k], text.size());
      if (k) {
        ASSERT_LE(offsets[k - 1], offsets[k]) << show(text);
      }
    }
    // Where nothing was normalized, each token's bytes are exactly the text at its offset.
    if (!tok.has_normalizer() || nfc(text) == text) {
      for (size_t k = 0; k < ids.size(); ++k) {
        std::string piece = tok.decode(std::span(&ids[k], 1), false);
        size_t end = k + 1 < ids.size() ? offsets[k + 1] : text.size();
        std::string raw = text.substr(offsets[k], end - offsets[k]);
        if (piece.find("\xEF\xBF\xBD") == std::string::npos) {
          ASSERT_EQ(piece, raw) << show(text);
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(tokenizer, TokenizerParity,
                         ::testing::Values("qwen3", "llama3", "gpt2", "o200k"));

// gpt-oss's harmony tokens keep o200k_harmony's ids (the fixture pads the vocabulary to its
// 199,998 BPE entries), and split out of text as single tokens.
TEST(Tokenizer, HarmonyTokensHaveO200kHarmonyIds) {
  Tokenizer tok = Tokenizer::load(tokenizer_fixtures() / "o200k");
  const std::pair<const char*, int32_t> ids[] = {
      {"<|startoftext|>", 199998}, {"<|endoftext|>", 199999}, {"<|return|>", 200002},
      {"<|constrain|>", 200003},   {"<|channel|>", 200005},   {"<|start|>", 200006},
      {"<|end|>", 200007},         {"<|message|>", 200008},   {"<|call|>", 200012}};
  for (const auto& [token, id] : ids) {
    EXPECT_EQ(tok.token_to_id(token), id) << token;
    EXPECT_TRUE(tok.is_special(id)) << token;
    EXPECT_EQ(tok.encode(token, false), std::vector<int32_t>{id}) << token;
  }
  EXPECT_EQ(tok.vocab_size(), 200019u);
  const auto header = tok.encode("<|start|>assistant<|channel|>final<|message|>", false);
  ASSERT_GE(header.size(), 4u);
  EXPECT_EQ(header.front(), 200006);
  EXPECT_EQ(header.back(), 200008);
}

// Every code point's character classes as the split regexes see them (Oniguruma's Unicode tables
// in HF against PCRE2's here): the fixture's probe with each code point in place of '|' splits
// into words of the same byte lengths as HF's; the fixture lists the lengths run-length encoded.
TEST(Tokenizer, EveryCodePointSplitsLikeHf) {
  for (const char* kind : {"qwen3", "o200k"}) {
    auto dir = tokenizer_fixtures() / kind;
    auto ref = load_fixture_json(dir / "codepoints.json");
    ASSERT_FALSE(ref.is_null()) << kind;
    Tokenizer tok = Tokenizer::load(dir);
    const auto probe = ref["probe"].get<std::string>();
    const auto& runs = ref["runs"];
    size_t run = 0, mismatches = 0, checked = 0;
    for (char32_t c = 0; c < 0x110000; ++c) {
      if (c >= 0xD800 && c < 0xE000) continue;
      while (run + 1 < runs.size() && runs[run + 1][0].get<char32_t>() <= c) ++run;
      std::string ch, text;
      append_utf8(ch, c);
      for (char p : probe) p == '|' ? text += ch : text += p;
      std::vector<size_t> lengths;
      for (auto [b, e] : tok.pre_tokenize(text)) lengths.push_back(e - b);
      ++checked;
      if (lengths != runs[run][1].get<std::vector<size_t>>() && ++mismatches <= 5) {
        ADD_FAILURE() << kind << ": U+" << std::hex << static_cast<uint32_t>(c) << std::dec
                      << " splits into " << ::testing::PrintToString(lengths) << ", HF "
                      << runs[run][1].dump();
      }
    }
    EXPECT_EQ(mismatches, 0u) << kind << ": of " << checked << " code points";
    EXPECT_EQ(checked, 0x110000u - 0x800u);
  }
}

// Properties whose tables cannot be matched to HF's are refused by name, not run differently.
TEST(Tokenizer, SplitRegexRefusesPropertiesItCannotMatch) {
  EXPECT_NO_THROW(SplitRegex("[^\\s\\p{L}\\pN\\p{Lu}]+|\\P{M}|[\\P{L}]"));
  for (const char* pattern : {"\\p{Han}", "\\p{Mn}", "[\\P{Mc}]"}) {
    EXPECT_THAT([&] { SplitRegex re(pattern); },
                ::testing::ThrowsMessage<dflash::Error>(::testing::HasSubstr("not supported")))
        << pattern;
  }
}

TEST(Tokenizer, RejectsInvalidUtf8) {
  Tokenizer tok = Tokenizer::load(tokenizer_fixtures() / "qwen3");
  EXPECT_THROW(tok.encode("ab\xC3(", false), dflash::Error);
  EXPECT_THROW(tok.encode("\xED\xA0\x80", false), dflash::Error);  // a surrogate
}

TEST(Tokenizer, SpecialTokenLookups) {
  Tokenizer tok = Tokenizer::load(tokenizer_fixtures() / "qwen3");
  int32_t im_end = tok.token_to_id("<|im_end|>");
  ASSERT_GE(im_end, 0);
  EXPECT_TRUE(tok.is_special(im_end));
  EXPECT_FALSE(tok.is_special(tok.token_to_id("<think>")));
  EXPECT_EQ(tok.id_to_token(im_end), "<|im_end|>");
  EXPECT_EQ(tok.token_to_id("no such token"), -1);
  EXPECT_EQ(tok.encode("<|im_end|>", false), std::vector<int32_t>{im_end});
}

TEST(Tokenizer, UnsupportedPartsAreClearErrors) {
  auto base = load_fixture_json(tokenizer_fixtures() / "gpt2" / "tokenizer.json");
  ASSERT_FALSE(base.is_null());
  auto expect_error = [&](nlohmann::json j, const std::string& needle) {
    try {
      Tokenizer::from_json(j.dump(), "t.json");
      ADD_FAILURE() << "accepted " << needle;
    } catch (const dflash::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto j = base;
  j["model"]["type"] = "WordPiece";
  expect_error(j, "unsupported model type");
  j = base;
  j["normalizer"] = {{"type", "Lowercase"}};
  expect_error(j, "unsupported normalizer");
  j = base;
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  expect_error(j, "unsupported pre_tokenizer");
  j = base;
  j["model"]["byte_fallback"] = true;
  expect_error(j, "byte_fallback");
  j = base;
  j["added_tokens"][0]["lstrip"] = true;
  expect_error(j, "lstrip");
  expect_error(nlohmann::json::object(), "unexpected structure");
  EXPECT_THROW(Tokenizer::from_json("{not json", "t.json"), dflash::Error);
}

}  // namespace
}  // namespace dflash::tok
