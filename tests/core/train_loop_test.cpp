// The training loop: exact resume (2N straight steps == N steps, a fresh process state loaded
// from the checkpoint, N more steps, bitwise on CPU), checkpoint pruning and the stop signal,
// non-finite loss handling, skipped sequences, gradient accumulation, AdamW and the schedule.
#include <gtest/gtest.h>

#include <csignal>

#include "common/stop_signal.h"
#include "decode_test_util.h"
#include "drafter_test_util.h"
#include "pipeline/features.h"
#include "pipeline/prefetch.h"
#include "pipeline/samples.h"
#include "pipeline/stream.h"
#include "train/blocks.h"
#include "train/export.h"
#include "train/optim.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using testing::DflashCase;

// The real data path over the fixture's tiny target: synthetic samples, the global stream
// (anchors, blocks, the step's normaliser), the batch-forming thread and the target's features.
struct Pipeline {
  Pipeline(const DflashCase& c, int64_t accumulation = 2, bool poison = false, bool overlap = false)
      : samples(12, 30, 4, c.target->config().vocab_size, 3),
        stream(samples, stream_options(accumulation), c.drafter->config()),
        batches(
            "batches", [this](int64_t p) { return stream.form(p, 0, 1, false); }, 2,
            std::chrono::seconds(30)),
        features(*c.target, c.drafter->config().target_layer_ids, batches, overlap),
        poison(poison) {}
  static pipeline::StreamOptions stream_options(int64_t accumulation) {
    pipeline::StreamOptions o;
    o.batch_size = 2;
    o.accumulation = accumulation;
    o.anchors.max_anchors = 6;
    o.anchors.seed = 17;
    return o;
  }
  pipeline::SyntheticSamples samples;
  pipeline::GlobalStream stream;
  pipeline::Prefetcher batches;
  pipeline::ColocatedSource features;
  bool poison;
};

class Source : public train::BatchSource {
 public:
  explicit Source(Pipeline& p) : p_(p) {}
  train::MicroBatch get(int64_t position) override {
    auto mb = p_.features.get(position);
    if (p_.poison) mb.features[0][0] = std::nan("");
    return mb;
  }

 private:
  Pipeline& p_;
};

// The fixture's own sequences as one micro-batch (its 4th has too few supervised tokens).
class FixtureBatch : public train::BatchSource {
 public:
  explicit FixtureBatch(const DflashCase& c) {
    std::vector<std::vector<int32_t>> ids;
    for (const auto& t : c.input.tokens) ids.emplace_back(t.begin(), t.end());
    std::vector<train::SampleView> views;
    for (size_t s = 0; s < ids.size(); ++s) {
      views.push_back({static_cast<int64_t>(s), ids[s], c.input.loss_masks[s]});
    }
    train::AnchorOptions a;
    a.max_anchors = 6;
    mb_ = train::form_micro_batch(0, 0, views, 3072, a, c.drafter->config(), false).to(at::kCPU);
    mb_.step_weight_sum = mb_.blocks.weight_sum;
    mb_.features =
        testing::taps(*c.target, mb_.tokens, mb_.lengths, c.drafter->config().target_layer_ids);
  }
  train::MicroBatch get(int64_t) override { return mb_; }

 private:
  train::MicroBatch mb_;
};

train::TrainerOptions options(const fs::path& dir) {
  train::TrainerOptions o;
  o.lr = 1e-3;
  o.total_steps = 8;
  o.warmup_ratio = 0.25;
  o.accumulation = 2;
  o.seed = 17;
  o.adamw.weight_decay = 0.01;
  o.checkpoint_dir = dir;
  o.checkpoint_every = 2;
  o.keep_last = 2;
  return o;
}

// fp32 with accumulation (gradients summed on the fp32 masters), and bf16 with one backward per
// step (gradients left on the bf16 compute copies, which a resume must cast again from the
// loaded masters).
struct ResumeCase {
  std::string name;
  at::ScalarType dtype;
  int64_t accumulation;
};

void PrintTo(const ResumeCase& c, std::ostream* os) { *os << c.name; }

