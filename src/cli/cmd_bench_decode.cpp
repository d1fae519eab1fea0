// `dflash bench-decode`: decoding speed of a random-weight target (no files needed): batched
// greedy generation with and without the CUDA graph, split into prefill and decode, and the
// cost of one verify pass over a block of tokens against one plain decode step, from which
// the speed-up of speculative decoding at a given acceptance length can be read off, with the
// cost of one DFlash draft added to the verify pass; with --tree-budgets, tree verification's
// passes and their tau under synthetic acceptance; then the speculative decoder itself, its
// step measured at each batch against the plain step.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "cli/commands.h"
#include "common/error.h"
#include "common/file.h"
#include "common/option_range.h"
#include "eval/draft_tree.h"
#include "eval/generator.h"
#include "eval/speculative.h"
#include "kernels/block_attention.h"
#include "kernels/cluster_linear.h"
#include "kernels/wgmma_linear.h"
#include "models/drafter.h"
#include "models/target.h"
#include "obs/profile.h"
#include "obs/stats.h"

namespace dflash::cli {
namespace {

struct BenchDecodeOptions {
  std::string preset = "qwen3-8b";
  std::string config;  // a config.json whose shape replaces the preset's; empty: the preset
  std::string device;  // add_device_option
  int64_t prompt_len = 512;
  int64_t new_tokens = 256;
  std::vector<int64_t> batches = {1, 128};
  int64_t verify_tokens = 16;
  int warmup = 1;
  int iters = 3;
  std::string json_out;
  std::string profile;                // Chrome trace of the batch-1 decode step; empty: no profile
  std::vector<int64_t> tree_budgets;  // tree verification's budgets to estimate; empty: none
  double synthetic_top1 = 0.8;        // their synthetic acceptance (tree_table)
  bool window_rings = true;           // sliding layers cache only their windows (gpt-oss)
  int64_t per_token_attention_max = -1;  // models::set_per_token_attention_max_tokens; -1: keep
  bool block_attention = true;           // models::set_block_attention_kernel
  bool block_attention_128 = true;       // kernels::set_block_attention_wide_heads
  bool group_major_queries = true;       // models::set_group_major_queries
  bool cluster_linear = true;            // kernels::set_cluster_linear_enabled
  bool wgmma_linear = false;             // kernels::set_wgmma_linear_enabled
  bool wgmma_linear_fp8 = false;         // kernels::set_wgmma_linear_e4m3_enabled
  bool drafter_fp8 = false;              // models::DraftModel's fp8_weights
};

std::vector<std::vector<int64_t>> random_prompts(int64_t n, int64_t length, int64_t vocab,
                                                 uint64_t seed) {
  auto gen = models::seeded_generator(at::kCPU, seed);
  auto t = at::randint(vocab, {n, length}, gen, at::kLong);
  std::vector<std::vector<int64_t>> out;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = t[i].data_ptr<int64_t>();
    out.emplace_back(row, row + length);
  }
  return out;
}

// Median seconds of generating `max_new` tokens for every prompt, one Generator per call so
// that only one KV cache is held at a time.
struct GenerationTiming {
  double seconds = 0;
  bool graph = false;
};

GenerationTiming time_generation(const models::TargetModel& model,
                                 const std::vector<std::vector<int64_t>>& prompts, int64_t max_new,
                                 int64_t context, bool graph, const BenchDecodeOptions& o) {
  eval::GenerationOptions g;
  g.slots = static_cast<int64_t>(prompts.size());
  g.max_new_tokens = max_new;
  g.context = context;
  g.cuda_graph = graph;
  g.window_rings = o.window_rings;
  eval::Generator generator(model, g);
  auto times = obs::time_steps(model.device(), o.warmup, o.iters, [&] {
    auto out = generator.generate(prompts);
    for (const auto& c : out) {
      if (static_cast<int64_t>(c.tokens.size()) != max_new) {
        fail("bench-decode: a sequence ended after {} of {} tokens", c.tokens.size(), max_new);
      }
    }
  });
  return {obs::median(times), generator.uses_cuda_graph()};
}

// The default DFlash drafter for `model` with blocks of --verify-tokens, random weights.
models::Drafter random_drafter(const models::TargetModel& model, const BenchDecodeOptions& o) {
  models::DrafterOptions d;
  d.block_size = o.verify_tokens;
  d.mask_token_id = model.config().vocab_size - 1;
  return models::Drafter::random(models::make_drafter_config(model.config(), d), model.device(), 3);
}

// Milliseconds of one speculative step at batch `prompts.size()`: the decode of `max_new`
// tokens per prompt less the prefill and first token alone, over the verify steps per slot.
struct SpeculativeTiming {
  double step_ms = 0, tau = 0;
  double prefill_ms = 0;  // the requests' prefill and first tokens alone (what eval pays each)
  bool whole_step_graph = false;
};

SpeculativeTiming time_speculative(const models::TargetModel& model, const models::Drafter& drafter,
                                   const std::vector<std::vector<int64_t>>& prompts,
                                   int64_t max_new, int64_t context, bool whole,
                                   int64_t tree_budget, const BenchDecodeOptions& o,
                                   const std::string& trace = "", bool late = true) {
  auto run = [&](int64_t tokens) {
    eval::DFlashDraftSource source(drafter, model, 0, o.drafter_fp8);
    eval::SpeculativeOptions s;
    s.slots = static_cast<int64_t>(prompts.size());
    s.max_new_tokens = tokens;
    s.context = context;
    s.whole_step = whole;
    s.late_verdicts = late;
    s.tree_budget = tree_budget;
    s.window_rings = o.window_rings;
    eval::SpeculativeDecoder decoder(model, source, s);
    eval::SpeculativeStats stats;
    auto times = obs::time_steps(model.device(), o.warmup, o.iters,
                                 [&] { decoder.generate(prompts, &stats); });
    if (!trace.empty() && tokens > 1) {
      // Per step, the prefill included (it runs once per request).
      const auto p = obs::profile_device(
          [&] {
            decoder.generate(prompts);
            obs::synchronize(model.device());
          },
          static_cast<int>(stats.verify_steps / s.slots), trace);
      fmt::print("profile of the speculative decoder at batch {}, per step (trace: {}):\n{}",
                 s.slots, trace, obs::format_profile(p, 25));
    }
    return std::tuple(obs::median(times), stats, decoder.captures_whole_step());
  };
  const double first_s = std::get<0>(run(1));
  const auto [full_s, stats, captured] = run(max_new);
  const double steps =
      static_cast<double>(stats.verify_steps) / static_cast<double>(prompts.size());
  return {(full_s - first_s) / steps * 1e3, stats.tau(), first_s * 1e3, captured};
}

// Generation at each batch with and without the CUDA graph: one JSON row each; the fastest
// plain step per batch goes to `plain_step_ms`.
nlohmann::json generation_table(const models::TargetModel& model, const BenchDecodeOptions& o,
                                int64_t context, std::map<int64_t, double>& plain_step_ms) {
  const auto& config = model.config();
  const at::Device device = model.device();
  fmt::print("{:>6} {:>6} {:>12} {:>12} {:>14} {:>12} {:>16}\n", "batch", "graph", "prefill ms",
             "decode ms", "ms/step", "decode tok/s", "end-to-end tok/s");
  nlohmann::json rows = nlohmann::json::array();
  const bool graph_possible = device.is_cuda();
  for (int64_t b : o.batches) {
    auto prompts = random_prompts(b, o.prompt_len, config.vocab_size, 1);
    for (bool graph : graph_possible ? std::vector<bool>{true, false} : std::vector<bool>{false}) {
      // Prefill and the first token alone, then the whole run: the difference is the decode.
      auto first = time_generation(model, prompts, 1, context, graph, o);
      auto full = time_generation(model, prompts, o.new_tokens, context, graph, o);
      const double decode_s = full.seconds - first.seconds;
      const int64_t steps = o.new_tokens - 1;
      const double step_ms = decode_s / steps * 1e3;
      if (!plain_step_ms.contains(b) || step_ms < plain_step_ms[b]) plain_step_ms[b] = step_ms;
      const double decode_tps = b * steps / decode_s;
      const double e2e_tps = b * o.new_tokens / full.seconds;
      fmt::print("{:>6} {:>6} {:>12.2f} {:>12.1f} {:>14.3f} {:>12.0f} {:>16.0f}\n", b,
                 full.graph ? "on" : "off", first.seconds * 1e3, decode_s * 1e3,
                 decode_s / steps * 1e3, decode_tps, e2e_tps);
      rows.push_back({{"batch", b},
                      {"cuda_graph", full.graph},
                      {"prefill_and_first_token_ms", first.seconds * 1e3},
                      {"decode_ms", decode_s * 1e3},
                      {"decode_step_ms", decode_s / steps * 1e3},
                      {"decode_tokens_per_s", decode_tps},
                      {"end_to_end_tokens_per_s", e2e_tps}});
    }
  }

  return rows;
}

// The speculative decoder itself at each batch, one JSON row per batch and step kind.
nlohmann::json measured_speculative(const models::TargetModel& model, const BenchDecodeOptions& o,
                                    int64_t context,
                                    const std::map<int64_t, double>& plain_step_ms) {
  const auto& config = model.config();
  // The speculative decoder itself at each batch, the same drafter: tau is about 1 with
  // random weights, so each step drafts and verifies a whole block and commits one token, the
  // plain decoder's rate; the whole step (one graph where captured), its verdicts read one step
  // late and read at once, against the split one (the drafter eager, the verify captured).
  nlohmann::json measured = nlohmann::json::array();
  if (o.verify_tokens >= 2) {
    const auto drafter = random_drafter(model, o);
    fmt::print(
        "speculative decoder, measured ({} new tokens per prompt, blocks of {}, random drafter: "
        "tau about 1):\n{:>6} {:>10} {:>14} {:>14} {:>14} {:>8} {:>12}\n",
        o.new_tokens, o.verify_tokens, "batch", "step", "ms/step", "plain ms/step", "x plain",
        "tau", "prefill ms");
    for (int64_t b : o.batches) {
      auto prompts = random_prompts(b, o.prompt_len, config.vocab_size, 1);
      for (const auto& [whole, late] : {std::pair{true, true}, {true, false}, {false, false}}) {
        const bool profiled = !o.profile.empty() && whole && late && b == o.batches.back();
        const auto t = time_speculative(model, drafter, prompts, o.new_tokens,
                                        context + o.verify_tokens, whole, /*tree_budget=*/0, o,
                                        profiled ? o.profile + ".speculative" : "", late);
        const double plain = plain_step_ms.at(b);
        const std::string kind = !whole               ? "split"
                                 : t.whole_step_graph ? (late ? "graph" : "graph sync")
                                                      : (late ? "whole" : "whole sync");
        fmt::print("{:>6} {:>10} {:>14.3f} {:>14.3f} {:>14.2f} {:>8.2f} {:>12.2f}\n", b, kind,
                   t.step_ms, plain, t.step_ms / plain, t.tau, t.prefill_ms);
        measured.push_back({{"batch", b},
                            {"step", kind},
                            {"speculative_step_ms", t.step_ms},
                            {"plain_step_ms", plain},
                            {"over_plain", t.step_ms / plain},
                            {"prefill_and_first_token_ms", t.prefill_ms},
                            {"tau", t.tau}});
      }
    }
  }
  return measured;
}

// Tree verification at this shape with synthetic acceptance (--tree-budgets): a calibrated
// drafter whose ranked tokens carry probabilities p (1 - p)^r at every position (p:
// --synthetic-top1) and a target whose token at each position is drawn from that same
// distribution, positions independent. tau of the chain and of each budget's tree (the same
// tree every step: build_draft_tree of those probabilities) comes from simulated steps; each
// one's step is the speculative decoder's own at batch 1 (random drafter, captured where the
// decoder captures, the tree built on the host every step), so a budget's speed-up is
// estimated as tau x plain step / speculative step.
nlohmann::json tree_table(const models::TargetModel& model, const BenchDecodeOptions& o,
                          int64_t context, double plain_step_ms) {
  const int64_t positions = o.verify_tokens - 1, steps = 20000;
  const double p = o.synthetic_top1;
  std::mt19937_64 gen(7);
  std::geometric_distribution<int64_t> rank(p);
  // Each simulated step's target tokens, as ranks under the drafter (0: its argmax).
  std::vector<std::vector<int64_t>> truth(steps, std::vector<int64_t>(positions));
  for (auto& t : truth) {
    for (auto& r : t) r = rank(gen);
  }
  const auto& config = model.config();
  const auto drafter = random_drafter(model, o);
  const auto prompts = random_prompts(1, o.prompt_len, config.vocab_size, 1);
  fmt::print(
      "tree verification, batch 1 at {} prompt tokens: tau under synthetic acceptance (each "
      "position's draft ranks r with probability p(1-p)^r, p = {}; the target's token drawn "
      "alike), the decoder's step measured (random drafter, {} new tokens):\n"
      "{:>8} {:>8} {:>8} {:>12} {:>10} {:>14}\n",
      o.prompt_len, p, o.new_tokens, "budget", "nodes", "tau", "step ms", "x plain",
      "est. speed-up");
  nlohmann::json rows = nlohmann::json::array();
  auto row = [&](int64_t budget, int64_t nodes, double tau) {
    const auto t = time_speculative(model, drafter, prompts, o.new_tokens,
                                    context + std::max(o.verify_tokens, nodes),
                                    /*whole=*/true, budget, o);
    const double speedup = tau * plain_step_ms / t.step_ms;
    fmt::print("{:>8} {:>8} {:>8.3f} {:>12.3f} {:>10.2f} {:>13.2f}x\n",
               budget > 0 ? std::to_string(budget) : "chain", nodes, tau, t.step_ms,
               t.step_ms / plain_step_ms, speedup);
    rows.push_back({{"tree_budget", budget},
                    {"verified_tokens", nodes},
                    {"tau", tau},
                    {"speculative_step_ms", t.step_ms},
                    {"plain_step_ms", plain_step_ms},
                    {"estimated_speedup", speedup}});
  };
  double chain_tokens = 0;
  for (const auto& t : truth) {
    int64_t a = 0;
    while (a < positions && t[a] == 0) ++a;
    chain_tokens += static_cast<double>(a + 1);
  }
  row(0, o.verify_tokens, chain_tokens / steps);
  for (int64_t budget : o.tree_budgets) {
    const int64_t k = std::min(budget, config.vocab_size);
    auto ranks = at::arange(k, at::kLong).expand({positions, k}).contiguous();
    auto probs = p * at::pow(1.0 - p, ranks.to(at::kDouble));
    const eval::DraftTree tree = eval::build_draft_tree(-1, probs, ranks, budget);
    double tokens = 0;
    std::vector<int64_t> choices(tree.size());
    for (const auto& t : truth) {
      for (int64_t j = 0; j < tree.size(); ++j) {
        choices[j] = tree.depths[j] < positions ? t[tree.depths[j]] : -1;
      }
      tokens += static_cast<double>(tree.walk(choices).size() + 1);
    }
    row(budget, tree.size(), tokens / steps);
  }
  return rows;
}

void run_bench_decode(const BenchDecodeOptions& o) {
  const at::Device device = device_option(o.device);
  if (!o.profile.empty() && !device.is_cuda()) fail("bench-decode: --profile needs a CUDA device");
  models::set_block_attention_kernel(o.block_attention);
  kernels::set_block_attention_wide_heads(o.block_attention_128);
  models::set_group_major_queries(o.group_major_queries);
  kernels::set_cluster_linear_enabled(o.cluster_linear);
  kernels::set_wgmma_linear_enabled(o.wgmma_linear);
  kernels::set_wgmma_linear_e4m3_enabled(o.wgmma_linear_fp8);
  if (o.per_token_attention_max >= 0) {
    models::set_per_token_attention_max_tokens(o.per_token_attention_max);
  }
  auto config =
      o.config.empty() ? models::preset_config(o.preset) : models::load_model_config(o.config);
  const auto dtype = device.is_cuda() ? at::kBFloat16 : at::kFloat;
  auto model = models::TargetModel::random(config, device, dtype, 0);
  const int64_t context = o.prompt_len + o.new_tokens;
  if (o.new_tokens < 2) fail("bench-decode: --new-tokens must be at least 2");
  const std::string shape = o.config.empty() ? o.preset : o.config;
  fmt::print(
      "bench-decode: {} ({:.2f} B params), {} on {}, prompt {} tokens, {} new tokens, warmup {}, "
      "iters {} (medians)\n",
      shape, config.num_parameters() / 1e9, c10::toString(dtype), device.str(), o.prompt_len,
      o.new_tokens, o.warmup, o.iters);
  std::map<int64_t, double> plain_step_ms;  // per batch, the fastest of graph and eager
  const nlohmann::json rows = generation_table(model, o, context, plain_step_ms);

  // One slot holding the prompt; each timed pass appends tokens and is cropped away again.
  if (o.verify_tokens < 1 || o.verify_tokens > o.prompt_len) {
    fail("bench-decode: --verify-tokens must be in [1, --prompt-len]");
  }
  for (int64_t budget : o.tree_budgets) {
    if (budget < 1 || budget + 1 > o.prompt_len || o.verify_tokens < 2) {
      fail(
          "bench-decode: --tree-budgets takes budgets in [1, --prompt-len - 1] with a block "
          "(--verify-tokens) of at least 2, got {}",
          budget);
    }
  }
  if (!o.tree_budgets.empty() &&
      std::find(o.batches.begin(), o.batches.end(), 1) == o.batches.end()) {
    fail("bench-decode: --tree-budgets compares steps at batch 1: --batches must include 1");
  }
  if (!o.tree_budgets.empty() && config.is_hybrid()) {
    fail("bench-decode: --tree-budgets: {}'s linear-attention layers cannot verify trees", shape);
  }
  models::KVCache cache = model.make_cache(1, o.prompt_len + o.verify_tokens);
  // A hybrid's linear states go back to the prompt's from the pass's block buffers.
  cache.keep_block_states(o.verify_tokens);
  auto prompt = at::tensor(random_prompts(1, o.prompt_len, config.vocab_size, 2)[0]).to(device);
  model.forward_cached(prompt, models::AppendBatch::make(cache, {0}, {o.prompt_len}), cache, {});
  const models::ForwardRequest verify{
      .tap_layers = {}, .logits = models::Logits::kAll, .keep_block_states = true};
  auto pass_ms = [&](int64_t n) {
    auto tokens = prompt.narrow(0, 0, n);
    auto times = obs::time_steps(device, o.warmup + 2, o.iters * 5, [&] {
      auto batch = models::AppendBatch::make(cache, {0}, {n});
      auto out = model.forward_cached(tokens, batch, cache, verify);
      out.logits.argmax(-1);
      cache.crop(0, o.prompt_len);
    });
    return obs::median(times) * 1e3;
  };
  const double step_ms = pass_ms(1), verify_ms = pass_ms(o.verify_tokens);
  nlohmann::json profile, verify_profile;
  if (!o.profile.empty()) {
    // Eager, so the kernels show; the graph replays the same kernels without the launch gaps.
    // The plain step (trace at --profile) and the verify pass (trace beside it, ".verify").
    auto profile_pass = [&](int64_t n, const std::string& trace) {
      constexpr int kProfiled = 10;
      auto tokens = prompt.narrow(0, 0, n);
      auto p = obs::profile_device(
          [&] {
            for (int i = 0; i < kProfiled; ++i) {
              auto batch = models::AppendBatch::make(cache, {0}, {n});
              model.forward_cached(tokens, batch, cache, verify).logits.argmax(-1);
              cache.crop(0, o.prompt_len);
            }
            obs::synchronize(device);
          },
          kProfiled, trace);
      fmt::print(
          "profile of one batch-1 pass of {} tokens at {} cached tokens (eager; trace: {}):\n{}", n,
          o.prompt_len, trace, obs::format_profile(p, 20));
      return obs::profile_json(p);
    };
    profile = profile_pass(1, o.profile);
    if (o.verify_tokens > 1) verify_profile = profile_pass(o.verify_tokens, o.profile + ".verify");
  }
  fmt::print(
      "speculative, batch 1 at {} cached tokens (eager): plain decode step {:.3f} ms, verify of "
      "{} tokens {:.3f} ms ({:.2f}x a step)\n",
      o.prompt_len, step_ms, o.verify_tokens, verify_ms, verify_ms / step_ms);
  // The draft of one block (the default DFlash drafter for this target, random weights) with
  // the same cached context: draft + verify is one speculative step, which commits tau
  // tokens where a plain step commits one.
  double draft_ms = 0;
  if (o.verify_tokens >= 2) {
    const auto drafter = random_drafter(model, o);
    models::DraftModel draft_model(drafter, models::TargetHead::of(model), dtype);
    auto draft_cache = draft_model.make_cache(1, o.prompt_len);
    const int64_t width = drafter.config().num_taps() * config.hidden_size;
    draft_model.extend(draft_cache, {0}, {o.prompt_len},
                       at::randn({o.prompt_len, width}, prompt.options().dtype(dtype)));
    auto last = prompt.narrow(0, 0, 1);
    auto times = obs::time_steps(device, o.warmup + 2, o.iters * 5,
                                 [&] { draft_model.draft(draft_cache, {0}, last); });
    draft_ms = obs::median(times) * 1e3;
    const double spec_ms = draft_ms + verify_ms;
    fmt::print(
        "  draft of {} tokens ({} drafter layers) {:.3f} ms; speculative step (draft + verify) "
        "{:.3f} ms = {:.2f}x a plain step: speed-up tau x {:.3f} (tau 3: {:.2f}x, 5: {:.2f}x, 7: "
        "{:.2f}x)\n",
        o.verify_tokens - 1, drafter.config().layers.num_layers, draft_ms, spec_ms,
        spec_ms / step_ms, step_ms / spec_ms, 3 * step_ms / spec_ms, 5 * step_ms / spec_ms,
        7 * step_ms / spec_ms);
  }
  const nlohmann::json measured = measured_speculative(model, o, context, plain_step_ms);
  const nlohmann::json trees = o.tree_budgets.empty()
                                   ? nlohmann::json()
                                   : tree_table(model, o, context, plain_step_ms.at(1));
  nlohmann::json doc = {{"preset", shape},
                        {"window_rings", o.window_rings},
                        {"device", device.str()},
                        {"prompt_len", o.prompt_len},
                        {"new_tokens", o.new_tokens},
                        {"generation", rows},
                        {"speculative",
                         {{"cached_tokens", o.prompt_len},
                          {"decode_step_ms", step_ms},
                          {"verify_tokens", o.verify_tokens},
                          {"verify_ms", verify_ms},
                          {"verify_over_step", verify_ms / step_ms},
                          {"draft_ms", draft_ms},
                          {"speculative_step_ms", draft_ms + verify_ms},
                          {"speculative_step_over_step", (draft_ms + verify_ms) / step_ms}}}};
  doc["speculative_measured"] = measured;
  if (!trees.is_null()) doc["tree_synthetic"] = trees;
  if (!profile.is_null()) doc["decode_step_profile"] = profile;
  if (!verify_profile.is_null()) doc["verify_profile"] = verify_profile;
  if (!o.json_out.empty()) write_file_atomic(o.json_out, doc.dump(2));
}

}  // namespace

