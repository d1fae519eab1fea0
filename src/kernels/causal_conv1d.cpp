#include "kernels/causal_conv1d.h"

#include "common/error.h"
#include "common/upload.h"
#include "kernels/autograd_records.h"

namespace dflash::kernels {

// causal_conv1d.cu
bool causal_conv1d_cuda_width(int64_t width);
void causal_conv1d_silu_cuda(const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& cu_seqlens, const at::Tensor& initial_state,
                             at::Tensor& out, at::Tensor& final_state);
void causal_conv1d_silu_step_cuda(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& state, at::Tensor& out,
                                  const at::Tensor& states_out);

namespace {

void check_weight(const char* what, const at::Tensor& weight, int64_t channels,
                  const at::Device& device) {
  if (weight.dim() != 2 || weight.size(0) != channels || weight.size(1) < 2 ||
      weight.device() != device || !weight.is_floating_point()) {
    fail("{}: weight must be floating [{}, W] (W >= 2) on {}, got {} {} on {}", what, channels,
         device.str(), c10::toString(weight.scalar_type()), weight.sizes(), weight.device().str());
  }
}

void check_state(const char* what, const char* name, const at::Tensor& s, c10::IntArrayRef expected,
                 const at::Tensor& x) {
  if (s.sizes() != expected || s.device() != x.device() || !s.is_floating_point()) {
    fail("{}: {} must be floating {} on {}, got {} {} on {}", what, name, expected,
         x.device().str(), c10::toString(s.scalar_type()), s.sizes(), s.device().str());
  }
}

// The prefill's checks; returns W - 1.
int64_t check_prefill(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cu_seqlens,
                      c10::ArrayRef<int64_t> lengths, const at::Tensor& initial_state) {
  constexpr const char* what = "causal_conv1d_silu";
  if (x.dim() != 2 || !x.is_floating_point()) {
    fail("{}: x must be floating [T, C], got {} {}", what, c10::toString(x.scalar_type()),
         x.sizes());
  }
  const int64_t c = x.size(1), n = static_cast<int64_t>(lengths.size());
  check_weight(what, weight, c, x.device());
  const int64_t keep = weight.size(1) - 1;
  int64_t total = 0;
  for (int64_t len : lengths) {
    if (len < 0) fail("{}: negative sequence length in {}", what, lengths);
    total += len;
  }
  if (total != x.size(0)) {
    fail("{}: lengths {} sum to {}, x has {} rows", what, lengths, total, x.size(0));
  }
  if (cu_seqlens.dim() != 1 || cu_seqlens.size(0) != n + 1 ||
      cu_seqlens.scalar_type() != at::kInt || cu_seqlens.device() != x.device()) {
    fail("{}: cu_seqlens must be int32 [{}] on x's device, got {} {} on {}", what, n + 1,
         c10::toString(cu_seqlens.scalar_type()), cu_seqlens.sizes(), cu_seqlens.device().str());
  }
  if (initial_state.defined()) check_state(what, "initial_state", initial_state, {n, c, keep}, x);
  return keep;
}

// The step's checks; returns W - 1.
int64_t check_step(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& state,
                   const at::Tensor& states_out) {
  constexpr const char* what = "causal_conv1d_silu_step";
  if (x.dim() != 3 || !x.is_floating_point()) {
    fail("{}: x must be floating [N, S, C], got {} {}", what, c10::toString(x.scalar_type()),
         x.sizes());
  }
  const int64_t n = x.size(0), steps = x.size(1), c = x.size(2);
  check_weight(what, weight, c, x.device());
  const int64_t keep = weight.size(1) - 1;
  check_state(what, "state", state, {n, c, keep}, x);
  if (states_out.defined()) check_state(what, "states_out", states_out, {n, steps, c, keep}, x);
  return keep;
}

// The kernels' case: CUDA, x in bf16, fp16 or fp32, kernel widths 2 to 4.
bool on_cuda_kernel(const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = x.scalar_type();
  return x.is_cuda() && weight.dim() == 2 && causal_conv1d_cuda_width(weight.size(1)) &&
         (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat);
}

at::Tensor fp32_contiguous(const at::Tensor& t) {
  return t.defined() ? t.to(at::kFloat).contiguous() : t;
}

// window [B, C, W-1+L] fp32 -> silu(depthwise conv) [B, C, L] fp32 (no padding: the window
// holds the W-1 inputs before the first output).
at::Tensor conv_silu(const at::Tensor& window, const at::Tensor& weight) {
  const int64_t c = weight.size(0);
  return at::silu(at::conv1d(window, weight.to(at::kFloat).unsqueeze(1), std::nullopt,
                             at::IntArrayRef{1}, at::IntArrayRef{0}, at::IntArrayRef{1}, c));
}

}  // namespace

CausalConvResult causal_conv1d_silu_reference(const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& cu_seqlens,
                                              c10::ArrayRef<int64_t> lengths,
                                              const at::Tensor& initial_state) {
  const int64_t keep = check_prefill(x, weight, cu_seqlens, lengths, initial_state);
  const int64_t c = x.size(1), n = static_cast<int64_t>(lengths.size()), total = x.size(0);
  // One stream holding each sequence's W-1 state columns before its tokens, convolved at once
  // (gathers instead of per-sequence copies, so autograd records a few ops for the batch):
  // rows 0..T-1 of `source` are x, then each sequence's state as W-1 rows.
  const auto state = initial_state.defined()
                         ? initial_state.to(at::kFloat)
                         : at::zeros({n, c, keep}, x.options().dtype(at::kFloat));
  auto source = at::cat({x.to(at::kFloat), state.transpose(1, 2).reshape({n * keep, c})});
  std::vector<int64_t> stream, outputs, finals;
  int64_t start = 0;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < keep; ++j) stream.push_back(total + i * keep + j);
    for (int64_t p = 0; p < lengths[i]; ++p) {
      outputs.push_back(static_cast<int64_t>(stream.size()) - keep);  // its window's first row
      stream.push_back(start + p);
    }
    for (int64_t j = keep; j > 0; --j) finals.push_back(static_cast<int64_t>(stream.size()) - j);
    start += lengths[i];
  }
  auto rows = [&](const std::vector<int64_t>& v) {
    return upload_to(x.device(), at::tensor(v, at::kLong));
  };
  auto window = source.index_select(0, rows(stream));  // [S, C]
  at::Tensor out = x.new_empty({0, c});
  if (total > 0) {
    out = conv_silu(window.t().unsqueeze(0), weight)[0].t().index_select(0, rows(outputs));
  }
  auto final_state = window.index_select(0, rows(finals)).view({n, keep, c}).transpose(1, 2);
  return {out.to(x.scalar_type()), final_state.to(x.scalar_type()).contiguous()};
}

