#include "pipeline/run.h"

#include <c10/core/GradMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "common/crc32c.h"
#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "common/progress_text.h"
#include "common/stop_signal.h"
#include "dist/comm.h"
#include "dist/world.h"
#include "eval/evaluate.h"
#include "eval/regenerate.h"
#include "models/drafter.h"
#include "models/target.h"
#include "models/target_head.h"
#include "obs/report.h"
#include "obs/stages.h"
#include "obs/stats.h"
#include "obs/tensorboard.h"
#include "pipeline/features.h"
#include "pipeline/prefetch.h"
#include "pipeline/samples.h"
#include "pipeline/stream.h"
#include "train/checkpoint.h"
#include "train/export.h"
#include "train/trainer.h"

namespace dflash::pipeline {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr int64_t kQwen3MaskToken = 151669;
// The bf16 matmul rate measured on the H200 here (BRIEF): MFU's denominator.
constexpr double kH200BF16 = 792e12;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// The wall-clock time, for records a person reads.
std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

double peak_rss_gib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / (1024.0 * 1024.0);  // ru_maxrss is in KiB
}

// The options that define the data stream and the schedule: a resumed run must use the same.
json stream_options(const RunConfig& c, int64_t steps) {
  return {{"steps", steps},
          {"batch_size", c.batch_size},
          {"accumulation", c.accumulation},
          {"lr", c.lr},
          {"min_lr", c.min_lr},
          {"warmup_ratio", c.warmup_ratio},
          {"weight_decay", c.weight_decay},
          {"clip_norm", c.clip_norm},
          {"max_anchors", c.max_anchors},
          {"max_seq_len", c.max_seq_len},
          {"seed", c.seed}};
}

// Keeps the metrics lines of steps up to `last_step` (those the checkpoint we continue from
// has seen) and drops the rest, including a line cut short by a kill. Returns the elapsed
// seconds recorded in the last line kept.
double truncate_metrics(const fs::path& path, int64_t last_step) {
  if (!fs::exists(path)) return 0;
  std::istringstream in(read_file(path));
  std::string line, kept;
  double elapsed = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;
    if (j["step"].get<int64_t>() > last_step) continue;
    kept += line + "\n";
    if (j.contains("elapsed_s") && j["elapsed_s"].is_number()) {
      elapsed = j["elapsed_s"].get<double>();
    }
  }
  write_file_atomic(path, kept);
  return elapsed;
}

// This process's place in the job.
struct Rank {
  dist::World world;
  Topology topology;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;
  std::unique_ptr<dist::Comm> comm;      // every rank
  std::unique_ptr<dist::Comm> trainers;  // disaggregated: the trainer ranks' group
  bool trains() const { return world.rank < topology.trainers; }
  bool leads() const { return world.rank == 0; }
  dist::Comm& data_parallel() const { return trainers ? *trainers : *comm; }
};

Rank join(const RunConfig& c) {
  Rank r;
  r.world = dist::world_from_env();
  r.device = dist::device_for(r.world, c.device);
  r.dtype = models::parse_dtype(c.dtype, r.device);
  if (c.topology == "colocated") {
    r.topology = {r.world.world_size, 0};
  } else if (c.topology == "disaggregated") {
    if (c.target_ranks < 1 || c.target_ranks >= r.world.world_size) {
      fail("--topology disaggregated needs 1 <= --target-ranks < world size ({}), got {}",
           r.world.world_size, c.target_ranks);
    }
    r.topology = {r.world.world_size - static_cast<int>(c.target_ranks),
                  static_cast<int>(c.target_ranks)};
  } else {
    fail("--topology must be colocated or disaggregated, got \"{}\"", c.topology);
  }
  if (c.batch_size < r.topology.trainers) {
    fail(
        "--batch-size {} gives some of the {} trainer ranks no sequence (it counts sequences "
        "per micro-batch over all ranks)",
        c.batch_size, r.topology.trainers);
  }
  dist::CommOptions co;
  co.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_s * 1000));
  r.comm = dist::Comm::create(r.world, r.device, co);
  if (r.topology.disaggregated() && r.trains()) {
    std::vector<int> ranks;
    for (int i = 0; i < r.topology.trainers; ++i) ranks.push_back(i);
    r.trainers = r.comm->subgroup(ranks, "trainers");
  }
  return r;
}

// Where this process starts: which start of the run directory it is (obs/report.h: 1, 2, ...
// in job.json's "starts") and the step of the checkpoint it resumes from (-1: none). Rank 0
// decides once its checks have passed; every rank waits here for it, so a refused resume makes
// no rank write anything.
struct Start {
  int64_t index = 1;
  int64_t resume_step = -1;
};

Start agree_on_run_start(const Rank& r, const fs::path& run_dir, int64_t resume_step) {
  const int64_t index = r.leads() && !run_dir.empty() ? obs::next_start(run_dir / "obs") : 1;
  std::vector<at::Tensor> v{at::tensor(std::vector<int64_t>{index, resume_step}).to(r.device)};
  r.comm->broadcast(v, 0, "run_start");
  const auto agreed = v[0].cpu();
  return {agreed[0].item<int64_t>(), agreed[1].item<int64_t>()};
}

// Starts this rank's instrumentation; files go to RUN_DIR/obs (none without a run directory).
// The figures describe this process's session: each start appends a start record to the rank's
// file (rank 0 also to job.json) and its snapshots after it, so the figures of earlier starts
// stay. `record`: what else the start record says (a data change).
void start_obs(const RunConfig& c, const Rank& r, const fs::path& run_dir, int64_t warmup_steps,
               int64_t steps, const Start& start, json record = json::object()) {
  obs::ObsOptions o;
  o.enabled = c.obs;
  o.rank = r.world.rank;
  o.snapshot_seconds = c.obs_seconds;
  o.warmup_steps = warmup_steps;
  if (!c.trace_steps.empty()) {
    long first = 0, last = 0;
    char tail = 0;
    if (std::sscanf(c.trace_steps.c_str(), "%ld:%ld%c", &first, &last, &tail) != 2 || first < 1 ||
        last < first) {
      fail("--trace-steps must be A:B with 1 <= A <= B, got \"{}\"", c.trace_steps);
    }
    o.trace_first = first;
    o.trace_last = last;
  }
  record["start"] = start.index;
  record["step"] = std::max<int64_t>(start.resume_step, 0);
  record["resumed"] = start.resume_step >= 0;
  record["time"] = utc_now();
  if (!run_dir.empty() && c.obs) {
    o.dir = run_dir / "obs";
    fs::create_directories(o.dir);
    // A trace is of this start's --trace-steps; an earlier start's would be merged with it.
    remove_tree(o.dir / fmt::format("trace-rank-{}.json", r.world.rank));
    if (r.leads()) {
      json job = {{"topology", c.topology},
                  {"ranks", r.world.world_size},
                  {"trainer_ranks", r.topology.trainers},
                  {"accumulation", c.accumulation},
                  {"batch_size", c.batch_size},
                  {"warmup_steps", warmup_steps},
                  {"steps", steps},
                  {"device", r.device.str()}};
      obs::record_job_start(o.dir, job, record);
    }
  }
  obs::configure(o);
  obs::write_start(record);
}

