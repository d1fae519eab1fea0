// common: the default MASK token, Qwen3's <|MASK|> (the id DFlash's Qwen3 drafters are trained
// with), in one place for the drafter's defaults, `dflash train` and its help, the built-in
// tokenizer and the export.
#pragma once
#include <cstdint>

namespace dflash {

inline constexpr int64_t kQwen3MaskToken = 151669;
// Its text, which engines assume for a drafter export without dflash_config.mask_token.
inline constexpr const char* kQwen3MaskText = "<|MASK|>";

}  // namespace dflash