at::Tensor causal_conv1d_silu_step_reference(const at::Tensor& x, const at::Tensor& weight,
                                             const at::Tensor& state,
                                             const at::Tensor& states_out) {
  const int64_t steps = x.size(1), keep = check_step(x, weight, state, states_out);
  auto window =
      at::cat({state.to(at::kFloat), x.to(at::kFloat).transpose(1, 2)}, 2);  // [N, C, W-1+S]
  if (states_out.defined() && states_out.numel() > 0) {
    // The state after token s: the window's W-1 inputs ending at s.
    states_out.copy_(
        window.narrow(2, 1, steps + keep - 1).unfold(2, keep, 1).permute({0, 2, 1, 3}));
  }
  return conv_silu(window, weight).transpose(1, 2).to(x.scalar_type()).contiguous();
}

CausalConvResult causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& cu_seqlens, c10::ArrayRef<int64_t> lengths,
                                    const at::Tensor& initial_state) {
  if (!on_cuda_kernel(x, weight) || autograd_records({x, weight, initial_state})) {
    return causal_conv1d_silu_reference(x, weight, cu_seqlens, lengths, initial_state);
  }
  const int64_t keep = check_prefill(x, weight, cu_seqlens, lengths, initial_state);
  auto out = at::empty(x.sizes(), x.options());
  auto final_state =
      at::empty({static_cast<int64_t>(lengths.size()), x.size(1), keep}, x.options());
  if (lengths.empty() || x.size(1) == 0) return {out, final_state};
  causal_conv1d_silu_cuda(x.stride(1) == 1 ? x : x.contiguous(), fp32_contiguous(weight),
                          cu_seqlens.contiguous(), fp32_contiguous(initial_state), out,
                          final_state);
  return {out, final_state};
}

at::Tensor causal_conv1d_silu_step(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& state, const at::Tensor& states_out) {
  if (!on_cuda_kernel(x, weight) || autograd_records({x, weight, state})) {
    return causal_conv1d_silu_step_reference(x, weight, state, states_out);
  }
  check_step(x, weight, state, states_out);
  auto out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  // The kernel writes the states contiguous in x's dtype; another layout or dtype gets a copy.
  const bool direct = !states_out.defined() ||
                      (states_out.is_contiguous() && states_out.scalar_type() == x.scalar_type());
  auto states = direct ? states_out : at::empty(states_out.sizes(), x.options());
  causal_conv1d_silu_step_cuda(x.contiguous(), fp32_contiguous(weight), fp32_contiguous(state), out,
                               states);
  if (!direct) states_out.copy_(states);
  return out;
}

}  // namespace dflash::kernels