// The figures at the end of a rank's loop, before its threads are torn down (a batch-forming
// thread being joined is not part of the steady state).
void final_snapshot(at::Device device, int64_t step) {
  if (!obs::enabled()) return;
  {
    obs::Scope waiting(obs::Stage::kGpuWait);
    obs::synchronize(device);
  }
  obs::maybe_write_snapshot(step, /*force=*/true);
}

// The end of a rank's run: its trace written, then (after every rank has written) rank 0
// merges the traces. Returns the report of this start on rank 0 ("" elsewhere, without files,
// or when this start trained no step: its figures say nothing).
std::string finish_obs(const RunConfig& c, const Rank& r, const fs::path& run_dir,
                       const Start& start, bool trained) {
  if (!c.obs) return {};
  obs::write_trace();
  if (run_dir.empty()) return {};
  r.comm->barrier("obs_files_written");
  if (!r.leads() || !trained) return {};
  const auto trace = obs::merge_traces(run_dir);
  std::string text = obs::format_report(obs::analyze_run(run_dir, start.index));
  if (!trace.empty())
    text += fmt::format("trace: {} (open in https://ui.perfetto.dev)\n", trace.string());
  return text;
}

models::DrafterConfig drafter_config(const RunConfig& c, const models::ModelConfig& tc,
                                     bool announce) {
  models::DrafterOptions o;
  o.num_layers = c.drafter_layers;
  o.target_layer_ids = c.target_layer_ids;
  o.block_size = c.block_size;
  o.gamma = models::default_gamma(c.block_size);
  o.mask_token_id = c.mask_token_id;
  if (o.mask_token_id < 0) {
    o.mask_token_id = kQwen3MaskToken < tc.vocab_size ? kQwen3MaskToken : tc.vocab_size - 1;
    if (o.mask_token_id != kQwen3MaskToken && announce) {
      fmt::print(
          "train: note: the target's vocabulary ({}) has no token {} (Qwen3's MASK); using the "
          "last id, {}, as the mask token (set --mask-token-id to choose)\n",
          tc.vocab_size, kQwen3MaskToken, o.mask_token_id);
    }
  }
  return models::make_drafter_config(tc, o);
}

// Everything a rank holds for the job.
struct Job {
  Rank rank;
  RunConfig config;
  models::ModelConfig target_config;
  std::optional<models::TargetModel> target;  // ranks that run the target
  models::TargetHead head;                    // trainer ranks
  std::optional<models::Drafter> drafter;     // trainer ranks
  // --eval-prompts: this trainer rank's share of the prompts with the target's answers.
  std::optional<eval::Evaluator> evaluator;
  std::string mask_token;  // the mask id's text in the target's tokenizer (for RUN/best)
  const SampleSource* samples = nullptr;
  int64_t steps = 0;
  int64_t batches_per_epoch = 0;
};

StreamOptions stream_options_of(const RunConfig& c) {
  StreamOptions so;
  so.batch_size = c.batch_size;
  so.accumulation = c.accumulation;
  so.max_seq_len = c.max_seq_len;
  so.anchors.max_anchors = c.max_anchors;
  so.anchors.seed = static_cast<uint64_t>(c.seed);
  return so;
}

// Trainer ranks start from rank 0's weights, whatever each initialised.
void broadcast_drafter(Job& job) {
  if (job.rank.data_parallel().size() <= 1) return;
  auto params = job.drafter->parameters();
  c10::NoGradGuard no_grad;
  job.rank.data_parallel().broadcast(params, 0, "drafter_init_broadcast");
}

using StepCallback = std::function<void(const train::StepLog&)>;

// One evaluation during training: every trainer rank's counts summed.
struct TrainEval {
  int64_t step = 0;
  eval::FileReport report;  // counts, histogram and speeds; no divergence list
  int64_t mismatches = 0, ties = 0;
  double seconds = 0;  // the wall time training paused for it
};
using EvalCallback = std::function<void(const TrainEval&)>;

bool eval_due(const RunConfig& c, int64_t step, int64_t steps) {
  return !c.eval_prompts.empty() &&
         (step == steps || (c.eval_every > 0 && step % c.eval_every == 0));
}

// The evaluation options make sense together and with the topology (checked before any
// loading).
void check_eval_options(const RunConfig& c, const Topology& topology) {
  if (c.eval_prompts.empty()) {
    if (c.eval_every > 0) fail("train: --eval-every needs --eval-prompts (a held-out prompt file)");
    return;
  }
  if (c.eval_every < 0) fail("train: --eval-every must be 0 (only at the end) or positive");
  if (topology.disaggregated()) {
    // Trainer ranks hold no target there, and target ranks no drafter.
    fail(
        "train: --eval-prompts needs --topology colocated (evaluation runs the target and the "
        "drafter on the same rank); evaluate a disaggregated run's checkpoints with `dflash "
        "eval`");
  }
}

// --eval-prompts: prompt i goes to trainer rank i mod trainers, whose Evaluator computes the
// target's greedy answers to its share here, once, before the run's threads start. Each
// evaluation is then real speculative decoding with the drafter's weights of that moment.
void prepare_eval(Job& job) {
  const RunConfig& c = job.config;
  const Rank& r = job.rank;
  if (c.eval_prompts.empty()) return;
  obs::Scope scope(obs::Stage::kEval);
  const auto t0 = Clock::now();
  eval::PromptFile all = eval::read_prompt_file(c.eval_prompts, c.eval_limit);
  eval::PromptFile share{all.name, {}};
  for (size_t i = static_cast<size_t>(r.world.rank); i < all.prompts.size();
       i += static_cast<size_t>(r.topology.trainers)) {
    share.prompts.push_back(std::move(all.prompts[i]));
  }
  const size_t mine = share.prompts.size();
  const auto tokenizer = tok::Tokenizer::load(c.target);
  const data::ChatConfig chat = eval::chat_config(c.target, std::nullopt, "train");
  eval::EvalOptions o;
  o.max_new_tokens = c.eval_max_new_tokens;
  o.slots = c.eval_batch_size;
  o.enable_thinking = c.eval_enable_thinking;
  o.stop_tokens = eval::stop_tokens(c.target, tokenizer, chat.format);
  std::vector<eval::PromptFile> files;
  files.push_back(std::move(share));
  job.evaluator.emplace(*job.target, tokenizer, chat, std::move(files), o);
  job.mask_token = train::mask_token_text(tokenizer, job.drafter->config().mask_token_id);
  if (r.leads()) {
    fmt::print(
        "train: eval: {} prompts of {} ({} on rank 0), the target's greedy answers in {:.1f} s; "
        "tau by speculative decoding (block {}, at most {} new tokens) {}\n",
        all.prompts.size(), c.eval_prompts, mine, seconds_since(t0),
        job.drafter->config().block_size, c.eval_max_new_tokens,
        c.eval_every > 0 ? fmt::format("every {} steps and at the end", c.eval_every)
                         : std::string("at the end"));
    std::fflush(stdout);
  }
}

