// NFC and UTF-8 helpers against HF tokenizers' own NFC (the Rust unicode-normalization crate),
// on every code point and on every canonical decomposition re-composed.
#include "tokenizer/unicode.h"

#include <gtest/gtest.h>

#include "text_fixtures.h"

namespace dflash::tok {
namespace {

TEST(Nfc, EveryCodePointMatchesHf) {
  auto ref = dflash::testing::load_fixture_json(dflash::testing::tokenizer_fixtures() / "nfc.json");
  ASSERT_FALSE(ref.is_null());
  const auto& changed = ref["changed"];
  size_t bad = 0;
  for (char32_t c = 0; c < 0x110000; ++c) {
    if (c >= 0xD800 && c < 0xE000) continue;
    std::string s;
    append_utf8(s, c);
    auto it = changed.find(std::to_string(static_cast<uint32_t>(c)));
    std::string want = it == changed.end() ? s : it->get<std::string>();
    if (nfc(s) != want && ++bad <= 10) ADD_FAILURE() << "U+" << std::hex << uint32_t(c);
  }
  EXPECT_EQ(bad, 0u);
}

TEST(Nfc, CompositionAndReorderingMatchHf) {
  auto ref = dflash::testing::load_fixture_json(dflash::testing::tokenizer_fixtures() / "nfc.json");
  ASSERT_FALSE(ref.is_null());
  size_t bad = 0;
  for (size_t i = 0; i < ref["inputs"].size(); ++i) {
    auto in = ref["inputs"][i].get<std::string>();
    auto want = ref["outputs"][i].get<std::string>();
    if (nfc(in) != want && ++bad <= 10) ADD_FAILURE() << nlohmann::json(in).dump();
  }
  EXPECT_EQ(bad, 0u) << "of " << ref["inputs"].size();
  EXPECT_GT(ref["inputs"].size(), 5000u);
}

TEST(Utf8, Validation) {
  EXPECT_EQ(find_invalid_utf8("plain"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("\xC3\xA9\xF0\x9F\x98\x80"), std::string_view::npos);
  EXPECT_EQ(find_invalid_utf8("a\xC0\x80"), 1u);         // overlong
  EXPECT_EQ(find_invalid_utf8("ab\xED\xA0\x80"), 2u);    // surrogate
  EXPECT_EQ(find_invalid_utf8("\xF4\x90\x80\x80"), 0u);  // above U+10FFFF
  EXPECT_EQ(find_invalid_utf8("x\xE2\x82"), 1u);         // truncated
  EXPECT_EQ(find_invalid_utf8("\x80"), 0u);
}

TEST(Utf8, LossyReplacesMaximalSubparts) {
  // One U+FFFD per maximal subpart, as Rust's from_utf8_lossy and Python's "replace" do.
  EXPECT_EQ(utf8_lossy("a\xE2\x82z"), "a\xEF\xBF\xBDz");
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), "\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xC0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8_lossy("\xE2\x82\xAC"), "\xE2\x82\xAC");
}

TEST(Unicode, PythonIsSpace) {
  for (char32_t c : {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x1C, 0x1F, 0x20, 0x85, 0xA0, 0x1680, 0x2000,
                     0x200A, 0x2028, 0x2029, 0x202F, 0x205F, 0x3000}) {
    EXPECT_TRUE(is_python_space(c)) << uint32_t(c);
  }
  for (char32_t c : {0x00, 0x08, 0x41, 0x200B, 0xFEFF, 0x180E}) {
    EXPECT_FALSE(is_python_space(c)) << uint32_t(c);
  }
}

}  // namespace
}  // namespace dflash::tok
