#include "models/linear_group.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

#include "common/error.h"
#include "kernels/fp8_rows.h"
#include "kernels/small_linear.h"

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

// a [m, k] x b [n, k]^T as an FP8 GEMM of the two quantized operands, in a's dtype.
at::Tensor mm_fp8(const kernels::Fp8Rows& a, const kernels::Fp8Rows& b, const at::Tensor& like) {
  auto out = at::empty({a.data.size(0), b.data.size(0)}, like.options());
  kernels::mm_fp8_rows_out(out, a, b);
  return out;
}

struct LinearGroupFunction : public torch::autograd::Function<LinearGroupFunction> {
  // products: (input, weight) index pairs, flattened.
  static tensor_list forward(AutogradContext* ctx, at::TensorList inputs, at::TensorList weights,
                             std::vector<int64_t> products, bool fp8) {
    tensor_list out;
    if (fp8) {
      // Each operand quantized once, however many products read it.
      std::vector<std::optional<kernels::Fp8Rows>> x8(inputs.size()), w8(weights.size());
      for (size_t j = 0; j < products.size(); j += 2) {
        const auto i = static_cast<size_t>(products[j]), w = static_cast<size_t>(products[j + 1]);
        if (!x8[i]) x8[i] = kernels::quantize_rows_e4m3(inputs[i]);
        if (!w8[w]) w8[w] = kernels::quantize_rows_e4m3(weights[w]);
        out.push_back(mm_fp8(*x8[i], *w8[w], inputs[i]));
      }
    } else {
      for (size_t j = 0; j < products.size(); j += 2) {
        out.push_back(at::linear(inputs[products[j]], weights[products[j + 1]]));
      }
    }
    tensor_list saved(inputs.begin(), inputs.end());
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["inputs"] = static_cast<int64_t>(inputs.size());
    ctx->saved_data["products"] = products;
    ctx->saved_data["fp8"] = fp8;
    // An output nobody read has no gradient; zeros for it would be a wasted [rows, out] pass.
    ctx->set_materialize_grads(false);
    return out;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto n_inputs = static_cast<size_t>(ctx->saved_data["inputs"].toInt());
    const auto products = ctx->saved_data["products"].toIntVector();
    const bool fp8 = ctx->saved_data["fp8"].toBool();
    tensor_list out(saved.size() + 2);  // one per input and weight, then products and fp8
    // fp8: per input, the gradients of the products reading it and their weights, side by side.
    std::vector<std::vector<at::Tensor>> input_grads(n_inputs), input_weights(n_inputs);
    for (size_t j = 0; j < products.size(); j += 2) {
      const at::Tensor& g = grads[j / 2];
      if (!g.defined()) continue;
      const auto i = static_cast<size_t>(products[j]);
      const auto w = n_inputs + static_cast<size_t>(products[j + 1]);
      if (ctx->needs_input_grad(i)) {
        if (fp8) {
          input_grads[i].push_back(g);
          input_weights[i].push_back(saved[w]);
        } else {
          accumulate(out[i], g, saved[w]);
        }
      }
      if (ctx->needs_input_grad(w)) accumulate(out[w], g.t(), saved[i]);
    }
    for (size_t i = 0; i < input_grads.size(); ++i) {
      if (input_grads[i].empty()) continue;
      // [W_1; ..; W_n]^T as rows: the summed output dimension is what the GEMM reduces over.
      out[i] = mm_fp8(kernels::quantize_rows_e4m3(input_grads[i]),
                      kernels::quantize_columns_e4m3(input_weights[i]), input_grads[i][0]);
    }
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> linear_group(const std::vector<at::Tensor>& inputs,
                                     const std::vector<at::Tensor>& weights,
                                     const std::vector<LinearProduct>& products, bool fp8) {
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
  // Inference (decoding) builds no graph: the products alone, without a node's overhead (a
  // drafted block's few rows through small_linear).
  if (!c10::GradMode::is_enabled()) {
    std::vector<at::Tensor> out;
    for (const auto& p : products) {
      out.push_back(kernels::inference_linear(inputs[p.input], weights[p.weight]));
    }
    return out;
  }
  // As TensorLists: autograd takes an ArrayRef of tensors as inputs, a std::vector as a constant.
  return LinearGroupFunction::apply(at::TensorList(inputs), at::TensorList(weights), flat, fp8);
}

}  // namespace dflash::models