// Every trainer rank decodes its share with the drafter as it is now; the counts are summed
// over ranks, so each rank returns the job's figures. Weights are only read, without autograd.
TrainEval evaluate_drafter(Job& job, int64_t step) {
  const Rank& r = job.rank;
  {
    // The step's own work first, so that the decoding speed is the decoder's alone.
    obs::Scope wait(obs::Stage::kGpuWait);
    obs::synchronize(r.device);
  }
  obs::Scope scope(obs::Stage::kEval, r.device);
  const auto t0 = Clock::now();
  const int64_t block = job.drafter->config().block_size;
  eval::EvalReport local;
  {
    c10::NoGradGuard no_grad;
    local = job.evaluator->evaluate(*job.drafter);
  }
  const eval::FileReport& f = local.files.at(0);
  for (const auto& d : f.divergences) {
    if (d.tie) continue;
    // Local prompt j of rank r is prompt j * trainers + r of the file.
    fmt::print(stderr,
               "train: ERROR: eval at step {}: prompt {} turn {}: speculative output differs "
               "from the target's greedy output at answer token {} (target {} vs speculative "
               "{}, logit gap {:.4g})\n",
               step, d.prompt * r.topology.trainers + r.world.rank, d.turn, d.position,
               d.target_token, d.speculative_token, d.logit_gap);
  }
  std::vector<int64_t> counts = {f.prompts,
                                 f.turns,
                                 f.speculative.verify_steps,
                                 f.speculative.generated_tokens,
                                 std::llround(f.speculative.seconds * 1e6),
                                 f.target.generated_tokens,
                                 std::llround(f.target.seconds * 1e6),
                                 f.mismatches(),
                                 f.ties()};
  std::vector<int64_t> histogram = f.speculative.committed;
  histogram.resize(static_cast<size_t>(block + 1), 0);
  counts.insert(counts.end(), histogram.begin(), histogram.end());
  TrainEval e;
  e.step = step;
  e.report.name = f.name;
  e.report.block_size = block;
  e.report.speculative.committed.assign(histogram.size(), 0);
  for (const auto& v : r.data_parallel().all_gather_int64(counts, "eval_counts")) {
    e.report.prompts += v[0];
    e.report.turns += v[1];
    e.report.speculative.verify_steps += v[2];
    e.report.speculative.generated_tokens += v[3];
    e.report.speculative.seconds += static_cast<double>(v[4]) * 1e-6;
    e.report.target.generated_tokens += v[5];
    e.report.target.seconds += static_cast<double>(v[6]) * 1e-6;
    e.mismatches += v[7];
    e.ties += v[8];
    for (size_t k = 0; k < histogram.size(); ++k) e.report.speculative.committed[k] += v[9 + k];
  }
  e.seconds = seconds_since(t0);
  return e;
}

// RUN/best: the export (config.json + bf16 model.safetensors: what `dflash eval`, `dflash
// export`, SGLang and vLLM load) of the drafter with the highest eval tau so far, beside
// RUN/best.json {"step", "tau"}. Training past the best tau overfits small data sets, and the
// checkpoints kept by --keep-last are the newest, not the best. Written under a temporary name
// and renamed, so a kill leaves a whole export; a resumed run compares against best.json.
void keep_if_best(const Job& job, const fs::path& run_dir, const TrainEval& e) {
  const double tau = e.report.speculative.tau();
  const fs::path record = run_dir / "best.json";
  if (fs::exists(record) && read_json_file(record).value("tau", 0.0) >= tau) return;
  models::DrafterConfig config = job.drafter->config();
  config.mask_token = job.mask_token;
  const fs::path tmp = run_dir / "best.tmp", old = run_dir / "best.old", best = run_dir / "best";
  remove_tree(tmp);
  models::write_drafter_export(tmp, config, job.drafter->named_parameters());
  remove_tree(old);
  if (fs::exists(best)) fs::rename(best, old);
  fs::rename(tmp, best);
  fsync_dir(run_dir);
  write_file_atomic(record, nlohmann::json{{"step", e.step}, {"tau", tau}}.dump(2) + "\n");
  remove_tree(old);
}

// --prefill-gemms fp8: the projections of the layers the features need, in e4m3, once before
// the first prefill.
void quantize_target_for_features(Job& job, const std::vector<int64_t>& taps) {
  if (models::parse_prefill_gemms(job.config.prefill_gemms) != models::PrefillGemms::kFp8) return;
  const auto t0 = Clock::now();
  const int64_t layers = models::layers_for_taps(taps);
  const int64_t bytes = job.target->quantize_weights_fp8(layers);
  // Without evaluation nothing else runs the target: its bf16 projections can go.
  const int64_t freed = job.evaluator ? 0 : job.target->release_compute_projections();
  if (job.rank.device.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
  const std::string dtype = c10::toString(job.target->dtype());
  fmt::print(
      "rank {}: --prefill-gemms fp8: target layers 0-{} in e4m3 in {:.1f} s (+{:.2f} GiB); {}\n",
      job.rank.world.rank, layers - 1, seconds_since(t0), bytes / double(1 << 30),
      job.evaluator ? fmt::format("their {} projections kept for evaluation", dtype)
                    : fmt::format("their {} projections freed (-{:.2f} GiB)", dtype,
                                  freed / double(1 << 30)));
}

// The loop of this rank; `resume_from` (a step directory): trainer ranks continue from it,
// target ranks from the data position rank 0 broadcasts. Returns the steps done.
int64_t run_rank(Job& job, const fs::path& resume_from, const fs::path& run_dir,
                 const StepCallback& on_step, const EvalCallback& on_eval = {}) {
  const RunConfig& c = job.config;
  Rank& r = job.rank;
  const Topology topo = r.topology;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_s * 1000));
  const bool pin = r.device.is_cuda();
  const models::DrafterConfig dc =
      job.drafter ? job.drafter->config() : drafter_config(c, job.target_config, false);
  GlobalStream stream(*job.samples, stream_options_of(c), dc);
  int64_t start_position = 0;
  // Rank 0 knows where the run stands; every rank (target ranks too) starts there.
  auto agree_on_start = [&](int64_t position) {
    std::vector<at::Tensor> where{at::tensor(std::vector<int64_t>{position}).to(r.device)};
    r.comm->broadcast(where, 0, "resume_position");
    start_position = where[0].cpu().item<int64_t>();
  };
  if (job.target) quantize_target_for_features(job, dc.target_layer_ids);
  if (!r.trains()) {
    agree_on_start(0);
    Prefetcher batches(
        "target_batches",
        [&](int64_t item) {
          const auto w = topo.target_work(r.world.rank, start_position, item);
          return stream.form(w.position, w.trainer, topo.trainers, pin);
        },
        static_cast<size_t>(c.prefetch), timeout);
    serve_features(*r.comm, topo, *job.target, dc.target_layer_ids,
                   models::parse_prefill_gemms(c.prefill_gemms), batches, start_position,
                   job.steps * c.accumulation, c.accumulation, static_cast<size_t>(c.prefetch),
                   [] { return stop_signal() != 0; });
    final_snapshot(r.device, job.steps);
    return job.steps;
  }
  const int trainer = r.world.rank;
  Prefetcher batches(
      "batches",
      [&](int64_t position) { return stream.form(position, trainer, topo.trainers, pin); },
      static_cast<size_t>(c.prefetch), timeout);
  std::unique_ptr<train::BatchSource> source;
  if (topo.disaggregated()) {
    source = std::make_unique<ReceivedSource>(
        *r.comm, topo, trainer, dc.num_taps() * dc.layers.hidden_size, r.dtype, r.device, batches);
  } else {
    source = std::make_unique<ColocatedSource>(*job.target, dc.target_layer_ids, batches,
                                               c.overlap_target,
                                               models::parse_prefill_gemms(c.prefill_gemms));
  }
  train::TrainerOptions to;
  to.lr = c.lr;
  to.min_lr = c.min_lr;
  to.warmup_ratio = c.warmup_ratio;
  to.total_steps = job.steps;
  to.adamw.weight_decay = c.weight_decay;
  to.clip_norm = c.clip_norm;
  to.accumulation = c.accumulation;
  to.seed = static_cast<uint64_t>(c.seed);
  to.step.dtype = r.dtype;
  to.step.attention = models::parse_drafter_attention(c.drafter_attention, "drafter_attention");
  to.step.head_grad = train::parse_head_grad(c.head_grad, "head_grad");
  to.step.drafter_gemms = train::parse_drafter_gemms(c.drafter_gemms, "drafter_gemms");
  to.checkpoint_dir = run_dir;
  to.write_checkpoints = r.leads();
  to.checkpoint_every = c.checkpoint_every;
  to.keep_last = c.keep_last;
  to.allreduce_bucket_bytes = static_cast<int64_t>(c.allreduce_bucket_mb * (1 << 20));
  train::Trainer loop(*job.drafter, job.head, to, *source, &r.data_parallel());
  if (r.leads() && loop.head_grad() != to.step.head_grad) {
    fmt::print("train: LM-head input gradient: {} (--head-grad {})\n",
               train::head_grad_name(loop.head_grad()), c.head_grad);
  }
  if (r.leads() && loop.drafter_gemms() == train::DrafterGemms::kFp8) {
    fmt::print(
        "train: drafter layer GEMMs: fp8 (forward and input gradients in e4m3, weight "
        "gradients in {}; --drafter-gemms {})\n",
        c10::toString(r.dtype), c.drafter_gemms);
  }
  if (!resume_from.empty()) {
    loop.load_checkpoint(resume_from);
    if (r.leads()) {
      fmt::print("train: resumed from {} (step {}, micro-batch {})\n", resume_from.string(),
                 loop.steps_done(), loop.data_position());
    }
  }
  agree_on_start(loop.data_position());
  if (start_position != loop.data_position()) {
    fail(
        "rank {}: its checkpoint is at micro-batch {}, rank 0's at {} (ranks read different "
        "run directories?)",
        r.world.rank, loop.data_position(), start_position);
  }
  const auto after_step = [&](int64_t step) {
    if (!job.evaluator || !eval_due(c, step, job.steps)) return;
    // The batch-forming thread stops for the evaluation (it would time out waiting on a full
    // queue) and restarts at the next micro-batch, which it forms again identically.
    batches.pause();
    const TrainEval e = evaluate_drafter(job, step);
    if (on_eval) on_eval(e);
  };
  const int64_t done = loop.run(
      job.steps,
      [&](const train::StepLog& l) {
        if (on_step) on_step(l);
        obs::maybe_write_snapshot(l.step);
      },
      after_step);
  final_snapshot(r.device, done);
  return done;
}

