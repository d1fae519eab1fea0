// pipeline: a micro-batch is a pure function of its position, holds the epoch's permuted
// samples (remainder dropped, epochs roll over to a fresh permutation), cuts samples to the
// maximum length, splits into rank shares that carry the whole step's normaliser, and its
// features are exactly the target's taps in the drafter's tap order.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <set>
#include <thread>

#include "common/error.h"
#include "common/file.h"
#include "data/dataset.h"
#include "drafter_test_util.h"
#include "models/target.h"
#include "pipeline/features.h"
#include "pipeline/prefetch.h"
#include "pipeline/samples.h"
#include "pipeline/stream.h"
#include "test_util.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;

constexpr size_t kSamples = 10;

int64_t sample_length(size_t i) { return 6 + static_cast<int64_t>((i * 7) % 13); }

// A prepared dataset of kSamples samples in two shards; sample i's tokens are a function of i,
// its first two tokens are the unsupervised "prompt".
fs::path write_dataset(const std::string& name, int32_t bad_token = -1) {
  auto dir = testing::fresh_temp_dir("pipeline_" + name);
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
    samples_ = std::make_unique<pipeline::DatasetSamples>(*dataset_);
    target_ = std::make_unique<models::TargetModel>(
        models::TargetModel::random(models::preset_config("tiny"), at::kCPU, at::kFloat, 3));
    models::DrafterOptions o;
    o.num_layers = 3;
    o.target_layer_ids = taps_;
    o.mask_token_id = 511;
    config_ = models::make_drafter_config(target_->config(), o);
  }
  void TearDown() override { remove_tree(dir_); }

  pipeline::GlobalStream stream(int64_t batch, int64_t max_len = 3072, uint64_t seed = 5,
                                int64_t accumulation = 1) {
    pipeline::StreamOptions o;
    o.batch_size = batch;
    o.max_seq_len = max_len;
    o.accumulation = accumulation;
    o.anchors.max_anchors = 4;
    o.anchors.seed = seed;
    return pipeline::GlobalStream(*samples_, o, config_);
  }

  // The taps of one sequence alone, concatenated in `taps_` order.
  at::Tensor direct_taps(const at::Tensor& tokens) const {
    auto batch = models::PackedBatch::from_lengths({tokens.numel()}, at::kCPU);
    auto out = target_->forward(tokens, batch, {taps_, models::Logits::kNone});
    return at::cat(out.taps, 1);
  }

  fs::path dir_;
  std::unique_ptr<data::Dataset> dataset_;
  std::unique_ptr<pipeline::DatasetSamples> samples_;
  std::unique_ptr<models::TargetModel> target_;
  std::vector<int64_t> taps_ = {5, 1, 3};  // deliberately not sorted
  models::DrafterConfig config_;
};

TEST_F(PipelineTest, MicroBatchIsAPureFunctionOfPosition) {
  auto a = stream(2);
  auto b = stream(2);
  // a walks forward, b jumps around and asks for position 4 twice.
  std::vector<train::MicroBatch> forward;
  for (int64_t p = 0; p < 6; ++p) forward.push_back(a.form(p, 0, 1, false));
  for (int64_t p : {4, 0, 5, 4, 2, 1, 3}) {
    auto mb = b.form(p, 0, 1, false);
    const auto& want = forward[p];
    EXPECT_TRUE(mb.tokens.equal(want.tokens)) << p;
    EXPECT_EQ(mb.lengths, want.lengths) << p;
    EXPECT_EQ(mb.sample_ids, want.sample_ids) << p;
    EXPECT_EQ(mb.epoch, want.epoch) << p;
    EXPECT_EQ(mb.blocks.layout.anchor, want.blocks.layout.anchor) << p;
    EXPECT_TRUE(mb.blocks.labels.equal(want.blocks.labels)) << p;
  }
  // Another seed is another order.
  auto c = stream(2, 3072, 6);
  bool differs = false;
  for (int64_t p = 0; p < 5; ++p) differs |= c.select(p).samples != a.select(p).samples;
  EXPECT_TRUE(differs);
}

TEST_F(PipelineTest, FeaturesAreTheTargetsTapsInTheDraftersOrder) {
  auto s = stream(3);
  pipeline::Prefetcher batches(
      "batches", [&](int64_t p) { return s.form(p, 0, 1, false); }, 2, std::chrono::seconds(30));
  pipeline::ColocatedSource source(*target_, taps_, batches);
  // Out of order on purpose: the prefetcher restarts where it is asked.
  for (int64_t position : {1, 2, 0}) {
    auto mb = source.get(position);
    ASSERT_EQ(mb.position, position);
    ASSERT_EQ(mb.sample_ids.size(), 3u);
    const int64_t h = target_->config().hidden_size;
    ASSERT_EQ(mb.features.size(1), 3 * h);
    int64_t row = 0;
    for (size_t k = 0; k < mb.sample_ids.size(); ++k) {
      const auto sample = (*dataset_)[static_cast<size_t>(mb.sample_ids[k])];
      const int64_t n = mb.lengths[k];
      ASSERT_EQ(n, static_cast<int64_t>(sample.ids.size()));
      auto tokens = mb.tokens.narrow(0, row, n);
      EXPECT_EQ(testing::to_vector<int64_t>(tokens),
                std::vector<int64_t>(sample.ids.begin(), sample.ids.end()));
      auto got = mb.features.narrow(0, row, n);
      EXPECT_CLOSE(got, direct_taps(tokens), 1e-6);
      // Column block i is tap i: layer taps_[i], whatever the layer order.
      auto alone = target_->forward(tokens, models::PackedBatch::from_lengths({n}, at::kCPU),
                                    {{taps_[0]}, models::Logits::kNone});
      EXPECT_CLOSE(got.narrow(1, 0, h), alone.taps[0], 1e-6);
      row += n;
    }
    EXPECT_EQ(row, mb.features.size(0));
  }
}

