#include "pipeline/job.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.h"
#include "common/mask_token.h"

namespace dflash::pipeline {

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
  const int tp = static_cast<int>(c.target_tp);
  if (c.target_ep && tp == 1) fail("--target-ep needs --target-tp T > 1 (the ranks to split over)");
  if (tp > 1) {
    if (r.topology.disaggregated() && r.topology.targets % tp != 0) {
      fail("--target-tp {} must divide --target-ranks {} (the target ranks form groups of {})", tp,
           r.topology.targets, tp);
    }
    if (!r.topology.disaggregated() && r.world.world_size % tp != 0) {
      fail("--target-tp {} must divide the {} ranks (--nproc-per-node, torchrun)", tp,
           r.world.world_size);
    }
    // What a tensor-parallel target does not do yet: it needs whole target layers on a rank.
    if (!c.init_from_target_layers.empty()) {
      fail("--init-from-target-layers needs --target-tp 1 (whole target layers)");
    }
  }
  dist::CommOptions co;
  co.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_s * 1000));
  r.comm = dist::Comm::create(r.world, r.device, co);
  if (r.topology.disaggregated()) r.topology.group = tp;
  // Groups of tp consecutive ranks: every rank colocated, the target ranks disaggregated.
  const int grouped = r.topology.disaggregated() ? r.topology.trainers : 0;
  if (tp > 1 && r.world.rank >= grouped) {
    const int first = grouped + (r.world.rank - grouped) / tp * tp;
    std::vector<int> ranks;
    for (int i = first; i < first + tp; ++i) ranks.push_back(i);
    r.target_group = r.comm->subgroup(ranks, fmt::format("target_tp_{}", (first - grouped) / tp));
  }
  if (r.topology.disaggregated() && r.trains()) {
    std::vector<int> ranks;
    for (int i = 0; i < r.topology.trainers; ++i) ranks.push_back(i);
    r.trainers = r.comm->subgroup(ranks, "trainers");
  }
  return r;
}

models::DrafterConfig drafter_config(const RunConfig& c, const models::ModelConfig& tc,
                                     bool announce) {
  models::DrafterOptions o;
  o.num_layers = c.drafter_layers;
  o.target_layer_ids = c.target_layer_ids;
  o.block_size = c.block_size;
  o.sliding_window = c.drafter_sliding_window;
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

void broadcast_drafter(Job& job) {
  if (job.rank.data_parallel().size() <= 1) return;
  auto params = job.drafter->parameters();
  c10::NoGradGuard no_grad;
  job.rank.data_parallel().broadcast(params, 0, "drafter_init_broadcast");
}

Choices parse_choices(const RunConfig& c) {
  Choices p;
  p.attention = models::parse_drafter_attention(c.drafter_attention, "drafter_attention");
  p.head_grad = train::parse_head_grad(c.head_grad, "head_grad");
  p.drafter_gemms = train::parse_drafter_gemms(c.drafter_gemms, "drafter_gemms");
  p.prefill_gemms = models::parse_prefill_gemms(c.prefill_gemms);
  return p;
}

void resolve(Job& job, const std::filesystem::path& run_dir) {
  const RunConfig& c = job.config;
  const Rank& r = job.rank;
  job.choices = job.requested;
  if (!r.trains()) return;
  Choices& d = job.choices;
  d.attention = models::resolve_drafter_attention(d.attention, r.device, r.dtype);
  d.head_grad = train::resolve_head_grad(d.head_grad, job.head.lm_head, r.dtype);
  d.drafter_gemms =
      train::resolve_drafter_gemms(d.drafter_gemms, job.drafter->config(), r.device, r.dtype);
  train::TrainerOptions& to = job.trainer;
  to = trainer_options(c, job.steps);
  to.step.dtype = r.dtype;
  to.step.attention = d.attention;
  to.step.head_grad = d.head_grad;
  to.step.drafter_gemms = d.drafter_gemms;
  to.checkpoint_dir = run_dir;
  to.write_checkpoints = r.leads();
  to.checkpoint_every = c.checkpoint_every;
  to.keep_last = c.keep_last;
  to.allreduce_bucket_bytes = static_cast<int64_t>(c.allreduce_bucket_mb * (1 << 20));
}

train::TrainerOptions trainer_options(const RunConfig& c, int64_t total_steps) {
  train::TrainerOptions to;
  to.lr = c.lr;
  to.min_lr = c.min_lr;
  to.warmup_ratio = c.warmup_ratio;
  to.total_steps = total_steps;
  to.adamw.weight_decay = c.weight_decay;
  to.clip_norm = c.clip_norm;
  to.accumulation = c.accumulation;
  to.seed = static_cast<uint64_t>(c.seed);
  return to;
}

StreamOptions stream_options_of(const RunConfig& c) {
  StreamOptions so;
  so.batch_size = c.batch_size;
  so.accumulation = c.accumulation;
  so.max_seq_len = c.max_seq_len;
  so.anchors.max_anchors = c.max_anchors;
  so.anchors.seed = static_cast<uint64_t>(c.seed);
  return so;
}

int64_t total_steps(const RunConfig& c, int64_t batches_per_epoch) {
  if (c.steps > 0) return c.steps;
  const double steps = std::ceil(c.epochs * static_cast<double>(batches_per_epoch) /
                                 static_cast<double>(c.accumulation));
  return std::max<int64_t>(static_cast<int64_t>(steps), 1);
}

}  // namespace dflash::pipeline