// This process's GPU memory: the caching allocator's peaks of live tensors and of what it holds,
// and what the device has in use (cudaMemGetInfo: allocator pools, CUDA context, NCCL buffers),
// as nvidia-smi counts it; one process per GPU, so it is this process's. Host calls only.
struct GpuMemory {
  int64_t allocated_peak = 0, reserved_peak = 0, in_use = 0;
};

GpuMemory gpu_memory(at::Device device) {
  GpuMemory m;
  if (!device.is_cuda()) return m;
  c10::cuda::CUDAGuard guard(device);
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    m.in_use = static_cast<int64_t>(total_bytes - free_bytes);
  }
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  using c10::CachingAllocator::StatType;
  m.allocated_peak = stats.allocated_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  m.reserved_peak = stats.reserved_bytes[static_cast<size_t>(StatType::AGGREGATE)].peak;
  return m;
}

double gib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 30); }

// The steps `c` asks for: --steps, or --epochs worth of optimizer steps.
int64_t total_steps(const RunConfig& c, int64_t batches_per_epoch) {
  if (c.steps > 0) return c.steps;
  const double steps = std::ceil(c.epochs * static_cast<double>(batches_per_epoch) /
                                 static_cast<double>(c.accumulation));
  return std::max<int64_t>(static_cast<int64_t>(steps), 1);
}

// Rank 0's view of a run's progress: metrics.jsonl, TensorBoard scalars, the progress line.
class RunLog {
 public:
  RunLog(const fs::path& run_dir, at::Device device, int64_t first_step, int64_t steps,
         double log_seconds)
      : device_(device),
        metrics_path_(run_dir / "metrics.jsonl"),
        elapsed_before_(truncate_metrics(metrics_path_, first_step)),
        metrics_(std::fopen(metrics_path_.c_str(), "a"), &std::fclose),
        tb_(run_dir / "tb"),
        first_step_(first_step),
        steps_(steps),
        log_seconds_(log_seconds) {
    if (!metrics_) fail("{}: cannot open for appending", metrics_path_.string());
    // A SessionLog START at the first step this process writes makes TensorBoard drop what a
    // killed process wrote past the checkpoint, as truncate_metrics does for metrics.jsonl.
    tb_.add_session_start(first_step + 1);
    tb_.flush();
  }

