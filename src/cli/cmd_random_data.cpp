// `dflash random-data --out DIR --samples N --length L --prompt P --vocab V`: a prepared
// dataset of random tokens (prompt unsupervised, the rest supervised) in the format `dflash
// prepare` writes, for runs and benchmarks that need data but no tokenizer.
#include <fmt/format.h>

#include <memory>
#include <string>

#include "cli/commands.h"
#include "common/option_range.h"
#include "data/random_dataset.h"

namespace dflash::cli {

void add_random_data_command(CLI::App& app) {
  auto o = std::make_shared<data::RandomDatasetOptions>();
  auto out = std::make_shared<std::string>();
  auto* cmd = app.add_subcommand("random-data",
                                 "Write a prepared dataset of random tokens (no tokenizer needed)");
  add_out_option(*cmd, *out, "output directory");
  cmd->add_option("--samples", o->samples, "number of samples")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--length", o->length, "tokens per sample")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--length-jitter", o->length_jitter,
                  "each sample's length is uniform in [length - J, length + J]")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--prompt", o->prompt, "leading tokens of each sample that are unsupervised")
      ->capture_default_str()
      ->check(kNonNegative.validator());
  cmd->add_option("--vocab", o->vocab, "token ids are uniform below this")
      ->required()
      ->check(kAtLeastOne.validator());
  cmd->add_option("--seed", o->seed, "seed (the same seed writes the same bytes)")
      ->capture_default_str();
  cmd->add_option("--shard-tokens", o->shard_tokens, "tokens per shard file")
      ->capture_default_str()
      ->check(kAtLeastOne.validator());
  cmd->add_flag("--overwrite", o->overwrite, "replace a prepared dataset in --out");
  cmd->callback([o, out] {
    o->out_dir = *out;
    auto s = data::write_random_dataset(*o);
    fmt::print(
        "random-data: {} samples, {} tokens ({} supervised, vocab {}) in {} shard(s) in {}\n",
        o->samples, s.tokens, s.loss_tokens, o->vocab, s.shards, *out);
  });
}

}  // namespace dflash::cli
