// Prepared datasets: `prepare_dataset` over chat JSONL with bad lines, the memory-mapped reader
// (samples equal to tokenizing the lines directly; corruption and truncation detected), the
// seeded resumable sampler, and the checksums.
#include "data/dataset.h"

#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "data/checksum.h"
#include "data/prepare.h"
#include "text_fixtures.h"

namespace dflash::data {
namespace {

namespace fs = std::filesystem;
using dflash::testing::load_fixture_json;
using dflash::testing::tokenizer_fixtures;

TEST(Checksum, KnownVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::string big(1000, 'x');
  EXPECT_EQ(crc32c(big.data() + 3, 500, crc32c(big.data(), 3)), crc32c(big.data(), 503));
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex(std::string(1000, 'a')),
            "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3");
}

TEST(EpochSampler, PermutationsAreSeededDistinctAndResumable) {
  EpochSampler a(1000, 42), b(1000, 42), c(1000, 43);
  auto p0 = a.permutation(0);
  std::set<uint32_t> seen(p0.begin(), p0.end());
  EXPECT_EQ(seen.size(), 1000u);
  EXPECT_EQ(p0, b.permutation(0));
  EXPECT_NE(p0, a.permutation(1));
  EXPECT_NE(p0, c.permutation(0));
  std::vector<size_t> run;
  for (int i = 0; i < 2500; ++i) run.push_back(a.next());
  EXPECT_EQ(a.position().epoch, 2u);
  EXPECT_EQ(a.position().step, 500u);
  EpochSampler resumed(1000, 42);
  resumed.seek({1, 300});
  for (int i = 1300; i < 2500; ++i) ASSERT_EQ(resumed.next(), run[i]) << i;
  // Ranks split each epoch into equal disjoint parts.
  std::set<size_t> all;
  for (size_t r = 0; r < 3; ++r) {
    EpochSampler s(1000, 42, r, 3);
    EXPECT_EQ(s.per_epoch(), 333u);
    for (size_t i = 0; i < s.per_epoch(); ++i) EXPECT_TRUE(all.insert(s.next()).second);
  }
  EXPECT_EQ(all.size(), 999u);
  EXPECT_THROW(EpochSampler(10, 1, 3, 3), dflash::Error);
}

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("dflash_prepare_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    auto ref = load_fixture_json(tokenizer_fixtures() / "chat.json");
    ASSERT_FALSE(ref.is_null());
    for (const auto& l : ref["lines"]) good_.push_back(l.get<std::string>());
    // Bad lines of every kind, between good ones; line numbers are checked below.
    std::ofstream f(dir_ / "a.jsonl", std::ios::binary);
    size_t line = 0;
    auto put = [&](const std::string& s) {
      f << s << "\n";
      ++line;
    };
    for (size_t i = 0; i < good_.size(); ++i) {
      put(good_[i]);
      if (i == 3) put("{\"messages\": [");  // line 5 (see the reports below)
      if (i == 7) put("");                  // blank: ignored, not an error
      if (i == 10) put("{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}");
      if (i == 12) put("{\"messages\": \"\xC3(\"}");
      if (i == 20) put(R"({"conversations": [{"from": "bot", "value": "x"}]})");
    }
    f.close();
    lines_ = line;
    opt_.tokenizer_dir = tokenizer_fixtures() / "qwen3";
    opt_.inputs = {dir_ / "a.jsonl"};
    opt_.out_dir = dir_ / "out";
    opt_.threads = 3;
  }
  void TearDown() override { fs::remove_all(dir_); }

  PrepareSummary run(std::vector<std::string>* reports = nullptr) {
    return prepare_dataset(
        opt_,
        [&](const std::string& r) {
          if (reports) reports->push_back(r);
        },
        nullptr);
  }

  fs::path dir_;
  std::vector<std::string> good_;
  size_t lines_ = 0;
  PrepareOptions opt_;
};