  void add(const train::StepLog& l) {
    obs::Scope scope(obs::Stage::kLog);
    const auto now = Clock::now();
    const double dt = std::chrono::duration<double>(now - last_step_).count();
    const double session = std::chrono::duration<double>(now - start_).count();
    last_step_ = now;
    session_tokens_ += l.tokens;
    const double rate = dt > 0 ? static_cast<double>(l.tokens) / dt : 0.0;
    json line = {{"step", l.step},
                 {"loss", l.loss},
                 {"accuracy", l.accuracy},
                 {"acceptance", l.acceptance},
                 {"grad_norm", l.grad_norm},
                 {"lr", l.lr},
                 {"blocks", l.blocks},
                 {"labels", l.labels},
                 {"skipped_sequences", l.skipped_sequences},
                 {"tokens", l.tokens},
                 {"tokens_per_s", rate},
                 {"elapsed_s", elapsed_before_ + session}};
    if (l.skipped_nonfinite) line["nonfinite"] = true;
    const GpuMemory memory = gpu_memory(device_);
    if (device_.is_cuda()) {
      line["gpu_allocated_peak_gib"] = gib(memory.allocated_peak);
      line["gpu_reserved_peak_gib"] = gib(memory.reserved_peak);
      line["gpu_in_use_gib"] = gib(memory.in_use);
    }
    if (eval_ && eval_->step == l.step) {
      const auto& f = eval_->report;
      line["eval_tau"] = f.speculative.tau();
      line["eval_committed_histogram"] = f.speculative.committed;
      line["eval_prompts"] = f.prompts;
      line["eval_turns"] = f.turns;
      line["eval_verify_steps"] = f.speculative.verify_steps;
      line["eval_generated_tokens"] = f.speculative.generated_tokens;
      line["eval_mismatches"] = eval_->mismatches;
      line["eval_ties"] = eval_->ties;
      line["eval_seconds"] = eval_->seconds;
      line["eval_target_tokens_per_s"] = f.target_tokens_per_s();
      line["eval_speculative_tokens_per_s"] = f.speculative_tokens_per_s();
      line["eval_speedup"] = f.speedup();
      eval_.reset();
    }
    const json split = obs::step_split();
    for (const auto& [key, value] : split.items()) line[key] = value;
    const std::string text = line.dump() + "\n";
    if (std::fputs(text.c_str(), metrics_.get()) < 0 || std::fflush(metrics_.get()) != 0) {
      fail("{}: write failed", metrics_path_.string());
    }
    std::vector<std::pair<std::string, double>> scalars = {{"train/loss", l.loss},
                                                           {"train/acceptance", l.acceptance},
                                                           {"train/grad_norm", l.grad_norm},
                                                           {"train/lr", l.lr},
                                                           {"train/tokens_per_s", rate}};
    if (device_.is_cuda()) {
      scalars.push_back({"memory/gpu_allocated_peak_gib", gib(memory.allocated_peak)});
      scalars.push_back({"memory/gpu_reserved_peak_gib", gib(memory.reserved_peak)});
      scalars.push_back({"memory/gpu_in_use_gib", gib(memory.in_use)});
    }
    for (size_t k = 0; k < l.accuracy.size(); ++k) {
      scalars.push_back({fmt::format("accuracy/position_{:02d}", k + 1), l.accuracy[k]});
    }
    for (const char* part : {"host_ms", "gpu_ms"}) {
      if (!split.contains(part)) continue;
      for (const auto& [stage, ms] : split[part].items()) {
        scalars.push_back({fmt::format("stages_{}/{}", part, stage), ms.get<double>()});
      }
    }
    tb_.add_scalars(l.step, scalars);
    tb_.flush();
    if (l.step == first_step_ + 1 || l.step >= steps_ ||
        std::chrono::duration<double>(now - last_print_).count() >= log_seconds_) {
      last_print_ = now;
      const double steps_per_s =
          static_cast<double>(l.step - first_step_) / std::max(session, 1e-9);
      const auto recent = obs::recent();
      std::string where;
      if (recent.gpu_busy >= 0) where += fmt::format(" | GPU busy {:.0f}%", recent.gpu_busy);
      if (!recent.top_stage.empty()) {
        where += fmt::format(" | top stage {} {:.0f}%", recent.top_stage, 100 * recent.top_share);
      }
      const std::string held_out =
          eval_tau_ ? fmt::format(" | eval tau {:.2f} (step {})", *eval_tau_, eval_step_) : "";
      fmt::print(
          stderr,
          "train: step {}/{} ({:.1f}%) | loss {:.4f} | acc1 {:.3f} | tau {:.2f}{} | lr {:.2e} "
          "| {:.2f} steps/s {} tokens/s{} | elapsed {} | ETA {}\n",
          l.step, steps_, 100.0 * static_cast<double>(l.step) / static_cast<double>(steps_), l.loss,
          l.accuracy.empty() ? 0.0 : l.accuracy[0], l.acceptance, held_out, l.lr, steps_per_s,
          rate_text(static_cast<double>(session_tokens_) / std::max(session, 1e-9)), where,
          clock_text(elapsed_before_ + session),
          clock_text(steps_per_s > 0 ? static_cast<double>(steps_ - l.step) / steps_per_s : NAN));
      std::fflush(stderr);
    }
  }
  // An evaluation at step e.step, which is logged after it: its figures join that step's
  // metrics line; TensorBoard and a line of its own get them now.
  void add_eval(const TrainEval& e) {
    obs::Scope scope(obs::Stage::kLog);
    const auto& f = e.report;
    const double tau = f.speculative.tau();
    eval_ = e;
    eval_tau_ = tau;
    eval_step_ = e.step;
    tb_.add_scalars(e.step, {{"eval/tau", tau},
                             {"eval/mismatches", static_cast<double>(e.mismatches)},
                             {"eval/seconds", e.seconds},
                             {"eval/target_tokens_per_s", f.target_tokens_per_s()},
                             {"eval/speculative_tokens_per_s", f.speculative_tokens_per_s()},
                             {"eval/speedup", f.speedup()}});
    tb_.flush();
    std::string histogram;
    for (size_t k = 1; k < f.speculative.committed.size(); ++k) {
      histogram += fmt::format(" {}:{}", k, f.speculative.committed[k]);
    }
    fmt::print(stderr,
               "train: eval at step {}: tau {:.3f} on {} prompts ({} verify steps; committed "
               "per step{}) | target-only {:.1f} tokens/s, speculative {:.1f} tokens/s, "
               "speed-up {:.2f}x | {:.1f} s\n",
               e.step, tau, f.prompts, f.speculative.verify_steps, histogram,
               f.target_tokens_per_s(), f.speculative_tokens_per_s(), f.speedup(), e.seconds);
    if (e.mismatches > 0) {
      // Training goes on: the weights are not at fault, the decoder is, and a long run should
      // not be lost to it; the count is in metrics.jsonl and `dflash eval` shows the turns.
      fmt::print(stderr,
                 "train: ERROR: eval at step {}: speculative output differs from the target's "
                 "greedy output in {} turn(s) of {} (the decoder is wrong; this tau is not "
                 "trustworthy)\n",
                 e.step, e.mismatches, f.turns);
    }
    std::fflush(stderr);
  }
  const fs::path& metrics_path() const { return metrics_path_; }

 private:
  at::Device device_;
  fs::path metrics_path_;
  double elapsed_before_;
  std::unique_ptr<FILE, int (*)(FILE*)> metrics_;
  obs::TensorBoardWriter tb_;
  int64_t first_step_, steps_;
  double log_seconds_;
  Clock::time_point start_ = Clock::now(), last_step_ = start_, last_print_ = start_;
  int64_t session_tokens_ = 0;
  std::optional<TrainEval> eval_;  // waiting for its step's line
  std::optional<double> eval_tau_;
  int64_t eval_step_ = 0;
};

// What identifies a prepared dataset wherever it lies: its sizes and a CRC-32C over its
// shards' checksums in order (from the manifest, which Dataset::open checked the shards against).
json data_fingerprint(const data::Dataset& dataset) {
  const json& shards = dataset.manifest().at("shards");
  std::string crcs;
  for (const auto& shard : shards) crcs += shard.at("crc32c").get<std::string>();
  return {{"samples", dataset.size()},
          {"tokens", dataset.tokens()},
          {"shards", shards.size()},
          {"crc32c", fmt::format("{:08x}", crc32c(crcs.data(), crcs.size()))}};
}

// run_config.json: what the run is.
json run_config_json(const Job& job, const json& fingerprint) {
  const RunConfig& c = job.config;
  const auto& dc = job.drafter->config();
  return {{"drafter", models::drafter_config_json(dc)},
          {"gamma", dc.gamma},
          {"target", fs::absolute(c.target).lexically_normal().string()},
          {"data", fs::absolute(c.data).lexically_normal().string()},
          {"data_fingerprint", fingerprint},
          {"options", stream_options(c, job.steps)},
          {"init",
           {{"from", c.init_from},
            {"from_target_layers", c.init_from_target_layers},
            {"seed", c.seed}}},
          {"world_size", job.rank.world.world_size},
          {"topology", c.topology},
          {"trainer_ranks", job.rank.topology.trainers},
          {"device", job.rank.device.str()},
          {"dtype", c10::toString(job.rank.dtype)},
          {"head_grad", train::head_grad_name(train::resolve_head_grad(
                            train::parse_head_grad(c.head_grad, "head_grad"), job.head.lm_head,
                            job.rank.dtype))},
          {"drafter_gemms", train::drafter_gemms_name(train::resolve_drafter_gemms(
                                train::parse_drafter_gemms(c.drafter_gemms, "drafter_gemms"),
                                job.drafter->config(), job.rank.device, job.rank.dtype))},
          {"prefill_gemms", c.prefill_gemms},
          {"dflash_version", DFLASH_VERSION}};
}

