// kernels: whether autograd records an op on the given tensors. The hand-written CUDA kernels
// have no backward, so their entry points take the differentiable ATen composition when it does
// (training a target with `dflash pretrain`); a frozen forward never does.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <initializer_list>

namespace dflash::kernels {

inline bool autograd_records(std::initializer_list<at::Tensor> tensors) {
  if (!c10::GradMode::is_enabled()) return false;
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

}  // namespace dflash::kernels