class TrainLoopResume : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(TrainLoopResume, FromCheckpointIsBitwiseExact) {
  const ResumeCase c = GetParam();
  const int64_t n = 2;
  auto dir_a = testing::temp_path("resume_a"), dir_b = testing::temp_path("resume_b");
  auto run_options = [&](const fs::path& dir) {
    auto o = options(dir);
    o.accumulation = c.accumulation;
    o.step.dtype = c.dtype;
    return o;
  };
  DflashCase straight("tied");
  Pipeline pipe_a(straight, c.accumulation);
  Source data_a(pipe_a);
  train::Trainer a(*straight.drafter, models::TargetHead::of(*straight.target), run_options(dir_a),
                   data_a);
  std::vector<double> losses_a;
  a.run(2 * n, [&](const train::StepLog& l) { losses_a.push_back(l.loss); });

  std::vector<double> losses_b;
  {
    DflashCase first("tied");
    Pipeline pipe(first, c.accumulation);
    Source data(pipe);
    train::Trainer b(*first.drafter, models::TargetHead::of(*first.target), run_options(dir_b),
                     data);
    b.run(n, [&](const train::StepLog& l) { losses_b.push_back(l.loss); });
  }  // everything of the first run is gone, as after kill -9
  DflashCase resumed("tied");
  // Different fresh weights before loading, so nothing carries over by accident.
  for (auto p : resumed.drafter->parameters()) p.detach().add_(0.5);
  Pipeline pipe_r(resumed, c.accumulation);
  Source data_r(pipe_r);
  train::Trainer r(*resumed.drafter, models::TargetHead::of(*resumed.target), run_options(dir_b),
                   data_r);
  r.load_checkpoint(dir_b);
  EXPECT_EQ(r.steps_done(), n);
  EXPECT_EQ(r.data_position(), c.accumulation * n);
  r.run(2 * n, [&](const train::StepLog& l) { losses_b.push_back(l.loss); });

  EXPECT_EQ(losses_a, losses_b);
  const auto& pa = straight.drafter->named_parameters();
  const auto& pr = resumed.drafter->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(pa[i].second.equal(pr[i].second)) << pa[i].first;
  }
  // keep_last = 2 of the checkpoints at steps 2 and 4.
  std::vector<std::string> kept;
  for (const auto& e : fs::directory_iterator(dir_a)) kept.push_back(e.path().filename());
  std::sort(kept.begin(), kept.end());
  EXPECT_EQ(kept, (std::vector<std::string>{"step-00000002", "step-00000004"}));
  // The final checkpoints of both runs hold identical optimizer state.
  auto sa = io::SafetensorsFile::open(dir_a / "step-00000004" / "state.safetensors");
  auto sb = io::SafetensorsFile::open(dir_b / "step-00000004" / "state.safetensors");
  for (const auto& t : sa->tensors()) {
    EXPECT_TRUE(sa->tensor(t.name).equal(sb->tensor(t.name))) << t.name;
  }
  // `dflash export` of a run directory takes its newest checkpoint.
  auto out = testing::temp_path("resume_export");
  train::export_drafter(dir_a, out);
  auto exported = models::Drafter::load(out, straight.target->config(), at::kCPU);
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(exported.named_parameters()[i].second.equal(
        pa[i].second.detach().to(at::kBFloat16).to(at::kFloat)));
  }
  remove_tree(dir_a);
  remove_tree(dir_b);
  remove_tree(out);
}

const auto kRoutes = ::testing::Values(ResumeCase{"fp32_accumulation_2", at::kFloat, 2},
                                       ResumeCase{"bf16_gradients_on_copies", at::kBFloat16, 1});
INSTANTIATE_TEST_SUITE_P(Routes, TrainLoopResume, kRoutes,
                         [](const auto& info) { return info.param.name; });

TEST(TrainLoop, CheckpointFromAnotherConfigIsRejected) {
  auto dir = testing::temp_path("other_config");
  {
    DflashCase c("tied");
    Pipeline pipe(c);
    Source data(pipe);
    train::Trainer t(*c.drafter, models::TargetHead::of(*c.target), options(dir), data);
    t.run(1);
  }
  DflashCase other("untied");
  Pipeline pipe(other);
  Source data(pipe);
  train::Trainer t(*other.drafter, models::TargetHead::of(*other.target), options(dir), data);
  try {
    t.load_checkpoint(dir);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("another drafter config"), std::string::npos) << e.what();
  }
  remove_tree(dir);
}

