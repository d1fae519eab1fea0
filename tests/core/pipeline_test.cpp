// pipeline::DatasetSource: a micro-batch is a pure function of its position, holds the
// epoch's permuted samples (remainder dropped, epochs roll over to a fresh permutation), cuts
// samples to the maximum length, and its features are exactly the target's taps in the
// drafter's tap order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <set>

#include "common/error.h"
#include "common/file.h"
#include "data/dataset.h"
#include "models/target.h"
#include "pipeline/dataset_source.h"
#include "test_util.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;

constexpr size_t kSamples = 10;

int64_t sample_length(size_t i) { return 6 + static_cast<int64_t>((i * 7) % 13); }

// A prepared dataset of kSamples samples in two shards; sample i's tokens are a function of i,
// its first two tokens are the unsupervised "prompt".
fs::path write_dataset(const std::string& name, int32_t bad_token = -1) {
  auto dir = fs::temp_directory_path() / fmt::format("dflash_pipeline_{}_{}", name, ::getpid());
  remove_tree(dir);
  fs::create_directories(dir);
  nlohmann::json shards = nlohmann::json::array();
  data::ShardWriter writer;
  for (size_t i = 0; i < kSamples; ++i) {
    std::vector<int32_t> ids;
    std::vector<uint8_t> mask;
    for (int64_t j = 0; j < sample_length(i); ++j) {
      ids.push_back(static_cast<int32_t>((i * 31 + j * 17 + 3) % 512));
      mask.push_back(j >= 2 ? 1 : 0);
    }
    if (bad_token >= 0 && i == 3) ids[1] = bad_token;
    writer.add(ids, mask);
    if (i == 3 || i == kSamples - 1) {
      shards.push_back(writer.write(dir / fmt::format("shard-{:05d}.bin", shards.size())));
    }
  }
  nlohmann::json manifest = {
      {"format", "dflash-prepared"}, {"format_version", 1}, {"shards", shards}};
  write_file_atomic(dir / "manifest.json", manifest.dump());
  return dir;
}

class PipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = write_dataset("source");
    dataset_ = std::make_unique<data::Dataset>(data::Dataset::open(dir_));
    target_ = std::make_unique<models::TargetModel>(
        models::TargetModel::random(models::preset_config("tiny"), at::kCPU, at::kFloat, 3));
  }
  void TearDown() override { remove_tree(dir_); }

  pipeline::DatasetSource source(int64_t batch, int64_t max_len = 3072, uint64_t seed = 5) {
    pipeline::DatasetSourceOptions o;
    o.batch_size = batch;
    o.max_seq_len = max_len;
    o.seed = seed;
    return pipeline::DatasetSource(*dataset_, *target_, taps_, o);
  }

  // The taps of one sequence alone, concatenated in `taps_` order.
  at::Tensor direct_taps(const std::vector<int64_t>& tokens) const {
    const int64_t n = static_cast<int64_t>(tokens.size());
    auto batch = models::PackedBatch::from_lengths({n}, at::kCPU);
    auto out =
        target_->forward(at::tensor(tokens, at::kLong), batch, {taps_, models::Logits::kNone});
    return at::cat(out.taps, 1);
  }

  fs::path dir_;
  std::unique_ptr<data::Dataset> dataset_;
  std::unique_ptr<models::TargetModel> target_;
  std::vector<int64_t> taps_ = {5, 1, 3};  // deliberately not sorted
};

TEST_F(PipelineTest, MicroBatchIsAPureFunctionOfPosition) {
  auto a = source(2);
  auto b = source(2);
  // a walks forward, b jumps around and asks for position 4 twice.
  std::vector<train::StepInput> forward;
  for (int64_t p = 0; p < 6; ++p) forward.push_back(a.get(p));
  for (int64_t p : {4, 0, 5, 4, 2, 1, 3}) {
    auto in = b.get(p);
    const auto& want = forward[p];
    EXPECT_EQ(in.tokens, want.tokens) << p;
    EXPECT_EQ(in.loss_masks, want.loss_masks) << p;
    EXPECT_EQ(in.sample_ids, want.sample_ids) << p;
    EXPECT_EQ(in.epoch, want.epoch) << p;
    EXPECT_TRUE(in.features.equal(want.features)) << p;
  }
  // Another seed is another order.
  auto c = source(2, 3072, 6);
  bool differs = false;
  for (int64_t p = 0; p < 5; ++p) differs |= c.select(p).samples != a.select(p).samples;
  EXPECT_TRUE(differs);
}