TEST_F(PipelineTest, LongSamplesAreTruncated) {
  const int64_t max_len = 9;
  auto s = stream(kSamples, max_len);
  auto mb = s.form(0, 0, 1, false);
  ASSERT_EQ(mb.sample_ids.size(), kSamples);
  int64_t row = 0, cut = 0;
  for (size_t k = 0; k < kSamples; ++k) {
    const auto sample = (*dataset_)[static_cast<size_t>(mb.sample_ids[k])];
    const size_t n = std::min<size_t>(sample.ids.size(), max_len);
    cut += sample.ids.size() > n;
    ASSERT_EQ(mb.lengths[k], static_cast<int64_t>(n));
    EXPECT_EQ(testing::to_vector<int64_t>(mb.tokens.narrow(0, row, mb.lengths[k])),
              std::vector<int64_t>(sample.ids.begin(), sample.ids.begin() + n));
    row += mb.lengths[k];
  }
  EXPECT_GT(cut, 5);  // most samples were longer
  for (int64_t a : mb.blocks.layout.anchor) EXPECT_LT(a, max_len - 1);
}

TEST_F(PipelineTest, EpochsRollOverToAFreshPermutation) {
  // 10 samples, 3 per micro-batch: 3 micro-batches per epoch, one sample left out each epoch.
  auto s = stream(3);
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
  EXPECT_EQ(s.form(7, 0, 1, false).epoch, 2);
}

// N data ranks split each micro-batch into contiguous shares that together are the 1-rank
// micro-batch, and all carry the normaliser of the whole step: the label weights of every
// share of every micro-batch of the step.
TEST_F(PipelineTest, RankSharesPartitionTheGlobalBatch) {
  const int64_t batch = 5, accumulation = 2;
  auto s = stream(batch, 3072, 5, accumulation);
  for (int64_t step = 0; step < 2; ++step) {
    double by_hand = 0;
    for (int64_t m = 0; m < accumulation; ++m) {
      const int64_t p = step * accumulation + m;
      const auto whole = s.form(p, 0, 1, false);
      by_hand += whole.blocks.weight_sum;
      for (int ranks : {2, 3, 5}) {
        std::vector<int64_t> ids;
        int64_t tokens = 0;
        double shares = 0;
        for (int r = 0; r < ranks; ++r) {
          const auto mb = s.form(p, r, ranks, false);
          EXPECT_EQ(mb.sample_ids.size(),
                    static_cast<size_t>((r + 1) * batch / ranks - r * batch / ranks));
          ids.insert(ids.end(), mb.sample_ids.begin(), mb.sample_ids.end());
          tokens += mb.num_tokens();
          shares += mb.blocks.weight_sum;
          EXPECT_EQ(mb.step_weight_sum, whole.step_weight_sum) << ranks;
          EXPECT_EQ(mb.global_tokens, whole.global_tokens);
        }
        EXPECT_EQ(ids, whole.sample_ids) << ranks;
        EXPECT_EQ(tokens, whole.num_tokens());
        EXPECT_NEAR(shares, whole.blocks.weight_sum, 1e-9);
      }
    }
    EXPECT_NEAR(s.form(step * accumulation, 0, 1, false).step_weight_sum, by_hand, 1e-9);
    EXPECT_GT(by_hand, 0);
  }
}

// A slow consumer holds the batch-forming thread back: it never runs more than the queue's
// depth (plus the one it is forming) ahead, whatever the speed difference.
TEST_F(PipelineTest, SlowConsumerKeepsTheFormerBounded) {
  auto s = stream(2);
  std::atomic<int64_t> formed{0};
  const size_t depth = 2;
  pipeline::Prefetcher batches(
      "batches",
      [&](int64_t p) {
        ++formed;
        return s.form(p, 0, 1, false);
      },
      depth, std::chrono::seconds(30));
  int64_t most_ahead = 0;
  for (int64_t p = 0; p < 12; ++p) {
    auto mb = batches.get(p);
    EXPECT_EQ(mb.position, p);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the slow trainer
    most_ahead = std::max(most_ahead, formed.load() - (p + 1));
  }
  EXPECT_LE(most_ahead, static_cast<int64_t>(depth) + 1);
  EXPECT_GE(most_ahead, static_cast<int64_t>(depth));  // it did run ahead while we slept
}

TEST_F(PipelineTest, BadInputsAreErrors) {
  EXPECT_THROW(stream(kSamples + 1), Error);  // not one batch
  EXPECT_THROW(stream(0), Error);
  auto s = stream(2);
  EXPECT_THROW(s.form(0, 2, 2, false), Error);  // no rank 2 of 2
  auto bad_dir = write_dataset("bad", /*bad_token=*/600);
  auto bad = data::Dataset::open(bad_dir);
  pipeline::DatasetSamples bad_samples(bad);
  pipeline::StreamOptions o;
  o.batch_size = static_cast<int64_t>(kSamples);
  pipeline::GlobalStream bad_stream(bad_samples, o, config_);
  try {
    (void)bad_stream.form(0, 0, 1, false);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the target's vocabulary"), std::string::npos)
        << e.what();
  }
  // A failure on the batch-forming thread reaches the consumer with its message.
  pipeline::Prefetcher batches(
      "batches", [&](int64_t p) { return bad_stream.form(p, 0, 1, false); }, 2,
      std::chrono::seconds(30));
  try {
    (void)batches.get(0);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the target's vocabulary"), std::string::npos)
        << e.what();
  }
  remove_tree(bad_dir);
}

}  // namespace
}  // namespace dflash