// --drafter-gemms fp8 with drafter widths the FP8 GEMM cannot reduce over (an intermediate size
// of 40) fails when the trainer is made, naming them, not in the middle of a step. (A GPU
// older than Hopper or a compute dtype other than bf16 is refused the same way:
// HeadGrad.AutoResolvesToWhereTheFp8GemmRuns checks that shared rule.)
TEST(TrainLoop, Fp8GemmsNeedWidthsThatAreMultiplesOf16) {
  models::ModelConfig config = testing::tiny_target_config(models::Architecture::kQwen3);
  config.intermediate_size = 40;
  auto target = models::TargetModel::random(config, at::kCPU, at::kFloat, 1);
  models::DrafterOptions dopt;
  dopt.num_layers = 1;
  dopt.target_layer_ids = {1};
  dopt.mask_token_id = config.vocab_size - 1;
  auto drafter = models::Drafter::random(models::make_drafter_config(config, dopt), at::kCPU, 2);
  struct NoData : train::BatchSource {
    train::MicroBatch get(int64_t) override { return {}; }
  } data;
  const auto dir = testing::temp_path("fp8_widths");
  auto o = options(dir);
  train::Trainer t(drafter, models::TargetHead::of(target), o, data);  // compute: fine
  t.set_drafter_gemms(train::DrafterGemms::kAuto);  // auto: compute where fp8 cannot run
  EXPECT_EQ(t.drafter_gemms(), train::DrafterGemms::kCompute);
  try {
    t.set_drafter_gemms(train::DrafterGemms::kFp8);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8 drafter GEMMs cannot run: the drafter's widths must "
                                         "be multiples of 16 (the FP8 GEMM reduces over them): "
                                         "hidden 32, q 32, k/v 16, intermediate 40"),
              std::string::npos)
        << e.what();
  }
  o.step.drafter_gemms = train::DrafterGemms::kFp8;
  EXPECT_THROW(train::Trainer(drafter, models::TargetHead::of(target), o, data), Error);
  remove_tree(dir);
}

// --drafter-gemms auto is fp8 only where the FP8 GEMM runs (a Hopper GPU, bf16, widths that are
// multiples of 16) and compute elsewhere, the CPU included (its fp8 path is the dequantizing
// reference: asked for, it runs; never chosen for you).
TEST(DrafterGemms, AutoResolvesToWhereTheFp8GemmsRun) {
  using train::DrafterGemms;
  models::ModelConfig config = testing::tiny_target_config(models::Architecture::kQwen3);
  config.intermediate_size = 64;
  models::DrafterOptions dopt;
  dopt.num_layers = 1;
  dopt.target_layer_ids = {1};
  dopt.mask_token_id = config.vocab_size - 1;
  const auto dc = models::make_drafter_config(config, dopt);
  auto resolve = [&](DrafterGemms g, at::Device d, at::ScalarType t) {
    return train::resolve_drafter_gemms(g, dc, d, t);
  };
  EXPECT_EQ(resolve(DrafterGemms::kAuto, at::kCPU, at::kBFloat16), DrafterGemms::kCompute);
  EXPECT_EQ(resolve(DrafterGemms::kFp8, at::kCPU, at::kFloat), DrafterGemms::kFp8);
  EXPECT_EQ(resolve(DrafterGemms::kCompute, at::kCPU, at::kFloat), DrafterGemms::kCompute);
  EXPECT_EQ(train::parse_drafter_gemms("auto", "x"), DrafterGemms::kAuto);
  EXPECT_STREQ(train::drafter_gemms_name(DrafterGemms::kFp8), "fp8");
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the GPU's resolution not checked";
  const at::Device gpu(at::kCUDA, 0);
  EXPECT_EQ(resolve(DrafterGemms::kAuto, gpu, at::kFloat), DrafterGemms::kCompute);
  EXPECT_THROW(resolve(DrafterGemms::kFp8, gpu, at::kFloat), Error);
  EXPECT_EQ(resolve(DrafterGemms::kAuto, gpu, at::kBFloat16),
            kernels::fp8_gemm_supported(gpu) ? DrafterGemms::kFp8 : DrafterGemms::kCompute);
}

TEST(TrainLoop, StopSignalCheckpointsAndReturns) {
  auto dir = testing::temp_path("signal");
  DflashCase c("tied");
  Pipeline pipe(c);
  Source data(pipe);
  auto o = options(dir);
  o.checkpoint_every = 0;
  train::Trainer t(*c.drafter, models::TargetHead::of(*c.target), o, data);
  install_stop_signals();
  clear_stop_request();
  const int64_t done = t.run(8, [](const train::StepLog& l) {
    if (l.step == 1) std::raise(SIGTERM);
  });
  clear_stop_request();
  // Step 1's figures are read once step 2 is queued, so the signal votes in step 3; the loop
  // reads that vote after queueing step 4 and stops there, as every trainer rank does (they
  // all read the same reduced vote at the same step).
  EXPECT_EQ(done, 4);
  EXPECT_TRUE(fs::exists(dir / "step-00000004" / "trainer.json"));
  remove_tree(dir);
}