TEST_F(PipelineTest, SamplesAndFeaturesAreTheTargetsTaps) {
  auto s = source(3);
  auto in = s.get(1);
  ASSERT_EQ(in.tokens.size(), 3u);
  ASSERT_EQ(in.sample_ids.size(), 3u);
  const int64_t h = target_->config().hidden_size;
  ASSERT_EQ(in.features.dim(), 2);
  EXPECT_EQ(in.features.size(1), 3 * h);
  EXPECT_EQ(in.features.scalar_type(), at::kFloat);
  int64_t row = 0;
  for (size_t k = 0; k < in.tokens.size(); ++k) {
    const auto sample = (*dataset_)[static_cast<size_t>(in.sample_ids[k])];
    EXPECT_EQ(in.tokens[k], std::vector<int64_t>(sample.ids.begin(), sample.ids.end()));
    EXPECT_EQ(in.loss_masks[k], std::vector<uint8_t>(sample.mask.begin(), sample.mask.end()));
    const int64_t n = static_cast<int64_t>(in.tokens[k].size());
    auto want = direct_taps(in.tokens[k]);
    auto got = in.features.narrow(0, row, n);
    EXPECT_CLOSE(got, want, 1e-6);
    // Column block i is tap i: layer taps_[i], whatever the layer order.
    auto alone = target_->forward(at::tensor(in.tokens[k], at::kLong),
                                  models::PackedBatch::from_lengths({n}, at::kCPU),
                                  {{taps_[0]}, models::Logits::kNone});
    EXPECT_CLOSE(got.narrow(1, 0, h), alone.taps[0], 1e-6);
    row += n;
  }
  EXPECT_EQ(row, in.features.size(0));
  EXPECT_EQ(s.tokens_served(), row);
}

TEST_F(PipelineTest, LongSamplesAreTruncated) {
  const int64_t max_len = 9;
  auto s = source(kSamples, max_len);
  auto in = s.get(0);
  ASSERT_EQ(in.tokens.size(), kSamples);
  int64_t total = 0, cut = 0;
  for (size_t k = 0; k < in.tokens.size(); ++k) {
    const auto sample = (*dataset_)[static_cast<size_t>(in.sample_ids[k])];
    const size_t n = std::min<size_t>(sample.ids.size(), max_len);
    cut += sample.ids.size() > n;
    EXPECT_EQ(in.tokens[k], std::vector<int64_t>(sample.ids.begin(), sample.ids.begin() + n));
    EXPECT_EQ(in.loss_masks[k], std::vector<uint8_t>(sample.mask.begin(), sample.mask.begin() + n));
    EXPECT_CLOSE(in.features.narrow(0, total, n), direct_taps(in.tokens[k]), 1e-6);
    total += static_cast<int64_t>(n);
  }
  EXPECT_GT(cut, 5);  // most samples were longer
  EXPECT_EQ(in.features.size(0), total);
}

TEST_F(PipelineTest, EpochsRollOverToAFreshPermutation) {
  // 10 samples, 3 per micro-batch: 3 micro-batches per epoch, one sample left out each epoch.
  auto s = source(3);
  EXPECT_EQ(s.batches_per_epoch(), 3);
  data::EpochSampler sampler(kSamples, 5);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const auto perm = sampler.permutation(static_cast<uint64_t>(epoch));
    std::set<int64_t> seen;
    for (int64_t b = 0; b < 3; ++b) {
      auto sel = s.select(epoch * 3 + b);
      EXPECT_EQ(sel.epoch, epoch);
      for (int64_t k = 0; k < 3; ++k) {
        EXPECT_EQ(sel.samples[k], perm[b * 3 + k]) << epoch << " " << b;
        seen.insert(sel.samples[k]);
      }
    }
    EXPECT_EQ(seen.size(), 9u);  // no repeats within an epoch
  }
  EXPECT_NE(s.select(0).samples, s.select(3).samples);
  EXPECT_EQ(s.get(7).epoch, 2);
}

TEST_F(PipelineTest, BadInputsAreErrors) {
  EXPECT_THROW(source(kSamples + 1), Error);  // not one batch
  EXPECT_THROW(source(0), Error);
  pipeline::DatasetSourceOptions o;
  EXPECT_THROW(pipeline::DatasetSource(*dataset_, *target_, {8}, o), Error);  // no layer 8
  auto bad_dir = write_dataset("bad", /*bad_token=*/600);
  auto bad = data::Dataset::open(bad_dir);
  o.batch_size = static_cast<int64_t>(kSamples);
  pipeline::DatasetSource s(bad, *target_, taps_, o);
  try {
    s.get(0);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the target's vocabulary"), std::string::npos)
        << e.what();
  }
  remove_tree(bad_dir);
}

}  // namespace
}  // namespace dflash