void add_bench_decode_command(CLI::App& app) {
  auto o = std::make_shared<BenchDecodeOptions>();
  auto* cmd = app.add_subcommand(
      "bench-decode", "Measure target decoding speed and the verify-pass cost (random weights)");
  add_preset_option(*cmd, o->preset, "model shape");
  add_device_option(*cmd, o->device);
  cmd->add_option("--config", o->config,
                  "a model's config.json: its shape, with random weights, instead of --preset "
                  "(e.g. a small trained target's, whose steps are launch-bound)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--prompt-len", o->prompt_len, "prompt tokens per sequence")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--new-tokens", o->new_tokens, "generated tokens per sequence")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--batches", o->batches, "sequences decoded together, one run each")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--verify-tokens", o->verify_tokens, "block size of the verify pass")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_flag("--no-window-rings{false}", o->window_rings,
                "sliding-window layers cache the whole sequence, as full-attention ones do "
                "(gpt-oss; the default keeps a ring of their window)");
  cmd->add_option("--per-token-attention-max", o->per_token_attention_max,
                  "blocks of at most this many new tokens in all attend as one-query sequences "
                  "(flash's split-KV path; 0: never; default: the built-in setting)")
      ->check(kNonNegative.validator());
  cmd->add_flag("--drafter-fp8", o->drafter_fp8,
                "the drafter's projections and LM head as e4m3 weights and FP8 GEMMs");
  cmd->add_flag("--no-block-attention{false}", o->block_attention,
                "blocks of at most 16 tokens per sequence attend through flash (or per token) "
                "instead of kernels/block_attention");
  cmd->add_flag("--no-block-attention-128{false}", o->block_attention_128,
                "heads of 128 (Qwen3-8B) attend through flash (or per token) instead of "
                "kernels/block_attention's split kernel");
  cmd->add_flag("--no-cluster-linear{false}", o->cluster_linear,
                "the FP8 drafter's GEMMs at a block's 1-16 rows through cuBLASLt instead of "
                "kernels/cluster_linear");
  cmd->add_flag("--wgmma-linear", o->wgmma_linear,
                "the bf16 linears at a block's 2-16 rows (the target's verify pass, a bf16 "
                "drafter) through kernels/wgmma_linear instead of cuBLAS");
  cmd->add_flag("--wgmma-linear-fp8", o->wgmma_linear_fp8,
                "the FP8 drafter's GEMMs at a block's 1-16 rows through kernels/wgmma_linear "
                "instead of kernels/cluster_linear (or cuBLASLt)");
  cmd->add_flag("--no-group-major-queries{false}", o->group_major_queries,
                "per-token attention (target verify, drafter block) takes q head-major, which "
                "flash regroups, instead of group-major from the q/k norm kernel");
  cmd->add_option("--warmup", o->warmup, "untimed runs first")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--iters", o->iters, "timed runs; the median is reported")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--tree-budgets", o->tree_budgets,
                  "tree verification budgets whose tau (synthetic acceptance) and verify pass "
                  "to measure against the chain's, e.g. 16,32,64 (default: none)")
      ->delimiter(',');
  cmd->add_option("--synthetic-top1", o->synthetic_top1,
                  "the synthetic drafter's top-1 accuracy at every position for --tree-budgets")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 0.99));
  add_json_option(*cmd, o->json_out, "the results");
  cmd->add_option("--profile", o->profile,
                  "profile the batch-1 decode step and verify pass (CUDA) and write their Chrome "
                  "traces here (the verify pass's with .verify added)");
  cmd->callback([o] { run_bench_decode(*o); });
}

}  // namespace dflash::cli
