// models: the target's frozen token embedding and LM head on their own, for a trainer rank
// that does not run the target (disaggregated): read from the target checkpoint, not the
// whole model (an 8B target's head is 1.2 GB of its 16).
#pragma once
#include <ATen/ATen.h>

#include <filesystem>

#include "models/drafter.h"

namespace dflash::models {

// A loaded target's embedding and LM head, whole: a tensor-parallel target's vocabulary slices
// gathered from its group (a collective), for its colocated trainer.
TargetHead whole_target_head(const TargetModel& target);

// `dir`: the target's Hugging Face directory. A tied target's LM head is its embedding.
TargetHead load_target_head(const std::filesystem::path& dir, at::Device device,
                            at::ScalarType dtype);

}  // namespace dflash::models
