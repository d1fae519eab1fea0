// train: `dflash export`: the inference-engine format (config.json + bf16 model.safetensors,
// the tensor names SGLang, vLLM and z-lab's code load) from a training checkpoint (a step or
// run directory) or from another export directory.
#pragma once
#include <filesystem>

namespace dflash::train {

void export_drafter(const std::filesystem::path& source, const std::filesystem::path& out_dir);

}  // namespace dflash::train
