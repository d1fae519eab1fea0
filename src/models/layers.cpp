#include "models/layers.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "common/error.h"
#include "common/upload.h"
#include "kernels/cudnn_attention.h"
#include "kernels/decode_ops.h"
#include "kernels/moe_combine.h"
#include "kernels/rotary.h"

namespace dflash::models {

namespace {

at::Tensor swap_middle_copy(const at::Tensor& x, int64_t a, int64_t b, int64_t c, int64_t e) {
  const auto shape = x.sizes().vec();
  auto flat = x.contiguous().view({a, b, c, e});
  // Whole 8-byte words of a run of e elements move as int64: the same bytes, a quarter of the
  // bf16 elements.
  const int64_t bytes = e * x.element_size();
  if (bytes % 8 == 0 && reinterpret_cast<uintptr_t>(flat.data_ptr()) % 8 == 0) {
    auto words = flat.view(at::kLong);  // [a, b, c, bytes / 8]
    return words.transpose(1, 2).contiguous().view(at::kByte).view(x.scalar_type()).view(shape);
  }
  return flat.transpose(1, 2).contiguous().view(shape);
}

struct SwapMiddleDims : public torch::autograd::Function<SwapMiddleDims> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t a,
                            int64_t b, int64_t c, int64_t e) {
    ctx->saved_data["dims"] = std::vector<int64_t>{a, b, c, e};
    return swap_middle_copy(x, a, b, c, e);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto d = ctx->saved_data["dims"].toIntVector();
    return {swap_middle_copy(grads[0], d[0], d[2], d[1], d[3]), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor swap_middle_dims(const at::Tensor& x, int64_t a, int64_t b, int64_t c, int64_t e) {
  if (a * b * c * e != x.numel()) {
    fail("swap_middle_dims: [{}, {}, {}, {}] does not hold the {} elements of {}", a, b, c, e,
         x.numel(), x.sizes());
  }
  return SwapMiddleDims::apply(x, a, b, c, e);
}

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
  b.cu_seqlens = upload_to(device, at::tensor(cu, at::kInt));
  b.positions = upload_to(device, at::tensor(pos, at::kLong));
  return b;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  // One fused kernel on CUDA, accumulating in fp32. transformers instead rounds the normalized
  // value to the input dtype before scaling; in bf16 that extra rounding is the only
  // difference, and costs five more passes over the activations.
  return at::rms_norm(x, {x.size(-1)}, weight, eps);
}

namespace {

// transformers' _compute_llama3_parameters.
at::Tensor llama3_inv_freq(const at::Tensor& inv_freq, const Llama3RopeScaling& s) {
  const double old_len = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = old_len / s.low_freq_factor;
  const double high_wavelen = old_len / s.high_freq_factor;
  auto wavelen = 2 * std::numbers::pi / inv_freq;
  auto scaled = at::where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq);
  auto smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  auto medium = at::logical_not(wavelen < high_wavelen) & at::logical_not(wavelen > low_wavelen);
  return at::where(medium, smoothed, scaled);
}

// transformers' _compute_yarn_parameters: frequencies above the beta_fast rotation count keep
// their value (extrapolation), those below beta_slow are divided by the factor
// (interpolation), with a linear ramp over the dimensions in between. The scalar arithmetic is
// in double and the tensor arithmetic in fp32, in transformers' order, so the table is
// bit-identical.
at::Tensor yarn_inv_freq(const at::Tensor& pos_freqs, int64_t dim, double base,
                         const YarnRopeScaling& s) {
  auto extrapolation = 1.0 / pos_freqs;
  auto interpolation = 1.0 / (s.factor * pos_freqs);
  const double beta_fast = s.beta_fast.value_or(0) != 0 ? *s.beta_fast : 32;
  const double beta_slow = s.beta_slow.value_or(0) != 0 ? *s.beta_slow : 1;
  const double original = static_cast<double>(s.original_max_position_embeddings);
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(original / (rotations * 2 * std::numbers::pi))) / (2 * std::log(base));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (s.truncate.value_or(true)) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
  auto ramp = ((at::arange(dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  auto extrapolation_factor = 1 - ramp;
  return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
}

}  // namespace

Rotary::Rotary(const ModelConfig& c, at::Device device) {
  // fp32 arithmetic on the CPU mirrors transformers' own computation of the table, over the
  // rotated part of the head (all of it unless partial_rotary_factor < 1).
  const int64_t dim = c.rotary_dim();
  auto exponents = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / static_cast<double>(dim);
  auto pos_freqs = at::pow(c.rope_theta, exponents);
  at::Tensor inv_freq;
  if (!c.rope_scaling) {
    inv_freq = 1.0 / pos_freqs;
  } else if (const auto* l = std::get_if<Llama3RopeScaling>(&*c.rope_scaling)) {
    inv_freq = llama3_inv_freq(1.0 / pos_freqs, *l);
  } else {
    const auto& y = std::get<YarnRopeScaling>(*c.rope_scaling);
    inv_freq = yarn_inv_freq(pos_freqs, dim, c.rope_theta, y);
    attention_scaling_ = y.attention_scaling();
  }
  inv_freq_ = inv_freq.to(device);
}

std::pair<at::Tensor, at::Tensor> Rotary::tables(const at::Tensor& positions,
                                                 at::ScalarType dtype) const {
  return kernels::rotary_tables(positions, inv_freq_, attention_scaling_, dtype);
}

AttentionBackend parse_attention_backend(const std::string& name) {
  if (name == "flash") return AttentionBackend::kFlash;
  if (name == "cudnn") return AttentionBackend::kCudnn;
  if (name == "auto") return AttentionBackend::kAuto;
  fail("attention backend must be flash, cudnn or auto, got \"{}\"", name);
}

namespace {

// cuDNN's attention where this build and the shapes allow it: its backward needs the
// log-sum-exp this inference path does not compute, hence no autograd.
bool cudnn_attention_applies(const at::Tensor& q) {
  const int64_t d = q.size(-1);
  return !c10::GradMode::is_enabled() && d % 8 == 0 && d <= 128 &&
         at::globalContext().userEnabledCuDNN() && at::detail::getCUDAHooks().hasCuDNN();
}

bool one_length(const PackedBatch& batch) {
  return std::all_of(batch.lengths.begin(), batch.lengths.end(),
                     [&](int64_t l) { return l == batch.max_length; });
}

at::Tensor cudnn_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const PackedBatch& batch) {
  const int64_t n = batch.size(), len = batch.max_length;
  if (one_length(batch) && kernels::cudnn_attention_available()) {
    // The graph and plan ATen's cuDNN call builds, through our own frontend graph (the same
    // bits): q, k and v at their strides (v a slice of the fused QKV output), without ATen's
    // per-call host work (16 against 42 us a call on the H200).
    return kernels::cudnn_causal_attention_forward(q, k, v, n,
                                                   1.0 / std::sqrt(static_cast<double>(q.size(2))));
  }
  // Packed [T, H, D] rows: the layout the ragged call's offsets assume.
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  return std::get<0>(at::_cudnn_attention_forward(
      qc, kc, vc, std::nullopt, batch.cu_seqlens, batch.cu_seqlens, len, len,
      /*compute_log_sumexp=*/false, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false));
}

}  // namespace

at::Tensor packed_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const PackedBatch& batch, AttentionBackend backend) {
  const bool flash =
      q.is_cuda() && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf);
  const bool cudnn = backend == AttentionBackend::kCudnn ||
                     (backend == AttentionBackend::kAuto && one_length(batch));
  if (flash && cudnn && cudnn_attention_applies(q)) {
    return cudnn_causal_attention(q, k, v, batch);
  }
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

bool grouped_mm_aligned(const at::Tensor& x, int64_t f) {
  const int64_t bytes = x.element_size();
  return (x.size(1) * bytes) % 16 == 0 && (f * bytes) % 16 == 0;
}

ExpertRoutes::ExpertRoutes(const at::Tensor& x, const at::Tensor& chosen, int64_t num_experts) {
  const int64_t top_k = chosen.size(1);
  auto flat = chosen.reshape(-1);
  auto [sorted, order] = at::sort(flat, /*stable=*/true, 0, /*descending=*/false);
  rows = x.index_select(0, at::floor_divide(order, top_k));
  experts = sorted;
  counts = at::zeros({num_experts}, flat.options()).scatter_add_(0, flat, at::ones_like(flat));
  inverse = at::empty_like(order).scatter_(0, order, at::arange(order.numel(), order.options()));
}

at::Tensor ExpertRoutes::combine(const at::Tensor& y, const at::Tensor& weights) const {
  if (!c10::GradMode::is_enabled()) return kernels::moe_combine(y, inverse, weights);
  const int64_t tokens = weights.size(0), top_k = weights.size(1);
  return (y.index_select(0, inverse).view({tokens, top_k, y.size(1)}) *
          weights.to(y.scalar_type()).unsqueeze(-1))
      .sum(1);
}

at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, const at::Tensor& experts_gate_up,
                   const at::Tensor& experts_down, int64_t top_k, bool norm_topk_prob,
                   ExpertGemm gemm, int64_t first_expert) {
  const int64_t f = experts_down.size(2), held = experts_gate_up.size(0);
  auto probs = at::softmax(at::linear(x, router), -1, at::kFloat);
  auto [weights, chosen] = at::topk(probs, top_k, -1);
  if (norm_topk_prob) weights = weights / weights.sum(-1, /*keepdim=*/true);
  // Expert parallelism: a choice of an expert held elsewhere goes to one extra group, `held`,
  // after this rank's (the routes sort it last); its rows contribute zero here.
  const bool some = held < router.size(0);
  if (some) {
    auto local = chosen - first_expert;
    chosen = at::where(local.ge(0).logical_and(local.lt(held)), local, held);
  }
  // Without autograd (the frozen target's prefill and decode) the SwiGLU takes a kernel: one
  // pass instead of three.
  const bool frozen = !c10::GradMode::is_enabled();
  const ExpertRoutes routes(x, chosen, some ? held + 1 : held);
  if (gemm == ExpertGemm::kAuto) {
    gemm = x.is_cuda() && x.scalar_type() == at::kBFloat16 && grouped_mm_aligned(x, f)
               ? ExpertGemm::kGrouped
               : ExpertGemm::kLoop;
  }
  at::Tensor y;
  if (gemm == ExpertGemm::kGrouped) {
    // Offsets stay on the device: no host sync, so a CUDA graph can capture the layer.
    auto offsets = routes.offsets().narrow(0, 0, held);
    auto gate_up = at::_grouped_mm(routes.rows, experts_gate_up.transpose(1, 2), offsets);
    auto act = frozen ? kernels::silu_mul(gate_up)
                      : at::silu(gate_up.narrow(1, 0, f)) * gate_up.narrow(1, f, f);
    y = at::_grouped_mm(act, experts_down.transpose(1, 2), offsets);
    if (some) {
      // The GEMMs leave the rows past the last offset (other ranks' experts) unwritten.
      const auto row = at::arange(y.size(0), offsets.options().dtype(at::kLong));
      y = y.masked_fill(row.ge(offsets.narrow(0, held - 1, 1)).unsqueeze(1), 0);
    }
  } else {
    y = routes.per_expert([&](int64_t e, const at::Tensor& rows) {
      if (e == held) return at::zeros({rows.size(0), x.size(1)}, x.options());
      return swiglu_mlp(rows, experts_gate_up.select(0, e), experts_down[e]);
    });
  }
  return routes.combine(y, weights);
}

}  // namespace dflash::models
