// The launch of small_linear's tensor-core kernel, between small_linear.cpp (checks, fallbacks)
// and small_linear_mma.cu (the kernel). Not part of the kernels' interface.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>

namespace dflash::kernels {

struct SmallLinearMmaArgs {
  const void* x = nullptr;  // [rows, K], rows x_stride_bytes apart, 16-byte aligned
  int64_t x_stride_bytes = 0;
  int64_t rows = 0;         // 1 to kSmallLinearMmaMaxRows
  const void* w = nullptr;  // [n, K] contiguous, 16-byte aligned
  int64_t k_bytes = 0;      // K in bytes, a multiple of 16
  int64_t n = 0;
  const float* x_scale = nullptr;  // e4m3 operands: [rows] and [n]
  const float* w_scale = nullptr;
  const void* bias = nullptr;  // [n] in the output's dtype, or null
  void* y = nullptr;           // [rows, n] contiguous: the operands' dtype, bf16 for e4m3
  at::ScalarType operands = at::kBFloat16;  // bf16, fp16 or e4m3
  int64_t warps = 1;                        // small_linear_mma_warps
  c10::DeviceIndex device = 0;
};

// Warps a block (16 features each) for n output features: features_per_block / 16 where it is
// given (16, 32 or 64), else chosen for the device.
int64_t small_linear_mma_warps(int64_t n, int64_t features_per_block, int device);
void small_linear_mma_cuda(const SmallLinearMmaArgs& args);

}  // namespace dflash::kernels
