#include "kernels/mxfp4.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>

#include "common/error.h"

namespace dflash::kernels {

// mxfp4.cu
void mxfp4_dequantize_cuda(at::Tensor& out, const at::Tensor& blocks, const at::Tensor& scales);

namespace {

constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

template <typename T>
void dequantize_rows(const uint8_t* blocks, const uint8_t* scales, T* out, int64_t groups) {
  at::parallel_for(0, groups, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int exponent = static_cast<int>(scales[g]) - 127;
      for (int b = 0; b < 16; ++b) {
        const uint8_t byte = blocks[g * 16 + b];
        out[g * 32 + 2 * b] = T(std::ldexp(kE2m1[byte & 0x0f], exponent));
        out[g * 32 + 2 * b + 1] = T(std::ldexp(kE2m1[byte >> 4], exponent));
      }
    }
  });
}

void check(const at::Tensor& blocks, const at::Tensor& scales) {
  if (blocks.scalar_type() != at::kByte || scales.scalar_type() != at::kByte) {
    fail("mxfp4: blocks and scales must be uint8, got {} and {}",
         c10::toString(blocks.scalar_type()), c10::toString(scales.scalar_type()));
  }
  if (blocks.dim() < 2 || blocks.size(-1) != 16 ||
      scales.sizes() != blocks.sizes().slice(0, blocks.dim() - 1)) {
    fail("mxfp4: blocks must be [..., G, 16] and scales [..., G] alike, got {} and {}",
         blocks.sizes(), scales.sizes());
  }
  if (blocks.device() != scales.device()) fail("mxfp4: blocks and scales on different devices");
}

}  // namespace

int64_t mxfp4_bytes(int64_t values) { return values / 2 + values / 32; }

void mxfp4_dequantize_out(at::Tensor& out, const at::Tensor& blocks, const at::Tensor& scales) {
  check(blocks, scales);
  auto shape = scales.sizes().vec();
  shape.back() *= 32;
  if (out.sizes() != at::IntArrayRef(shape) || !out.is_contiguous() ||
      out.device() != blocks.device()) {
    fail("mxfp4: the output must be a contiguous {} on {}, got {} on {}", at::IntArrayRef(shape),
         blocks.device().str(), out.sizes(), out.device().str());
  }
  const auto b = blocks.contiguous(), s = scales.contiguous();
  if (out.is_cuda()) return mxfp4_dequantize_cuda(out, b, s);
  const int64_t groups = s.numel();
  switch (out.scalar_type()) {
    case at::kFloat:
      return dequantize_rows(b.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), out.data_ptr<float>(),
                             groups);
    case at::kBFloat16:
      return dequantize_rows(b.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(),
                             out.data_ptr<c10::BFloat16>(), groups);
    case at::kHalf:
      return dequantize_rows(b.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(),
                             out.data_ptr<c10::Half>(), groups);
    default:
      fail("mxfp4: cannot dequantise to {} (fp32, bf16 or fp16)", c10::toString(out.scalar_type()));
  }
}

at::Tensor mxfp4_dequantize(const at::Tensor& blocks, const at::Tensor& scales,
                            at::ScalarType dtype) {
  check(blocks, scales);
  auto shape = scales.sizes().vec();
  shape.back() *= 32;
  auto out = at::empty(shape, blocks.options().dtype(dtype));
  mxfp4_dequantize_out(out, blocks, scales);
  return out;
}

}  // namespace dflash::kernels