// A dataset as a person recognises it: where it is and what it holds.
std::string data_text(const json& path, const json& fingerprint) {
  const std::string where = path.is_string() ? path.get<std::string>() : path.dump();
  if (!fingerprint.is_object()) return where + " (the run recorded no fingerprint of it)";
  return fmt::format(
      "{} ({} samples, {} tokens, checksum {})", where, fingerprint.value("samples", json()).dump(),
      fingerprint.value("tokens", json()).dump(), fingerprint.value("crc32c", std::string("?")));
}

// A resume must continue the run in `run_dir`: the checkpoint holds this drafter, the data
// stream and schedule options are the run's, and so is the data (by fingerprint; by path for a
// run that recorded none) unless --allow-data-change. Runs before anything is written, so a
// refusal leaves the run as it was. Prints what may differ; carries the run's data changes
// into `run_config` and returns the one this resume makes (null: none).
json check_resume(const Job& job, const fs::path& run_dir, const train::ResumePoint& point,
                  json& run_config) {
  const RunConfig& c = job.config;
  try {
    train::check_checkpoint_config(point.checkpoint, job.drafter->config());
  } catch (const Error& e) {
    fail("{}\n  pass the run's drafter options to continue it (nothing was changed)", e.what());
  }
  const fs::path config_path = run_dir / "run_config.json";
  if (!fs::exists(config_path)) return nullptr;
  const json saved = read_json_file(config_path);
  std::vector<std::string> differ;
  for (const auto& [key, value] : run_config["options"].items()) {
    if (key == "steps") continue;
    if (saved.contains("options") && saved["options"].contains(key) &&
        saved["options"][key] != value) {
      differ.push_back(
          fmt::format("{} {} (run: {})", key, value.dump(), saved["options"][key].dump()));
    }
  }
  if (!differ.empty()) {
    fail(
        "--resume with options that differ from the run in {}: {}; pass the run's values so "
        "it continues the same data stream and schedule (nothing was changed)",
        run_dir.string(), fmt::join(differ, ", "));
  }
  json change = nullptr;
  if (saved.contains("data")) {
    const json& was = saved["data"];
    const json was_fingerprint = saved.value("data_fingerprint", json());
    const bool same = was_fingerprint.is_object()
                          ? was_fingerprint == run_config["data_fingerprint"]
                          : was == run_config["data"];
    const std::string before = data_text(was, was_fingerprint);
    const std::string now = data_text(run_config["data"], run_config["data_fingerprint"]);
    if (!same && !c.allow_data_change) {
      fail(
          "--resume with another dataset than the run's:\n  the run trains on {}\n  --data is  "
          "        {}\n  pass the run's --data to continue it, or add --allow-data-change to go "
          "on with this one from step {} (nothing was changed)",
          before, now, point.step);
    }
    if (!same) {
      fmt::print(
          "train: note: --allow-data-change: the run trained on {} up to step {}; it goes on "
          "with {} (recorded in run_config.json and the obs start record)\n",
          before, point.step, now);
      change = {
          {"step", point.step},
          {"from", {{"data", was}, {"data_fingerprint", was_fingerprint}}},
          {"to",
           {{"data", run_config["data"]}, {"data_fingerprint", run_config["data_fingerprint"]}}}};
    } else if (was != run_config["data"]) {
      fmt::print("train: note: the run's data is now at {} (the same content as {})\n", now,
                 was.dump());
    }
  }
  run_config["data_changes"] = saved.value("data_changes", json::array());
  if (!change.is_null()) run_config["data_changes"].push_back(change);
  const json old_steps = saved.value("options", json::object()).value("steps", json());
  if (!old_steps.is_null() && old_steps != json(job.steps)) {
    fmt::print("train: note: --steps {} (the run had {}): the lr schedule changes from here\n",
               job.steps, old_steps.dump());
  }
  // The arithmetic too: an `auto` resolved otherwise (another GPU, another version's default)
  // changes the numerics from here on.
  for (const char* key : {"target", "world_size", "topology", "dtype", "head_grad", "drafter_gemms",
                          "prefill_gemms"}) {
    if (saved.contains(key) && saved[key] != run_config[key]) {
      fmt::print("train: note: {} is {} (the run had {})\n", key, run_config[key].dump(),
                 saved[key].dump());
    }
  }
  return change;
}

// run_config.json (what the run is) and run_config.yaml (the resolved config, reusable with
// --config; a data change is allowed for the one resume that asked, not for every later one).
void write_run_config(const fs::path& run_dir, const json& run_config, RunConfig c) {
  fs::create_directories(run_dir);
  write_file_atomic(run_dir / "run_config.json", run_config.dump(2) + "\n");
  c.allow_data_change = false;
  write_file_atomic(run_dir / "run_config.yaml", to_yaml(c));
}

// The drafter of a trainer rank: from --init-from, from target layers, or fresh.
models::Drafter make_drafter(const Job& job, bool resuming) {
  const RunConfig& c = job.config;
  if (!c.init_from.empty()) {
    if (!c.init_from_target_layers.empty()) {
      fail("--init-from and --init-from-target-layers exclude each other");
    }
    return models::Drafter::load(c.init_from, job.target_config, job.rank.device);
  }
  const auto config = drafter_config(c, job.target_config, job.rank.leads());
  if (!c.init_from_target_layers.empty() && !resuming) {
    if (!job.target) {
      fail("--init-from-target-layers needs the target on the trainer rank (colocated)");
    }
    return models::Drafter::from_target_layers(config, *job.target, c.init_from_target_layers,
                                               static_cast<uint64_t>(c.seed));
  }
  return models::Drafter::random(config, job.rank.device, static_cast<uint64_t>(c.seed));
}

}  // namespace

