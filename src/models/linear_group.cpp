#include "models/linear_group.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/error.h"

namespace dflash::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// C = a b^T or C += a b^T: the first term of a gradient sum allocates it, the others add
// inside the GEMM (beta = 1).
void accumulate(at::Tensor& sum, const at::Tensor& a, const at::Tensor& b) {
  if (!sum.defined()) {
    sum = at::mm(a, b);
  } else {
    sum.addmm_(a, b);
  }
}

struct LinearGroupFunction : public torch::autograd::Function<LinearGroupFunction> {
  // products: (input, weight) index pairs, flattened.
  static tensor_list forward(AutogradContext* ctx, at::TensorList inputs, at::TensorList weights,
                             std::vector<int64_t> products) {
    tensor_list out;
    for (size_t j = 0; j < products.size(); j += 2) {
      out.push_back(at::linear(inputs[products[j]], weights[products[j + 1]]));
    }
    tensor_list saved(inputs.begin(), inputs.end());
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["inputs"] = static_cast<int64_t>(inputs.size());
    ctx->saved_data["products"] = products;
    // An output nobody read has no gradient; zeros for it would be a wasted [rows, out] pass.
    ctx->set_materialize_grads(false);
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto n_inputs = static_cast<size_t>(ctx->saved_data["inputs"].toInt());
    const auto products = ctx->saved_data["products"].toIntVector();
    tensor_list out(saved.size() + 1);  // one per input and weight, then the products
    for (size_t j = 0; j < products.size(); j += 2) {
      const at::Tensor& g = grads[j / 2];
      if (!g.defined()) continue;
      const auto i = static_cast<size_t>(products[j]);
      const auto w = n_inputs + static_cast<size_t>(products[j + 1]);
      if (ctx->needs_input_grad(i)) accumulate(out[i], g, saved[w]);
      if (ctx->needs_input_grad(w)) accumulate(out[w], g.t(), saved[i]);
    }
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> linear_group(const std::vector<at::Tensor>& inputs,
                                     const std::vector<at::Tensor>& weights,
                                     const std::vector<LinearProduct>& products) {
  std::vector<int64_t> flat;
  for (const auto& p : products) {
    if (p.input < 0 || p.input >= static_cast<int64_t>(inputs.size()) || p.weight < 0 ||
        p.weight >= static_cast<int64_t>(weights.size())) {
      fail("linear group: product ({}, {}) outside {} inputs and {} weights", p.input, p.weight,
           inputs.size(), weights.size());
    }
    const auto &x = inputs[p.input], &w = weights[p.weight];
    if (!x.defined() || !w.defined() || x.dim() != 2 || w.dim() != 2 || x.size(1) != w.size(1)) {
      fail("linear group: input {} {} does not fit weight {} {} (2-d, [rows, in] x [out, in])",
           p.input, x.defined() ? x.sizes() : at::IntArrayRef{}, p.weight,
           w.defined() ? w.sizes() : at::IntArrayRef{});
    }
    flat.push_back(p.input);
    flat.push_back(p.weight);
  }
  // Inference (decoding) builds no graph: the products alone, without a node's overhead.
  if (!c10::GradMode::is_enabled()) {
    std::vector<at::Tensor> out;
    for (const auto& p : products) out.push_back(at::linear(inputs[p.input], weights[p.weight]));
    return out;
  }
  // As TensorLists: autograd takes an ArrayRef of tensors as inputs, a std::vector as a constant.
  return LinearGroupFunction::apply(at::TensorList(inputs), at::TensorList(weights), flat);
}

}  // namespace dflash::models
