#include "kernels/moe_combine.h"

#include <fmt/ranges.h>

#include "common/error.h"

namespace dflash::kernels {

void moe_combine_cuda(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& weights,
                      at::Tensor& out);

namespace {

void check_moe_combine(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& weights) {
  if (y.dim() != 2 || weights.dim() != 2 || inverse.dim() != 1 || inverse.size(0) != y.size(0) ||
      weights.numel() != y.size(0)) {
    fail("moe_combine: y must be [T * K, H], inverse [T * K] and weights [T, K], got {}, {} and {}",
         y.sizes(), inverse.sizes(), weights.sizes());
  }
  if (inverse.scalar_type() != at::kLong || inverse.device() != y.device() ||
      weights.device() != y.device()) {
    fail("moe_combine: inverse must be int64 and every input on {}, got {} on {} and weights on {}",
         y.device().str(), c10::toString(inverse.scalar_type()), inverse.device().str(),
         weights.device().str());
  }
}

}  // namespace

at::Tensor moe_combine_reference(const at::Tensor& y, const at::Tensor& inverse,
                                 const at::Tensor& weights) {
  check_moe_combine(y, inverse, weights);
  const int64_t t = weights.size(0), k = weights.size(1);
  auto picked = y.index_select(0, inverse).to(at::kFloat).view({t, k, y.size(1)});
  return (picked * weights.to(at::kFloat).unsqueeze(-1)).sum(1).to(y.scalar_type());
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& inverse, const at::Tensor& weights) {
  if (!y.is_cuda()) return moe_combine_reference(y, inverse, weights);
  check_moe_combine(y, inverse, weights);
  auto out = at::empty({weights.size(0), y.size(1)}, y.options());
  if (out.numel() == 0) return out;
  moe_combine_cuda(y.contiguous(), inverse.contiguous(), weights.to(at::kFloat).contiguous(), out);
  return out;
}

}  // namespace dflash::kernels