TEST_F(PrepareTest, WritesWhatTokenizingEachLineGives) {
  std::vector<std::string> reports;
  opt_.shard_tokens = 5000;  // several shards
  auto s = run(&reports);
  EXPECT_EQ(s.samples, good_.size());
  EXPECT_EQ(s.skipped, 4u);
  EXPECT_GT(s.shards, 2u);
  ASSERT_EQ(reports.size(), 4u);
  std::string file = (dir_ / "a.jsonl").string();
  EXPECT_EQ(reports[0].substr(0, file.size() + 4), file + ":5: ");
  EXPECT_NE(reports[0].find("malformed JSON"), std::string::npos);
  EXPECT_EQ(reports[1], file + ":14: no assistant turn");
  EXPECT_EQ(reports[2], file + ":17: invalid UTF-8 at byte 14");
  EXPECT_EQ(reports[3], file + ":26: message 0 has unknown role \"bot\"");
  EXPECT_EQ(s.sources[0].lines, lines_);
  EXPECT_EQ(s.sources[0].skipped.at("malformed JSON"), 1u);

  Dataset d = Dataset::open(opt_.out_dir);
  ASSERT_EQ(d.size(), good_.size());
  EXPECT_EQ(d.tokens(), s.tokens);
  auto tok = tok::Tokenizer::load(opt_.tokenizer_dir);
  auto chat = detect_chat_config(opt_.tokenizer_dir);
  for (size_t i = 0; i < good_.size(); ++i) {
    TokenizedChat want;
    tokenize_chat(tok, render_chat(parse_conversation(good_[i]), chat), want);
    auto got = d[i];
    ASSERT_EQ(std::vector<int32_t>(got.ids.begin(), got.ids.end()), want.ids) << i;
    ASSERT_EQ(std::vector<uint8_t>(got.mask.begin(), got.mask.end()), want.mask) << i;
  }
  const auto& m = d.manifest();
  EXPECT_EQ(m["format_version"], kDatasetFormatVersion);
  EXPECT_EQ(m["chat_format"], "qwen3");
  EXPECT_EQ(m["tokenizer"]["sha256"].get<std::string>().size(), 64u);
  EXPECT_EQ(m["totals"]["samples"], good_.size());
  uint64_t hist = 0;
  for (auto c : s.length_histogram) hist += c;
  EXPECT_EQ(hist, s.samples);
  EXPECT_FALSE(format_length_histogram(s).empty());
}

TEST_F(PrepareTest, OutputDoesNotDependOnThreadCount) {
  opt_.threads = 1;
  run();
  auto one = Dataset::open(opt_.out_dir).manifest()["shards"];
  opt_.threads = 4;
  opt_.overwrite = true;
  run();
  EXPECT_EQ(Dataset::open(opt_.out_dir).manifest()["shards"], one);
}

TEST_F(PrepareTest, RefusesToOverwriteWithoutFlag) {
  run();
  EXPECT_THROW(run(), dflash::Error);
}

TEST_F(PrepareTest, StrictStopsAtTheFirstBadLine) {
  opt_.strict = true;
  try {
    run();
    FAIL() << "strict run accepted bad lines";
  } catch (const dflash::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a.jsonl:5: malformed JSON"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(opt_.out_dir / "manifest.json"));
}

TEST_F(PrepareTest, TruncatesOrSkipsOverlongSamples) {
  opt_.max_length = 64;
  auto s = run();
  EXPECT_GT(s.truncated, 0u);
  Dataset d = Dataset::open(opt_.out_dir);
  for (size_t i = 0; i < d.size(); ++i) EXPECT_LE(d[i].ids.size(), 64u);
  opt_.overlong = OverlongPolicy::kSkip;
  opt_.overwrite = true;
  std::vector<std::string> reports;
  auto k = run(&reports);
  EXPECT_EQ(k.truncated, 0u);
  // Truncation also made some samples too short to supervise; skipping counts those as over-long.
  EXPECT_EQ(k.skipped, s.skipped + s.truncated);
  EXPECT_NE(reports.back().find("over-long sample"), std::string::npos);
  // Too few supervised tokens: a threshold nothing meets.
  opt_.min_loss_tokens = 100000;
  opt_.overlong = OverlongPolicy::kTruncate;
  auto none = run();
  EXPECT_EQ(none.samples, 0u);
  EXPECT_EQ(none.sources[0].skipped.at("too few supervised tokens"), good_.size());
}

TEST_F(PrepareTest, CorruptedOrTruncatedShardsAreDetected) {
  run();
  auto shard = opt_.out_dir / "shard-00000.bin";
  auto bytes = read_file(shard);
  bytes[bytes.size() / 2] ^= 0x40;
  write_file_atomic(shard, bytes);
  try {
    Dataset::open(opt_.out_dir);
    FAIL() << "corruption not detected";
  } catch (const dflash::Error& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(Dataset::open(opt_.out_dir, /*verify=*/false));
  write_file_atomic(shard, bytes.substr(0, bytes.size() - 100));
  try {
    Dataset::open(opt_.out_dir);
    FAIL() << "truncation not detected";
  } catch (const dflash::Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  fs::remove(opt_.out_dir / "manifest.json");
  EXPECT_THROW(Dataset::open(opt_.out_dir), dflash::Error);
}

}  // namespace
}  // namespace dflash::data