void run_training(const RunConfig& c) {
  if (c.target.empty() || c.data.empty() || c.out.empty()) {
    fail("train: --target, --data and --out are required (on the command line or in --config)");
  }
  models::parse_prefill_gemms(c.prefill_gemms);  // a bad name fails before anything loads
  Job job;
  job.config = c;
  job.rank = join(c);
  Rank& r = job.rank;
  check_eval_options(c, r.topology);
  const fs::path run_dir = c.out;
  const bool existing = !train::list_checkpoints(run_dir).empty();
  if (existing && !c.resume) {
    fail(
        "{} already holds checkpoints of a training run (newest {}); pass --resume to continue "
        "it, or choose another --out (nothing was overwritten)",
        run_dir.string(), train::resolve_checkpoint(run_dir).filename().string());
  }
  if (c.resume && !existing && r.leads()) {
    fmt::print("train: --resume: no checkpoint in {} yet, starting a new run\n", run_dir.string());
  }
  const bool resuming = c.resume && existing;
  // Rank 0 picks the newest checkpoint that verifies (reading only); the others learn its step
  // once rank 0's checks have passed (agree_on_run_start).
  train::ResumePoint point;
  if (resuming && r.leads()) point = train::find_resume_point(run_dir);
  const auto t0 = Clock::now();
  const bool runs_target = !r.trains() || !r.topology.disaggregated();
  job.target_config = models::load_model_config(fs::path(c.target) / "config.json");
  if (runs_target) {
    job.target.emplace(models::TargetModel::load(c.target, r.device, r.dtype));
    job.head = models::TargetHead::of(*job.target);
  } else {
    job.head = models::load_target_head(c.target, r.device, r.dtype);
  }
  const auto& tc = job.target_config;
  auto dataset = data::Dataset::open(c.data);
  DatasetSamples samples(dataset);
  job.samples = &samples;
  if (r.leads()) {
    fmt::print(
        "train: target {} ({} layers, hidden {}, vocabulary {}) in {}, loaded in {:.1f} s; "
        "{} rank(s) ({}: {} training{}), rank 0 on {}\n",
        c.target, tc.num_layers, tc.hidden_size, tc.vocab_size, c10::toString(r.dtype),
        seconds_since(t0), r.world.world_size, c.topology, r.topology.trainers,
        r.topology.disaggregated() ? fmt::format(", {} running the target", r.topology.targets)
                                   : std::string(),
        r.device.str());
    fmt::print("train: data {} ({} samples, {} tokens)\n", c.data, dataset.size(),
               dataset.tokens());
  }
  const auto dc = drafter_config(c, tc, false);
  GlobalStream probe(samples, stream_options_of(c), dc);
  job.batches_per_epoch = probe.batches_per_epoch();
  job.steps = total_steps(c, job.batches_per_epoch);
  if (r.trains()) {
    job.drafter.emplace(make_drafter(job, resuming));
    broadcast_drafter(job);
  }
  std::optional<RunLog> log;
  json start_record = json::object();
  if (r.leads()) {
    json run_config = run_config_json(job, data_fingerprint(dataset));
    if (resuming) {
      const json change = check_resume(job, run_dir, point, run_config);
      if (!change.is_null()) start_record["data_change"] = change;
    }
    // Every check has passed: from here on the run directory changes.
    const auto moved = train::set_aside_damaged(point);
    for (size_t i = 0; i < moved.size(); ++i) {
      fmt::print(stderr, "train: WARNING: checkpoint {} is damaged: {}; set aside as {}\n",
                 point.damaged[i].first.string(), point.damaged[i].second,
                 moved[i].filename().string());
    }
    write_run_config(run_dir, run_config, c);
    const int64_t first_step = resuming ? point.step : 0;
    const auto& d = job.drafter->config();
    fmt::print(
        "train: drafter {} layers, taps [{}], block {}, mask token {}, {:.2f} M parameters; "
        "{} steps of {} x {} sequences ({} micro-batches per epoch), lr {:g}\n",
        d.layers.num_layers, fmt::join(d.target_layer_ids, ","), d.block_size, d.mask_token_id,
        static_cast<double>(job.drafter->num_parameters()) / 1e6, job.steps, c.accumulation,
        c.batch_size, job.batches_per_epoch, c.lr);
    if (first_step >= job.steps) {
      fmt::print("train: the run is already at step {} of {}; nothing to train\n", first_step,
                 job.steps);
    }
    std::fflush(stdout);  // so that a log file shows these before the progress lines (stderr)
    log.emplace(run_dir, r.device, first_step, job.steps, c.log_seconds);
  }
  // Fault injection for the tests: DFLASH_KILL_AT=RANK:STEP makes that rank kill itself with
  // SIGKILL (no chance to clean up, as a crash or an OOM kill) once step STEP is logged.
  int kill_rank = -1;
  int64_t kill_step = -1;
  if (const char* k = std::getenv("DFLASH_KILL_AT")) {
    if (std::sscanf(k, "%d:%ld", &kill_rank, &kill_step) != 2) {
      fail("DFLASH_KILL_AT must be RANK:STEP, got \"{}\"", k);
    }
  }
  install_stop_signals();
  const Start start = agree_on_run_start(r, run_dir, resuming ? point.step : -1);
  start_obs(c, r, run_dir, /*warmup_steps=*/1, job.steps, start, start_record);
  prepare_eval(job);
  // Rank 0 resumes from the checkpoint it verified, the others from the one of the same step.
  const fs::path resume_from = start.resume_step < 0 ? fs::path()
                               : r.leads()
                                   ? point.checkpoint
                                   : run_dir / fmt::format("step-{:08d}", start.resume_step);
  const int64_t done = run_rank(
      job, resume_from, run_dir,
      [&](const train::StepLog& l) {
        if (log) log->add(l);
        if (r.world.rank == kill_rank && l.step == kill_step) ::raise(SIGKILL);
      },
      [&](const TrainEval& e) {
        if (log) log->add_eval(e);
        if (r.leads()) keep_if_best(job, run_dir, e);
      });
  const std::string report =
      finish_obs(c, r, run_dir, start, done > std::max<int64_t>(start.resume_step, 0));
  if (!r.leads()) return;
  if (!report.empty()) {
    const auto line = report.find("bottleneck: ");
    fmt::print("train: {}", report.substr(line, report.find('\n', line) + 1 - line));
    fmt::print("  the full report: dflash report {}\n", run_dir.string());
  }
  const fs::path newest = train::resolve_checkpoint(run_dir);
  if (stop_signal() != 0) {
    fmt::print("train: stopped by {} at step {} of {}; checkpoint {} (exit status {})\n",
               stop_signal_name(), done, job.steps, newest.string(), stop_exit_code());
    fmt::print("  continue with the same command plus --resume\n");
    return;
  }
  fmt::print("train: done, {} steps; checkpoints in {} (newest {})\n", done, run_dir.string(),
             newest.filename().string());
  fmt::print("  metrics: {}\n", log->metrics_path().string());
  if (const fs::path best = run_dir / "best.json"; fs::exists(best)) {
    const auto b = read_json_file(best);
    fmt::print("  the highest eval tau, {:.3f} at step {}: {}\n", b.value("tau", 0.0),
               b.value("step", int64_t{0}), (run_dir / "best").string());
  }
  fmt::print("  export for SGLang/vLLM: dflash export {} {}/export\n", run_dir.string(),
             run_dir.string());
}

