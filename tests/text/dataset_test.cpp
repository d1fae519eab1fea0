// Prepared datasets: `prepare_dataset` over chat JSONL with bad lines, random datasets, the
// memory-mapped reader (samples equal to tokenizing the lines directly; corruption and
// truncation detected) and the seeded resumable sampler.
#include "data/dataset.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "data/prepare.h"
#include "data/random_dataset.h"
#include "text_fixtures.h"

namespace dflash::data {
namespace {

namespace fs = std::filesystem;
using dflash::testing::fresh_temp_dir;
using dflash::testing::load_fixture_json;
using dflash::testing::temp_path;
using dflash::testing::tokenizer_fixtures;

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
    dir_ = fresh_temp_dir("prepare");
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
  EXPECT_EQ(m["tokenizer"]["path"], (opt_.tokenizer_dir / "tokenizer.json").string());
  EXPECT_EQ(m["totals"]["samples"], good_.size());
  uint64_t hist = 0;
  for (auto c : s.length_histogram) hist += c;
  EXPECT_EQ(hist, s.samples);
  EXPECT_FALSE(format_length_histogram(s).empty());
}

TEST_F(PrepareTest, ThinkingOffReachesEverySampleAndTheManifest) {
  opt_.enable_thinking = false;
  auto s = run();
  EXPECT_EQ(s.samples, good_.size());
  Dataset d = Dataset::open(opt_.out_dir);
  EXPECT_EQ(d.manifest()["enable_thinking"], false);
  EXPECT_EQ(d.manifest()["keep_history_reasoning"], false);
  auto tok = tok::Tokenizer::load(opt_.tokenizer_dir);
  auto chat = detect_chat_config(opt_.tokenizer_dir);
  chat.enable_thinking = false;
  size_t differ = 0;
  for (size_t i = 0; i < good_.size(); ++i) {
    TokenizedChat want, on;
    tokenize_chat(tok, render_chat(parse_conversation(good_[i]), chat), want);
    auto got = d[i];
    ASSERT_EQ(std::vector<uint8_t>(got.mask.begin(), got.mask.end()), want.mask) << i;
    tokenize_chat(tok, render_chat(parse_conversation(good_[i]), {chat.format, ""}), on);
    differ += on.mask != want.mask;
  }
  EXPECT_GT(differ, good_.size() / 2);  // the final turn's think block is prompt now
  // A Llama tokenizer has no thinking switch.
  opt_.tokenizer_dir = tokenizer_fixtures() / "llama31";
  opt_.overwrite = true;
  try {
    run();
    ADD_FAILURE() << "prepared";
  } catch (const dflash::Error& e) {
    EXPECT_NE(std::string(e.what()).find("options of the qwen3 chat format, not of llama3.1"),
              std::string::npos)
        << e.what();
  }
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
  // Nothing left to write is refused, naming why every line was skipped.
  try {
    run();
    FAIL() << "prepare wrote a dataset with no sample";
  } catch (const dflash::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no sample to write"), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("{} skipped: too few supervised tokens", good_.size())),
              std::string::npos)
        << what;
  }
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

// Manifests written before the tokenizer's SHA-256 was dropped still open.
TEST_F(PrepareTest, OpensManifestsWithTheOldTokenizerHash) {
  run();
  auto path = opt_.out_dir / "manifest.json";
  auto manifest = nlohmann::json::parse(read_file(path));
  manifest["tokenizer"]["sha256"] = std::string(64, 'a');
  write_file_atomic(path, manifest.dump(2));
  EXPECT_EQ(Dataset::open(opt_.out_dir).size(), good_.size());
}

class RandomDatasetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_path("random");
    opt_.out_dir = dir_ / "a";
    opt_.samples = 40;
    opt_.length = 30;
    opt_.length_jitter = 10;
    opt_.prompt = 7;
    opt_.vocab = 50;
    opt_.seed = 3;
    opt_.shard_tokens = 200;  // several shards
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  RandomDatasetOptions opt_;
};

TEST_F(RandomDatasetTest, WritesPromptThenSupervisedTokensInThePreparedFormat) {
  auto s = write_random_dataset(opt_);
  Dataset d = Dataset::open(opt_.out_dir);
  ASSERT_EQ(d.size(), opt_.samples);
  EXPECT_EQ(d.tokens(), s.tokens);
  EXPECT_GT(s.shards, 1u);
  EXPECT_EQ(d.manifest()["shards"].size(), s.shards);
  std::set<size_t> lengths;
  std::set<int32_t> ids;
  uint64_t loss = 0;
  for (size_t i = 0; i < d.size(); ++i) {
    auto x = d[i];
    lengths.insert(x.ids.size());
    ASSERT_GE(x.ids.size(), 20u);
    ASSERT_LE(x.ids.size(), 40u);
    for (size_t t = 0; t < x.ids.size(); ++t) {
      ASSERT_EQ(x.mask[t], t < opt_.prompt ? 0 : 1) << i << " " << t;
      ASSERT_LT(x.ids[t], 50);
      ASSERT_GE(x.ids[t], 0);
      ids.insert(x.ids[t]);
      loss += x.mask[t];
    }
  }
  EXPECT_EQ(loss, s.loss_tokens);
  EXPECT_GT(lengths.size(), 10u);  // the jitter spreads the lengths
  EXPECT_EQ(ids.size(), 50u);      // every id of a small vocabulary is drawn
}

TEST_F(RandomDatasetTest, TheSeedDecidesTheBytes) {
  write_random_dataset(opt_);
  opt_.out_dir = dir_ / "b";
  write_random_dataset(opt_);
  opt_.out_dir = dir_ / "c";
  opt_.seed = 4;
  write_random_dataset(opt_);
  auto shard = [&](const char* run) { return read_file(dir_ / run / "shard-00000.bin"); };
  EXPECT_EQ(shard("a"), shard("b"));
  EXPECT_NE(shard("a"), shard("c"));
}

TEST_F(RandomDatasetTest, RejectsShapesWithoutSupervisedTokens) {
  opt_.prompt = 20;  // the shortest sample has 20 tokens
  EXPECT_THROW(write_random_dataset(opt_), dflash::Error);
  opt_.prompt = 7;
  opt_.length_jitter = 31;
  EXPECT_THROW(write_random_dataset(opt_), dflash::Error);
  opt_.length_jitter = 0;
  opt_.vocab = 0;
  EXPECT_THROW(write_random_dataset(opt_), dflash::Error);
  opt_.vocab = 50;
  EXPECT_NO_THROW(write_random_dataset(opt_));
  EXPECT_THROW(write_random_dataset(opt_), dflash::Error);  // already there, no overwrite
  opt_.overwrite = true;
  EXPECT_NO_THROW(write_random_dataset(opt_));
}

}  // namespace
}  // namespace dflash::data
