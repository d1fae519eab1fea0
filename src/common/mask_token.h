// common: the default MASK token, Qwen3's <|MASK|> (the id DFlash's Qwen3 drafters are trained
// with), in one place for the drafter's defaults, `dflash train` and its help.
#pragma once
#include <cstdint>

namespace dflash {

inline constexpr int64_t kQwen3MaskToken = 151669;

}  // namespace dflash
