#include "models/layers.h"

#include <cmath>
#include <numbers>

#include "common/error.h"

namespace dflash::models {

PackedBatch PackedBatch::from_lengths(const std::vector<int64_t>& lengths, at::Device device) {
  PackedBatch b;
  b.lengths = lengths;
  std::vector<int32_t> cu(lengths.size() + 1, 0);
  std::vector<int64_t> pos;
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] <= 0) fail("packed batch: sequence {} has length {}", i, lengths[i]);
    cu[i + 1] = static_cast<int32_t>(cu[i] + lengths[i]);
    b.max_length = std::max(b.max_length, lengths[i]);
    for (int64_t p = 0; p < lengths[i]; ++p) pos.push_back(p);
  }
  b.total = cu.back();
  auto to_device = [&](at::Tensor t) {
    return device.is_cpu() ? t : t.pin_memory().to(device, true);
  };
  b.cu_seqlens = to_device(at::tensor(cu, at::kInt));
  b.positions = to_device(at::tensor(pos, at::kLong));
  return b;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // One fused kernel on CUDA, accumulating in fp32. transformers instead rounds the normalized
  // value to the input dtype before scaling; in bf16 that extra rounding is the only
  // difference, and costs five more passes over the activations.
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

Rotary::Rotary(const ModelConfig& c, at::Device device) {
  // fp32 arithmetic on the CPU mirrors transformers' own computation of the table.
  auto exponents =
      at::arange(0, c.head_dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(c.head_dim);
  auto inv_freq = 1.0 / at::pow(c.rope_theta, exponents);
  if (c.rope_scaling) {
    const auto& s = *c.rope_scaling;
    const double old_len = static_cast<double>(s.original_max_position_embeddings);
    const double low_wavelen = old_len / s.low_freq_factor;
    const double high_wavelen = old_len / s.high_freq_factor;
    auto wavelen = 2 * std::numbers::pi / inv_freq;
    auto scaled = at::where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq);
    auto smooth =
        (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
    auto medium = at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
    inv_freq = at::where(medium, smoothed, scaled);
  }
  inv_freq_ = inv_freq.to(device);
}

std::pair<at::Tensor, at::Tensor> Rotary::tables(const at::Tensor& positions,
                                                 at::ScalarType dtype) const {
  auto freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq_.unsqueeze(0);
  auto emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const PackedBatch& batch) {
  const bool flash =
      q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
  if (flash) {
    auto out = at::_flash_attention_forward(q, k, v, batch.cu_seqlens, batch.cu_seqlens,
                                            batch.max_length, batch.max_length, 0.0,
                                            /*is_causal=*/true, /*return_debug_mask=*/false);
    return std::get<0>(out);
  }
  std::vector<at::Tensor> outs;
  outs.reserve(batch.lengths.size());
  int64_t start = 0;
  for (int64_t len : batch.lengths) {
    // [L, H, D] -> [1, H, L, D]
    auto view = [&](const at::Tensor& t) {
      return t.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
    };
    auto o = at::scaled_dot_product_attention(
        view(q), view(k), view(v), {}, 0.0, /*is_causal=*/true, std::nullopt, /*enable_gqa=*/true);
    outs.push_back(o.squeeze(0).transpose(0, 1));
    start += len;
  }
  return outs.size() == 1 ? outs[0].contiguous() : at::cat(outs, 0);
}

at::Tensor swiglu_mlp(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down) {
  auto gate_up = at::linear(x, w_gate_up);
  const int64_t f = w_gate_up.size(0) / 2;
  auto act = at::silu(gate_up.narrow(-1, 0, f)) * gate_up.narrow(-1, f, f);
  return at::linear(act, w_down);
}

}  // namespace dflash::models
