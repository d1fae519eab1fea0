// train: `dflash export`: the inference-engine format (config.json + bf16 model.safetensors,
// the tensor names SGLang, vLLM and z-lab's code load) from a training checkpoint (a step or
// run directory) or from another export directory.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include "models/drafter.h"
#include "tokenizer/tokenizer.h"

namespace dflash::train {

// The text of token `mask_token_id` in the target's tokenizer (dflash_config.mask_token);
// "<|MASK|>", the engines' default, for an id past the tokenizer's vocabulary.
std::string mask_token_text(const tok::Tokenizer& tokenizer, int64_t mask_token_id);

struct Export {
  models::DrafterConfig config;
  // The target the drafter serves: `target_dir`, else the run's run_config.json target; empty
  // when neither names one (an export of an export without --target).
  std::filesystem::path target;
};

// Writes the export of `source` into `out_dir`. `target_dir` (or, when empty, the target in a
// run's run_config.json) gives the mask token's text. `out_dir` must be
// new, empty or another drafter export; one holding other files takes the export only with
// `overwrite`, and one holding a target model (a config.json that is not a DFlash drafter's,
// or safetensors with an embedding or LM head) never does. Checked before anything is read.
// A drafter that taps the target's last layer (last_layer_tap_warning) is refused unless
// `allow_last_layer_tap`, before anything is written.
Export export_drafter(const std::filesystem::path& source, const std::filesystem::path& out_dir,
                      const std::filesystem::path& target_dir = {}, bool overwrite = false,
                      bool allow_last_layer_tap = false);

// The commands that serve `out_dir` with SGLang and vLLM beside `target` ("TARGET" when
// unknown), one per line.
std::string serving_commands(const Export& e, const std::filesystem::path& out_dir);

// A warning when the drafter taps the target's last decoder layer, else empty: SGLang and vLLM
// disagree on what "after layer L-1" is (before or after the final norm), so such a drafter
// may serve with a lower acceptance than eval measured.
std::string last_layer_tap_warning(const models::DrafterConfig& config);

}  // namespace dflash::train
