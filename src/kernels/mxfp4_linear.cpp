#include "kernels/mxfp4_linear.h"

#include <ATen/ATen.h>

#include "common/error.h"
#include "kernels/mxfp4.h"

namespace dflash::kernels {

// mxfp4_linear.cu: y [R, out] = the grouped product, x, blocks, scales and bias contiguous.
void mxfp4_grouped_linear_cuda(at::Tensor& y, const at::Tensor& x, const at::Tensor& offsets,
                               const at::Tensor& blocks, const at::Tensor& scales,
                               const at::Tensor& bias, Mxfp4Kernel kernel);

namespace {

void check(const at::Tensor& x, const at::Tensor& offsets, const at::Tensor& blocks,
           const at::Tensor& scales, const at::Tensor& bias) {
  const auto dtype = x.scalar_type();
  if (x.dim() != 2 || x.size(1) % 32 != 0 ||
      (dtype != at::kBFloat16 && dtype != at::kHalf && dtype != at::kFloat)) {
    fail("mxfp4 grouped linear: x must be bf16, fp16 or fp32 [R, in] with in % 32 == 0, got {} {}",
         c10::toString(dtype), x.sizes());
  }
  const int64_t groups = x.size(1) / 32;
  if (blocks.scalar_type() != at::kByte || blocks.dim() != 4 || blocks.size(2) != groups ||
      blocks.size(3) != 16) {
    fail("mxfp4 grouped linear: blocks must be uint8 [E, out, {}, 16] for x's {} inputs, got {} {}",
         groups, x.size(1), c10::toString(blocks.scalar_type()), blocks.sizes());
  }
  const int64_t experts = blocks.size(0), out = blocks.size(1);
  if (scales.scalar_type() != at::kByte || scales.sizes() != blocks.sizes().slice(0, 3)) {
    fail("mxfp4 grouped linear: scales must be uint8 [{}, {}, {}], got {} {}", experts, out, groups,
         c10::toString(scales.scalar_type()), scales.sizes());
  }
  if (offsets.scalar_type() != at::kInt || offsets.dim() != 1 || offsets.size(0) != experts) {
    fail("mxfp4 grouped linear: offsets must be int32 [{}] (one per expert), got {} {}", experts,
         c10::toString(offsets.scalar_type()), offsets.sizes());
  }
  if (bias.defined() && (bias.scalar_type() != dtype || bias.dim() != 2 ||
                         bias.size(0) != experts || bias.size(1) != out)) {
    fail("mxfp4 grouped linear: bias must be {} [{}, {}] or none, got {} {}", c10::toString(dtype),
         experts, out, c10::toString(bias.scalar_type()), bias.sizes());
  }
  for (const at::Tensor* t : {&offsets, &blocks, &scales, &bias}) {
    if (t->defined() && t->device() != x.device()) {
      fail(
          "mxfp4 grouped linear: offsets, blocks, scales and bias must be on x's device {}, got {}",
          x.device().str(), t->device().str());
    }
  }
}

}  // namespace

at::Tensor mxfp4_grouped_linear_reference(const at::Tensor& x, const at::Tensor& offsets,
                                          const at::Tensor& blocks, const at::Tensor& scales,
                                          const at::Tensor& bias) {
  check(x, offsets, blocks, scales, bias);
  const int64_t rows = x.size(0);
  const auto ends = offsets.to(at::kCPU, at::kLong);
  const int64_t* end = ends.data_ptr<int64_t>();
  auto xf = x.to(at::kFloat);
  auto y = at::zeros({rows, blocks.size(1)}, xf.options());
  for (int64_t e = 0, start = 0; e < ends.numel(); start = end[e++]) {
    if (end[e] < start || end[e] > rows) {
      fail(
          "mxfp4 grouped linear: offsets must be non-decreasing and at most R = {}, got {} after "
          "{}",
          rows, end[e], start);
    }
    if (end[e] == start) continue;
    auto w = mxfp4_dequantize(blocks[e], scales[e], at::kFloat);
    auto part = xf.narrow(0, start, end[e] - start);
    y.narrow(0, start, end[e] - start)
        .copy_(bias.defined() ? at::linear(part, w, bias[e].to(at::kFloat)) : at::linear(part, w));
  }
  return y.to(x.scalar_type());
}

at::Tensor mxfp4_grouped_linear(const at::Tensor& x, const at::Tensor& offsets,
                                const at::Tensor& blocks, const at::Tensor& scales,
                                const at::Tensor& bias, Mxfp4Kernel kernel) {
  check(x, offsets, blocks, scales, bias);
  const bool half = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
  // in == 0 is an empty sum: the reference's bias (or zeros) without a kernel for it.
  if (!x.is_cuda() || !half || x.size(1) == 0) {
    return mxfp4_grouped_linear_reference(x, offsets, blocks, scales, bias);
  }
  auto y = at::empty({x.size(0), blocks.size(1)}, x.options());
  if (y.numel() == 0 || blocks.size(0) == 0) return y;
  mxfp4_grouped_linear_cuda(y, x.contiguous(), offsets.contiguous(), blocks.contiguous(),
                            scales.contiguous(), bias.defined() ? bias.contiguous() : bias, kernel);
  return y;
}

}  // namespace dflash::kernels