void run_bench(const RunConfig& config, const BenchConfig& bench) {
  RunConfig c = config;
  if (c.steps < bench.warmup + 2) {
    fail(
        "bench: --steps must be at least --warmup + 2 ({}): one step timed and the last, whose "
        "figures arrive with the final flush",
        bench.warmup + 2);
  }
  if (!c.eval_prompts.empty()) fail("bench: --eval-prompts is an option of `dflash train`");
  Job job;
  job.config = c;
  job.rank = join(c);
  Rank& r = job.rank;
  job.target_config = models::preset_config(bench.preset);
  const auto& tc = job.target_config;
  const bool runs_target = !r.trains() || !r.topology.disaggregated();
  if (runs_target) {
    job.target.emplace(models::TargetModel::random(tc, r.device, r.dtype, 1));
    job.head = models::TargetHead::of(*job.target);
  } else {
    // A trainer rank of a disaggregated bench needs only a head of the right shape.
    auto opts = at::TensorOptions().device(r.device).dtype(r.dtype);
    job.head.embedding = at::randn({tc.vocab_size, tc.hidden_size}, opts) * 0.02;
    job.head.lm_head = tc.tie_word_embeddings
                           ? job.head.embedding
                           : at::randn({tc.vocab_size, tc.hidden_size}, opts) * 0.02;
  }
  SyntheticSamples samples(bench.samples, bench.seq_len, std::min<int64_t>(64, bench.seq_len / 4),
                           tc.vocab_size, static_cast<uint64_t>(c.seed));
  job.samples = &samples;
  job.steps = c.steps;
  if (r.trains()) {
    job.drafter.emplace(make_drafter(job, false));
    broadcast_drafter(job);
  }
  // FLOPs of one global step: the target's prefill and the drafter's step for every sequence.
  const auto dc = drafter_config(c, tc, false);
  GlobalStream probe(samples, stream_options_of(c), dc);
  const auto one = probe.form(0, 0, static_cast<int>(c.batch_size), false);
  const double flops_per_sequence =
      models::prefill_flops(tc, one.lengths, 0, models::layers_for_taps(dc.target_layer_ids)) +
      models::drafter_step_flops(dc, one.lengths, one.blocks.layout.anchor, one.blocks.num_labels);
  const double step_flops = flops_per_sequence * static_cast<double>(c.batch_size * c.accumulation);

  std::vector<double> step_seconds;
  auto last = Clock::now();
  // Target ranks have no steps of their own: their CPU is measured over the whole run.
  double cpu_at_warmup = cpu_seconds();
  Clock::time_point wall_at_warmup = last;
  int64_t tokens_per_step = 0;
  if (r.device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(r.device.index());
  const Start start = agree_on_run_start(r, c.out, -1);
  start_obs(c, r, c.out, bench.warmup, c.steps, start);
  // A step's figures arrive one step late, once the next step is queued, and the last step's
  // with the final flush. On a GPU that is when each step finishes; where the device runs
  // eagerly (the CPU) step k's arrive after step k + 1 has run, and the last step's right after
  // them: every interval but the last is one step, so the last is not counted.
  run_rank(job, {}, {}, [&](const train::StepLog& l) {
    const auto now = Clock::now();
    if (l.step == bench.warmup) {
      cpu_at_warmup = cpu_seconds();
      wall_at_warmup = now;
    } else if (l.step > bench.warmup && l.step < c.steps) {
      step_seconds.push_back(std::chrono::duration<double>(now - last).count());
    }
    tokens_per_step = l.tokens;
    last = now;
  });
  // Every rank's host CPU and memory, gathered to rank 0.
  const double cores =
      (cpu_seconds() - cpu_at_warmup) / std::max(seconds_since(wall_at_warmup), 1e-9);
  const std::string obs_report = finish_obs(c, r, c.out, start, /*trained=*/true);
  const GpuMemory memory = gpu_memory(r.device);
  const auto all = r.comm->all_gather_int64(
      {static_cast<int64_t>(cores * 1000), memory.allocated_peak, memory.reserved_peak,
       static_cast<int64_t>(peak_rss_gib() * (1 << 30)), memory.in_use},
      "bench_report");
  if (!r.leads()) return;
  const double step_s = obs::median(step_seconds);
  const double tokens_per_s = static_cast<double>(tokens_per_step) / step_s;
  const int gpus = r.world.world_size;
  json report = {{"preset", bench.preset},
                 {"topology", c.topology},
                 {"ranks", gpus},
                 {"trainer_ranks", r.topology.trainers},
                 {"seq_len", bench.seq_len},
                 {"batch_size", c.batch_size},
                 {"accumulation", c.accumulation},
                 {"max_anchors", c.max_anchors},
                 {"drafter_parameters", job.drafter->num_parameters()},
                 {"timed_steps", step_seconds.size()},
                 {"step_ms_median", step_s * 1e3},
                 {"tokens_per_s", tokens_per_s},
                 {"tokens_per_s_per_gpu", tokens_per_s / gpus},
                 {"tflops_per_gpu", step_flops / step_s / gpus / 1e12},
                 {"mfu", step_flops / step_s / gpus / kH200BF16},
                 {"per_rank", json::array()}};
  fmt::print(
      "bench: {} x {} ({}), {} rank(s), {} training; global batch {} x {} sequences of {} tokens, "
      "{} anchors, block {}\n",
      bench.preset, dc.layers.num_layers, c.topology, gpus, r.topology.trainers, c.accumulation,
      c.batch_size, bench.seq_len, c.max_anchors, dc.block_size);
  // The MFU is against an H200's rate: a figure for GPU runs only.
  const bool gpu = r.device.is_cuda();
  fmt::print(
      "bench: step {:.1f} ms (median of {}) = {:.0f} tokens/s, {:.0f} per {}, {:.{}f} TFLOP/s per "
      "{} (target prefill + drafter step){}\n",
      step_s * 1e3, step_seconds.size(), tokens_per_s, tokens_per_s / gpus, gpu ? "GPU" : "rank",
      step_flops / step_s / gpus / 1e12, gpu ? 0 : 3, gpu ? "GPU" : "rank",
      gpu ? fmt::format(", MFU {:.0f}% of an H200's measured {:.0f} TFLOP/s",
                        100 * step_flops / step_s / gpus / kH200BF16, kH200BF16 / 1e12)
          : std::string());
  report["step_seconds"] = step_seconds;
  // A power-capped GPU slows as it heats: on an H200 a run's first tens of seconds are a few
  // percent faster than what it sustains. Long runs show how far the figure drifted.
  constexpr size_t kDriftSteps = 40;
  if (step_seconds.size() >= kDriftSteps) {
    const size_t quarter = step_seconds.size() / 4;
    const double first = obs::median({step_seconds.begin(), step_seconds.begin() + quarter});
    const double final = obs::median({step_seconds.end() - quarter, step_seconds.end()});
    report["step_ms_first_quarter"] = first * 1e3;
    report["step_ms_last_quarter"] = final * 1e3;
    fmt::print(
        "bench: drift: the first quarter of the timed steps {:.1f} ms, the last {:.1f} ms "
        "({:+.1f}%); the last quarter is {:.0f} tokens/s\n",
        first * 1e3, final * 1e3, 100 * (final / first - 1),
        static_cast<double>(tokens_per_step) / final);
  }
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& v = all[i];
    report["per_rank"].push_back({{"rank", i},
                                  {"host_cpu_cores", static_cast<double>(v[0]) / 1000},
                                  {"gpu_allocated_peak_gib", gib(v[1])},
                                  {"gpu_reserved_peak_gib", gib(v[2])},
                                  {"host_rss_peak_gib", gib(v[3])},
                                  {"gpu_device_used_gib", gib(v[4])}});
    fmt::print("bench: rank {}: host CPU {:.2f} cores, {}host RSS peak {:.1f} GiB\n", i,
               static_cast<double>(v[0]) / 1000,
               gpu ? fmt::format("GPU peak {:.1f} GiB allocated / {:.1f} GiB reserved, {:.1f} GiB "
                                 "in use on the device at the end, ",
                                 gib(v[1]), gib(v[2]), gib(v[4]))
                   : std::string(),
               gib(v[3]));
  }
  report["obs"] = c.obs;
  if (!bench.json_out.empty()) write_file_atomic(bench.json_out, report.dump(2) + "\n");
  if (!obs_report.empty()) fmt::print("\n{}", obs_report);
}

}  // namespace dflash::pipeline
