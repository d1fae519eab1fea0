#include "kernels/causal_conv1d.h"

#include "common/error.h"

namespace dflash::kernels {
namespace {

void check_weight(const char* what, const at::Tensor& weight, int64_t channels,
                  const at::Device& device) {
  if (weight.dim() != 2 || weight.size(0) != channels || weight.size(1) < 1 ||
      weight.device() != device || !weight.is_floating_point()) {
    fail("{}: weight must be floating [{}, W] on {}, got {} {} on {}", what, channels, device.str(),
         c10::toString(weight.scalar_type()), weight.sizes(), weight.device().str());
  }
}

void check_state(const char* what, const char* name, const at::Tensor& s, c10::IntArrayRef expected,
                 const at::Tensor& x) {
  if (s.sizes() != expected || s.device() != x.device() || !s.is_floating_point()) {
    fail("{}: {} must be floating {} on {}, got {} {} on {}", what, name, expected,
         x.device().str(), c10::toString(s.scalar_type()), s.sizes(), s.device().str());
  }
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
  if (total != x.size(0))
    fail("{}: lengths {} sum to {}, x has {} rows", what, lengths, total, x.size(0));
  if (cu_seqlens.dim() != 1 || cu_seqlens.size(0) != n + 1 ||
      cu_seqlens.scalar_type() != at::kInt) {
    fail("{}: cu_seqlens must be int32 [{}], got {} {}", what, n + 1,
         c10::toString(cu_seqlens.scalar_type()), cu_seqlens.sizes());
  }
  if (initial_state.defined()) check_state(what, "initial_state", initial_state, {n, c, keep}, x);
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto final_state = at::empty({n, c, keep}, x.options());
  int64_t start = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = lengths[i];
    auto before = initial_state.defined() ? initial_state[i].to(at::kFloat)
                                          : at::zeros({c, keep}, x.options().dtype(at::kFloat));
    auto window = at::cat({before, x.narrow(0, start, len).to(at::kFloat).t()}, 1);  // [C, W-1+L]
    if (len > 0) out.narrow(0, start, len).copy_(conv_silu(window.unsqueeze(0), weight)[0].t());
    final_state[i].copy_(window.narrow(1, len, keep));
    start += len;
  }
  return {out, final_state};
}

at::Tensor causal_conv1d_silu_step_reference(const at::Tensor& x, const at::Tensor& weight,
                                             const at::Tensor& state,
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
  return causal_conv1d_silu_reference(x, weight, cu_seqlens, lengths, initial_state);
}

at::Tensor causal_conv1d_silu_step(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& state, const at::Tensor& states_out) {
  return causal_conv1d_silu_step_reference(x, weight, state, states_out);
}

}  // namespace dflash::kernels
