// kernels: the steps block_attention's two kernels share over an mma.sync score tile (fragment
// layout in mma.cuh): this thread's rows g and g + 8, their running maxima in the log2 domain.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/float_cast.cuh"

namespace dflash::kernels {

// Two values rounded to T (bf16 or fp16), the lower in the low half: one A or B register.
template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&a)) |
         (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&b)) << 16);
}

// Online softmax over one more tile, as flash steps over its tiles: tile_max holds this
// thread's share of each row's tile maximum and becomes the row's new shift (the quad's maximum
// with the running one); m advances to it; alpha is the factor that rescales the row's running
// sum and output. A row that has seen nothing yet keeps m = -inf, shift 0, and every p zero.
__device__ __forceinline__ void online_softmax_step(float (&tile_max)[2], float (&m)[2],
                                                    float (&alpha)[2]) {
  for (int i = 0; i < 2; ++i) {
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
    tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
    const float m_new = fmaxf(m[i], tile_max[i]);
    const float shift = m_new == -INFINITY ? 0.f : m_new;
    alpha[i] = exp2f(m[i] - shift);
    m[i] = m_new;
    tile_max[i] = shift;
  }
}

}  // namespace dflash::kernels