TEST(TrainLoop, NonFiniteLossIsSkippedOnTheDeviceCountedAndStopsTheRun) {
  DflashCase c("tied");
  Pipeline pipe(c, 2, /*poison=*/true);
  Source data(pipe);
  auto o = options({});
  o.max_nonfinite_in_a_row = 3;
  auto before = c.drafter->named_parameters()[0].second.clone();
  train::Trainer t(*c.drafter, models::TargetHead::of(*c.target), o, data);
  t.train_step();
  auto logs = t.take_logs(true);
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_TRUE(logs[0].skipped_nonfinite);
  EXPECT_EQ(t.state().nonfinite_total, 1);
  EXPECT_EQ(t.steps_done(), 1);  // the step is taken (its data consumed), the update skipped
  EXPECT_TRUE(c.drafter->named_parameters()[0].second.equal(before));
  try {
    t.run(8);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 steps in a row"), std::string::npos) << e.what();
  }
}

TEST(TrainLoop, TooFewSupervisedSequencesAreSkippedAndCounted) {
  DflashCase c("tied");
  FixtureBatch data(c);
  auto o = options({});
  o.accumulation = 1;
  train::Trainer t(*c.drafter, models::TargetHead::of(*c.target), o, data);
  t.train_step();
  auto l = t.take_logs(true).at(0);
  EXPECT_EQ(l.skipped_sequences, 1);
  EXPECT_EQ(t.state().skipped_sequences_total, 1);
  EXPECT_GT(l.blocks, 0);
  ASSERT_EQ(l.accuracy.size(), 7u);
}

TEST(TrainLoop, SimulatedAcceptanceByHand) {
  // 1 + a1 + a1 a2 + a1 a2 a3 + ...
  EXPECT_DOUBLE_EQ(train::simulated_acceptance({}), 1.0);
  EXPECT_DOUBLE_EQ(train::simulated_acceptance({0.0, 1.0, 1.0}), 1.0);
  EXPECT_DOUBLE_EQ(train::simulated_acceptance({1.0, 1.0, 1.0}), 4.0);
  EXPECT_DOUBLE_EQ(train::simulated_acceptance({0.5, 0.5}), 1.75);
  EXPECT_DOUBLE_EQ(train::simulated_acceptance({0.5, 1.0, 0.0, 1.0}), 2.0);
}

// The target forward on its own stream (ColocatedSource's overlap) computes the same features
// and so trains the same drafter as one stream: losses and weights bitwise, on the GPU, in fp32
// with accumulation and in bf16 with the gradients on the compute copies.
class TrainLoopOverlapGpu : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(TrainLoopOverlapGpu, TargetOnItsOwnStreamIsBitwiseOneStream) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const ResumeCase c = GetParam();
  auto run = [&](bool overlap, std::vector<double>& losses) {
    auto dc = std::make_unique<DflashCase>("tied", at::Device(at::kCUDA));
    Pipeline pipe(*dc, c.accumulation, /*poison=*/false, overlap);
    EXPECT_EQ(pipe.features.overlapping(), overlap);
    Source data(pipe);
    auto o = options({});
    o.accumulation = c.accumulation;
    o.step.dtype = c.dtype;
    train::Trainer t(*dc->drafter, models::TargetHead::of(*dc->target), o, data);
    t.run(6, [&](const train::StepLog& l) { losses.push_back(l.loss); });
    return dc;
  };
  std::vector<double> one, two;
  auto a = run(false, one);
  auto b = run(true, two);
  ASSERT_EQ(one.size(), 6u);
  EXPECT_EQ(one, two);
  const auto& pa = a->drafter->named_parameters();
  const auto& pb = b->drafter->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(pa[i].second.equal(pb[i].second)) << pa[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Routes, TrainLoopOverlapGpu, kRoutes,
                         [](const auto& info) { return info.param.name; });

