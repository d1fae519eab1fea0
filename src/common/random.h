// common: the one random generator for draws that must be identical on every platform and
// after a resume (data order, anchors). std:: engines are specified but std:: distributions
// are not, and ATen's generators are device-dependent, so this is written out in full.
#pragma once
#include <cstdint>

namespace dflash {

// splitmix64 (Steele, Lea and Flood; Vigna's constants): adds the golden-ratio increment to
// `state` and returns the mixed result.
inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [0, bound), bound > 0, from splitmix64 draws of `state`. Lemire's multiply-shift
// with rejection: a plain `% bound` favours small values whenever bound does not divide 2^64.
inline uint64_t uniform_below(uint64_t& state, uint64_t bound) {
  unsigned __int128 m = static_cast<unsigned __int128>(splitmix64(state)) * bound;
  auto low = static_cast<uint64_t>(m);
  if (low < bound) {
    const uint64_t threshold = (0 - bound) % bound;
    while (low < threshold) {
      m = static_cast<unsigned __int128>(splitmix64(state)) * bound;
      low = static_cast<uint64_t>(m);
    }
  }
  return static_cast<uint64_t>(m >> 64);
}

}  // namespace dflash