TEST(TrainLoop, AccumulationEqualsOneBigBatch) {
  DflashCase c("tied");
  auto head = models::TargetHead::of(*c.target);
  train::StepOptions so;
  // One micro-batch with all sequences, normalised by its weight sum...
  auto full = train::forward_backward(*c.drafter, head, c.input, c.anchors, 1.0, so);
  std::vector<at::Tensor> big;
  for (auto& p : c.drafter->parameters()) big.push_back(p.grad().clone() / full.weight_sum);
  c.zero_grads();
  // ...equals two micro-batches normalised by the same total.
  auto split = [&](size_t from, size_t to) {
    train::StepInput in;
    int64_t row = 0, rows = 0;
    for (size_t s = 0; s < c.input.tokens.size(); ++s) {
      const int64_t n = static_cast<int64_t>(c.input.tokens[s].size());
      if (s < from) row += n;
      if (s >= from && s < to) {
        in.tokens.push_back(c.input.tokens[s]);
        in.loss_masks.push_back(c.input.loss_masks[s]);
        rows += n;
      }
    }
    in.features = c.input.features.narrow(0, row, rows);
    std::vector<std::vector<int64_t>> anchors(c.anchors.begin() + from, c.anchors.begin() + to);
    return train::forward_backward(*c.drafter, head, in, anchors, 1.0 / full.weight_sum, so);
  };
  auto r1 = split(0, 2);
  auto r2 = split(2, 4);
  EXPECT_DOUBLE_EQ(r1.weight_sum + r2.weight_sum, full.weight_sum);
  auto params = c.drafter->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_CLOSE(params[i].grad(), big[i], 1e-5);
}

TEST(TrainLoop, TrainingReducesTheLoss) {
  DflashCase c("tied");
  FixtureBatch data(c);
  auto o = options({});
  o.accumulation = 1;
  o.total_steps = 40;
  o.lr = 5e-3;
  train::Trainer t(*c.drafter, models::TargetHead::of(*c.target), o, data);
  double first = 0, last = 0;
  t.run(40, [&](const train::StepLog& l) {
    if (l.step == 1) first = l.loss;
    last = l.loss;
  });
  // Random tokens: only memorising this one batch can lower the loss (from ~log V).
  EXPECT_LT(last, 0.8 * first) << first << " -> " << last;
}

TEST(Optim, AdamWMatchesTheFormula) {
  auto p = at::tensor({1.0f, -2.0f});
  p.requires_grad_(true);
  train::AdamWOptions o;
  o.weight_decay = 0.1;
  train::AdamW adam({p}, o);
  p.mutable_grad() = at::tensor({0.5f, 0.25f});
  adam.step(0.01);
  // Step 1: m = 0.1 g, v = 0.001 g^2, m_hat = g, v_hat = g^2: update = lr * g/(|g| + eps).
  for (int i = 0; i < 2; ++i) {
    const double x = i == 0 ? 1.0 : -2.0, g = i == 0 ? 0.5 : 0.25;
    const double expected = x * (1 - 0.01 * 0.1) - 0.01 * g / (std::abs(g) + 1e-8);
    EXPECT_NEAR(p[i].item<double>(), expected, 1e-6);
  }
}

TEST(Optim, ClipAndSchedule) {
  auto p = at::zeros({2});
  p.requires_grad_(true);
  p.mutable_grad() = at::tensor({3.0f, 4.0f});
  auto norm = train::grad_norm({p.grad()});
  EXPECT_NEAR(norm.item<double>(), 5.0, 1e-6);
  train::AdamW adam({p}, {});
  adam.step(0.01, train::clip_divisor(norm, 1.0));
  // The first moment holds (1 - beta1) times the clipped gradient, of norm 1.
  EXPECT_NEAR(adam.exp_avg()[0].norm().item<double>(), 0.1, 1e-6);
  EXPECT_NEAR(train::clip_divisor(at::tensor(0.5), 1.0).item<double>(), 1.0, 0);
  EXPECT_DOUBLE_EQ(train::cosine_lr(0, 100, 4, 1.0, 0.0), 0.25);
  EXPECT_DOUBLE_EQ(train::cosine_lr(3, 100, 4, 1.0, 0.0), 1.0);
  EXPECT_NEAR(train::cosine_lr(52, 100, 4, 1.0, 0.0), 0.5, 1e-12);
  EXPECT_NEAR(train::cosine_lr(100, 100, 4, 1.0, 0.1), 0.1, 1e-12);
}

}  // namespace
}  // namespace dflash
