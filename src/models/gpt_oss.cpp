#include "models/gpt_oss.h"

#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cmath>
#include <limits>
#include <optional>

#include "common/error.h"
#include "io/safetensors.h"
#include "kernels/gpt_oss_swiglu.h"
#include "kernels/mxfp4.h"
#include "kernels/mxfp4_linear.h"
#include "kernels/rotary.h"
#include "models/target.h"

namespace dflash::models {
namespace {

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

bool is_mxfp4_tensor(const std::string& name) {
  return name.ends_with("_blocks") || name.ends_with("_scales");
}

bool cuda_half(const at::Tensor& t) {
  return t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

// Whether MXFP4 experts on x's rows take kernels::mxfp4_grouped_linear (models/layers.h).
bool fused_mxfp4(const at::Tensor& x, Mxfp4Gemm gemm) {
  return gemm == Mxfp4Gemm::kFused || gemm == Mxfp4Gemm::kFusedTensorCores ||
         (gemm == Mxfp4Gemm::kAuto && cuda_half(x) && !c10::GradMode::is_enabled());
}

// kAuto's largest pass for the streaming kernel, in routed pairs per expert; larger passes in
// bf16 take the tensor-core kernel (fp16 the layer dequantised into buffers). The streaming
// kernel reads each routed expert's MXFP4 bytes once per 8 rows and multiplies on CUDA cores,
// the tensor-core one decodes each weight tile into registers once per 64 or 128 rows. At
// gpt-oss-120b's shapes on an H100 (bench-kernels --mxfp4-only) streaming wins at half a pair
// an expert (16 tokens: 663 against 776 us) and loses at 2 (64 tokens: 1,759 against 1,588).
constexpr int64_t kStreamingMxfp4MaxPairsPerExpert = 1;

kernels::Mxfp4Kernel mxfp4_kernel(const at::Tensor& x, Mxfp4Gemm gemm, const ModelConfig& c) {
  const bool many =
      x.size(0) * c.num_experts_per_tok > kStreamingMxfp4MaxPairsPerExpert * c.num_experts;
  return gemm == Mxfp4Gemm::kFusedTensorCores ||
                 (gemm == Mxfp4Gemm::kAuto && many && x.scalar_type() == at::kBFloat16)
             ? kernels::Mxfp4Kernel::kTensorCores
             : kernels::Mxfp4Kernel::kStreaming;
}

// transformers' eager_attention_forward for one sequence: [L, Hq, D] queries against
// [K, Hkv, D] keys and values (the packed prefill off flash and training, which differentiates
// it), where `allowed` (bool [L, K]) lets them attend, the sink logit appended to every
// row's scores before the softmax and dropped after it.
at::Tensor sink_attention_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& sinks, const at::Tensor& allowed) {
  const int64_t len = q.size(0), keys = k.size(0), heads = q.size(1), groups = heads / k.size(1);
  auto qh = q.transpose(0, 1);                               // [Hq, L, D]
  auto kh = k.transpose(0, 1).repeat_interleave(groups, 0);  // [Hq, K, D]
  auto vh = v.transpose(0, 1).repeat_interleave(groups, 0);
  auto scores = at::matmul(qh, kh.transpose(1, 2)) * (1.0 / std::sqrt(double(q.size(2))));
  scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  auto sink = sinks.to(scores.scalar_type()).view({heads, 1, 1}).expand({heads, len, 1});
  auto logits = at::cat({scores, sink}, -1);
  logits = logits - std::get<0>(logits.max(-1, /*keepdim=*/true));
  auto probs = at::softmax(logits, -1).narrow(-1, 0, keys).to(v.scalar_type());
  return at::matmul(probs, vh).transpose(0, 1);  // [L, Hq, D]
}

// A softmax with the sink's logit in its denominator from flash's output and log-sum-exp
// (fp32 [Hq, T]): out * S / (S + e^sink) with S = e^lse, i.e. out * sigmoid(lse - sink).
at::Tensor fold_sinks(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& sinks) {
  auto keep = at::sigmoid(lse - sinks.to(at::kFloat).unsqueeze(1)).transpose(0, 1).unsqueeze(-1);
  return (out.to(at::kFloat) * keep).to(out.scalar_type());
}

}  // namespace

at::Tensor gpt_oss_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  const int64_t f2 = gate_up.size(-1);
  auto gate = gate_up.slice(-1, 0, f2, 2).clamp_max(limit);
  auto up = gate_up.slice(-1, 1, f2, 2).clamp(-limit, limit);
  return (up + 1) * (gate * at::sigmoid(gate * alpha));
}

namespace {

// gpt-oss' router: the top-k of x W^T + b, softmax over those k logits.
std::pair<ExpertRoutes, at::Tensor> route(const at::Tensor& x, const GptOssLayerWeights& w,
                                          const ModelConfig& c) {
  auto logits = at::linear(x, w.router, w.router_bias);
  auto [top, chosen] = at::topk(logits, c.num_experts_per_tok, -1);
  return {ExpertRoutes(x, chosen, c.num_experts), at::softmax(top, -1)};
}

}  // namespace

at::Tensor gpt_oss_experts(const at::Tensor& x, const GptOssLayerWeights& w, const ModelConfig& c,
                           const at::Tensor& gate_up, const at::Tensor& down) {
  const int64_t f = gate_up.size(1) / 2;  // this rank's share under tensor parallelism
  const double alpha = c.gpt_oss.swiglu_alpha, limit = c.gpt_oss.swiglu_limit;
  const auto [routes, weights] = route(x, w, c);
  at::Tensor y;
  // The fused activation kernel has no backward: training takes the per-expert ATen path.
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16 && grouped_mm_aligned(x, f) &&
      !c10::GradMode::is_enabled()) {
    auto offsets = routes.offsets();
    auto gu = at::_grouped_mm(routes.rows, gate_up.transpose(1, 2), offsets);
    // The gate/up biases, the clamps and the gate in one pass (kernels/gpt_oss_swiglu.h).
    auto act = kernels::gpt_oss_biased_swiglu(gu, w.gate_up_bias, routes.experts, alpha, limit);
    y = at::_grouped_mm(act, down.transpose(1, 2), offsets) +
        w.down_bias.index_select(0, routes.experts);
  } else {
    y = routes.per_expert([&](int64_t e, const at::Tensor& rows) {
      auto gu = at::linear(rows, gate_up[e], w.gate_up_bias[e]);
      return at::linear(gpt_oss_swiglu(gu, alpha, limit), down[e], w.down_bias[e]);
    });
  }
  return routes.combine(y, weights);
}

at::Tensor gpt_oss_routed_mxfp4_experts(const at::Tensor& x, const GptOssLayerWeights& w,
                                        const ModelConfig& c, Mxfp4Gemm gemm) {
  const auto [routes, weights] = route(x, w, c);
  const auto& e = routes.experts;
  if (fused_mxfp4(x, gemm)) {
    const auto offsets = routes.offsets();
    const auto kernel = mxfp4_kernel(x, gemm, c);
    auto gu = kernels::mxfp4_grouped_linear(routes.rows, offsets, w.gate_up_blocks,
                                            w.gate_up_scales, {}, kernel);
    auto act = kernels::gpt_oss_biased_swiglu(gu, w.gate_up_bias, e, c.gpt_oss.swiglu_alpha,
                                              c.gpt_oss.swiglu_limit);
    return routes.combine(kernels::mxfp4_grouped_linear(act, offsets, w.down_blocks, w.down_scales,
                                                        w.down_bias, kernel),
                          weights);
  }
  auto dequantize = [&](const at::Tensor& blocks, const at::Tensor& scales) {
    return kernels::mxfp4_dequantize(blocks.index_select(0, e), scales.index_select(0, e),
                                     x.scalar_type());
  };
  // [R, 1, in] x [R, in, out] per pair.
  auto gu = at::bmm(routes.rows.unsqueeze(1),
                    dequantize(w.gate_up_blocks, w.gate_up_scales).transpose(1, 2))
                .squeeze(1);
  // As the grouped path: decode and prefill round alike.
  auto act = kernels::gpt_oss_biased_swiglu(gu, w.gate_up_bias, e, c.gpt_oss.swiglu_alpha,
                                            c.gpt_oss.swiglu_limit);
  auto y = at::bmm(act.unsqueeze(1), dequantize(w.down_blocks, w.down_scales).transpose(1, 2))
               .squeeze(1) +
           w.down_bias.index_select(0, e);
  return routes.combine(y, weights);
}

at::Tensor sink_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& sinks, int64_t window, const PackedBatch& batch) {
  // Training differentiates the eager softmax (flash's log-sum-exp output has no gradient).
  if (cuda_half(q) && !c10::GradMode::is_enabled()) {
    auto [out, lse, rng, unused, debug] = at::_flash_attention_forward(
        q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_length, batch.max_length, 0.0,
        /*is_causal=*/true, /*return_debug_mask=*/false, std::nullopt, flash_window_left(window),
        0);
    return fold_sinks(out, lse, sinks);
  }
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  for (int64_t len : batch.lengths) {
    auto i = at::arange(len, q.options().dtype(at::kLong)).unsqueeze(1);
    auto j = i.view({1, len});
    auto allowed = j <= i;
    if (window > 0) allowed = allowed & (j > i - window);
    outs.push_back(sink_attention_one(q.narrow(0, start, len), k.narrow(0, start, len),
                                      v.narrow(0, start, len), sinks, allowed));
    start += len;
  }
  return at::cat(outs, 0);
}

at::Tensor cached_sink_attention(const at::Tensor& q, const KVCache& cache, int64_t layer,
                                 const AppendBatch& batch, const at::Tensor& sinks, int64_t window,
                                 const GatheredKeys* gathered) {
  if ((cache.ring_rows(layer) > 0) != (gathered != nullptr)) {
    fail("gpt-oss cached attention: layer {} {}", layer,
         gathered ? "keeps no window ring but was given gathered keys"
                  : "keeps a window ring but was not given its gathered keys (WindowPlan)");
  }
  const at::Tensor& k = gathered ? gathered->k : cache.keys(layer);
  const at::Tensor& v = gathered ? gathered->v : cache.values(layer);
  if (cuda_half(q) && !batch.is_tree()) {
    // cu_seqlens_k = each slot's (or gathered entry's) first row, seqused_k = its keys: flash
    // aligns the causal mask and the window to the end of each entry's keys.
    auto [out, lse, rng, unused, debug] = at::_flash_attention_forward(
        q, k, v, batch.cu_seqlens, gathered ? gathered->plan.cu_keys : batch.key_starts,
        batch.max_count, gathered ? gathered->plan.max_keys : batch.max_seen, 0.0,
        /*is_causal=*/true, /*return_debug_mask=*/false, std::nullopt, flash_window_left(window), 0,
        gathered ? gathered->plan.seen_keys : batch.seen);
    return fold_sinks(out, lse, sinks);
  }
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (int64_t i = 0; i < batch.size(); ++i) {
    const int64_t n = batch.counts[i], start = batch.starts[i];
    // The entry's keys: rows [first, first + count) holding row offsets from..start + n.
    int64_t first = batch.slots[i] * cache.capacity(), from = 0;
    if (gathered) {
      from = start - std::min(start, cache.ring_window() - 1);
      first = i * (cache.ring_window() - 1) + offset;
    }
    const int64_t count = start + n - from;
    auto [out, lse] = attention_with_lse(
        q.narrow(0, offset, n), k.narrow(0, first, count), v.narrow(0, first, count),
        entry_mask(batch, i, offset, window).narrow(1, from, count));
    outs.push_back(fold_sinks(out, lse, sinks));
    offset += n;
  }
  return at::cat(outs, 0);
}

namespace {

// How this rank's share of each gpt-oss weight is cut from the whole one as GptOssLayerWeights
// holds it (target.h, check_tensor_parallel): views, the whole tensor on a group of one.
struct LayerShare {
  const ModelConfig& c;
  const Split& split;

  at::Tensor along(const at::Tensor& t, int64_t dim) const { return split(t, dim, {t.size(dim)}); }
  // q's rows (weight or bias) and the sinks: this rank's query heads'.
  at::Tensor heads(const at::Tensor& t) const { return along(t, 0); }
  at::Tensor kv(const at::Tensor& t) const { return kv_share(t, c, split); }
  at::Tensor o(const at::Tensor& t) const { return along(t, 1); }
  // gate_up's weight, blocks, scales and bias: gate and up interleave (rows 2j, 2j + 1), so the
  // rank's F / T of each are one contiguous range of 2F / T rows.
  at::Tensor gate_up(const at::Tensor& t) const { return along(t, 1); }
  // down's weight [E, H, F] by input columns; its blocks and scales by whole 32-value groups.
  at::Tensor down(const at::Tensor& t) const { return along(t, 2); }
  // o's and down's biases belong to rank 0 alone: the group's sum adds them once.
  bool holds_biases() const { return split.rank == 0; }
};

}  // namespace

GptOssDecoder::GptOssDecoder(ModelConfig config, at::Device device, const Split& split)
    : config_(std::move(config)), rotary_(config_, device), split_(split) {}

Shapes GptOssDecoder::expected_tensors(const ModelConfig& c, bool mxfp4) {
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t e = c.num_experts, f = c.moe_intermediate_size;
  Shapes out;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = c.layer_prefix(i);
    out.push_back({p + "input_layernorm.weight", {h}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
    const std::pair<const char*, int64_t> projections[] = {{"q", q}, {"k", kv}, {"v", kv}};
    for (const auto& [name, rows] : projections) {
      out.push_back({fmt::format("{}self_attn.{}_proj.weight", p, name), {rows, h}});
      if (c.attention_bias) {
        out.push_back({fmt::format("{}self_attn.{}_proj.bias", p, name), {rows}});
      }
    }
    out.push_back({p + "self_attn.o_proj.weight", {h, q}});
    if (c.attention_bias) out.push_back({p + "self_attn.o_proj.bias", {h}});
    out.push_back({p + "self_attn.sinks", {c.num_heads}});
    out.push_back({p + "mlp.router.weight", {e, h}});
    out.push_back({p + "mlp.router.bias", {e}});
    const std::string x = p + "mlp.experts.";
    if (mxfp4) {
      out.push_back({x + "gate_up_proj_blocks", {e, 2 * f, h / 32, 16}});
      out.push_back({x + "gate_up_proj_scales", {e, 2 * f, h / 32}});
      out.push_back({x + "down_proj_blocks", {e, h, f / 32, 16}});
      out.push_back({x + "down_proj_scales", {e, h, f / 32}});
    } else {
      out.push_back({x + "gate_up_proj", {e, h, 2 * f}});
      out.push_back({x + "down_proj", {e, f, h}});
    }
    out.push_back({x + "gate_up_proj_bias", {e, 2 * f}});
    out.push_back({x + "down_proj_bias", {e, h}});
  }
  return out;
}

std::shared_ptr<GptOssDecoder> GptOssDecoder::load(const io::Checkpoint& ckpt, const ModelConfig& c,
                                                   at::Device device, at::ScalarType dtype,
                                                   const Split& split) {
  const bool mxfp4 = c.gpt_oss.mxfp4;
  std::vector<std::string> values, packed;
  for (const auto& [name, shape] : expected_tensors(c, mxfp4)) {
    if (!is_mxfp4_tensor(name)) {
      values.push_back(name);
      continue;
    }
    if (ckpt.info(name).dtype != at::kByte) {
      fail("{}: tensor {} must be uint8 (MXFP4 {}), got {}", ckpt.dir().string(), name,
           name.ends_with("_blocks") ? "e2m1 pairs" : "e8m0 scales",
           c10::toString(ckpt.info(name).dtype));
    }
    packed.push_back(name);
  }
  // One rank streams every tensor to the device in one load; a rank of a tensor-parallel group
  // copies its slices out of the mapped files, one tensor at a time.
  const bool sliced = split.ranks > 1;
  std::map<std::string, at::Tensor> w, b;
  if (!sliced) {
    w = ckpt.load(values, device, dtype);
    if (!packed.empty()) b = ckpt.load(packed, device, at::kByte);
  }
  const LayerShare share{c, split};
  // Tensor `name` as GptOssLayerWeights holds it, cut by `cut` (a LayerShare member; nullptr:
  // whole on every rank).
  using Cut = at::Tensor (LayerShare::*)(const at::Tensor&) const;
  auto take = [&](const std::string& name, Cut cut = nullptr) {
    const bool bytes = is_mxfp4_tensor(name);
    at::Tensor t = sliced ? ckpt.tensor(name) : (bytes ? b : w).extract(name).mapped();
    // transformers' bf16 experts [E, in, out] to the [E, out, in] rows the GEMMs read.
    if (!bytes && name.ends_with("_proj")) t = t.transpose(1, 2);
    if (cut != nullptr) t = (share.*cut)(t);
    return t.to(device, bytes ? at::kByte : dtype, /*non_blocking=*/false, /*copy=*/sliced,
                at::MemoryFormat::Contiguous);
  };
  std::shared_ptr<GptOssDecoder> d(new GptOssDecoder(c, device, split));
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = c.layer_prefix(i), a = p + "self_attn.", x = p + "mlp.experts.";
    GptOssLayerWeights l;
    l.input_norm = take(p + "input_layernorm.weight");
    l.post_attention_norm = take(p + "post_attention_layernorm.weight");
    l.w_qkv = at::cat({take(a + "q_proj.weight", &LayerShare::heads),
                       take(a + "k_proj.weight", &LayerShare::kv),
                       take(a + "v_proj.weight", &LayerShare::kv)});
    if (c.attention_bias) {
      l.b_qkv = at::cat({take(a + "q_proj.bias", &LayerShare::heads),
                         take(a + "k_proj.bias", &LayerShare::kv),
                         take(a + "v_proj.bias", &LayerShare::kv)});
      if (share.holds_biases()) l.b_o = take(a + "o_proj.bias");
    }
    l.w_o = take(a + "o_proj.weight", &LayerShare::o);
    l.sinks = take(a + "sinks", &LayerShare::heads);
    l.router = take(p + "mlp.router.weight");
    l.router_bias = take(p + "mlp.router.bias");
    l.gate_up_bias = take(x + "gate_up_proj_bias", &LayerShare::gate_up);
    l.down_bias = share.holds_biases()
                      ? take(x + "down_proj_bias")
                      : at::zeros({c.num_experts, c.hidden_size}, at::device(device).dtype(dtype));
    if (mxfp4) {
      l.gate_up_blocks = take(x + "gate_up_proj_blocks", &LayerShare::gate_up);
      l.gate_up_scales = take(x + "gate_up_proj_scales", &LayerShare::gate_up);
      l.down_blocks = take(x + "down_proj_blocks", &LayerShare::down);
      l.down_scales = take(x + "down_proj_scales", &LayerShare::down);
      if (!device.is_cuda()) {
        l.gate_up = kernels::mxfp4_dequantize(l.gate_up_blocks, l.gate_up_scales, dtype);
        l.down = kernels::mxfp4_dequantize(l.down_blocks, l.down_scales, dtype);
      }
    } else {
      l.gate_up = take(x + "gate_up_proj", &LayerShare::gate_up);
      l.down = take(x + "down_proj", &LayerShare::down);
    }
    d->layers_.push_back(std::move(l));
  }
  return d;
}

std::shared_ptr<GptOssDecoder> GptOssDecoder::random(const ModelConfig& c, at::Generator& gen,
                                                     at::TensorOptions opts, const Split& split) {
  std::shared_ptr<GptOssDecoder> d(new GptOssDecoder(c, opts.device(), split));
  auto normal = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, opts) * 0.02; };
  auto ones = [&](int64_t n) { return at::ones({n}, opts); };
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t e = c.num_experts, f = c.moe_intermediate_size;
  auto bytes = opts.dtype(at::kByte);
  // e2m1 values have an rms of about 2.9 over uniform nibbles; scales 2^-8..2^-6 put the
  // weights near std 0.02 like the rest.
  auto blocks = [&](int64_t rows, int64_t cols) {
    return at::randint(0, 256, {e, rows, cols / 32, 16}, gen, bytes);
  };
  auto scales = [&](int64_t rows, int64_t cols) {
    return at::randint(127 - 8, 127 - 5, {e, rows, cols / 32}, gen, bytes);
  };
  // Every rank draws every weight whole, in one order (what a seed means), and keeps its share.
  const bool sliced = split.ranks > 1;
  const LayerShare share{c, split};
  auto keep = [&](const at::Tensor& t, at::Tensor (LayerShare::*cut)(const at::Tensor&) const) {
    return sliced ? (share.*cut)(t).clone(at::MemoryFormat::Contiguous) : t;
  };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    GptOssLayerWeights l;
    l.input_norm = ones(h);
    l.post_attention_norm = ones(h);
    l.w_qkv = normal({q + 2 * kv, h});
    if (sliced) l.w_qkv = qkv_share(l.w_qkv, c, split, q);
    l.w_o = keep(normal({h, q}), &LayerShare::o);
    if (c.attention_bias) {
      l.b_qkv = normal({q + 2 * kv});
      if (sliced) l.b_qkv = qkv_share(l.b_qkv, c, split, q);
      l.b_o = normal({h});
      if (!share.holds_biases()) l.b_o = at::Tensor();
    }
    l.sinks = keep(normal({c.num_heads}), &LayerShare::heads);
    l.router = normal({e, h});
    l.router_bias = normal({e});
    l.gate_up_bias = keep(normal({e, 2 * f}), &LayerShare::gate_up);
    l.down_bias = normal({e, h});
    if (!share.holds_biases()) l.down_bias.zero_();
    if (c.gpt_oss.mxfp4) {
      l.gate_up_blocks = keep(blocks(2 * f, h), &LayerShare::gate_up);
      l.gate_up_scales = keep(scales(2 * f, h), &LayerShare::gate_up);
      l.down_blocks = keep(blocks(h, f), &LayerShare::down);
      l.down_scales = keep(scales(h, f), &LayerShare::down);
      if (!opts.device().is_cuda()) {
        l.gate_up = kernels::mxfp4_dequantize(l.gate_up_blocks, l.gate_up_scales,
                                              opts.dtype().toScalarType());
        l.down =
            kernels::mxfp4_dequantize(l.down_blocks, l.down_scales, opts.dtype().toScalarType());
      }
    } else {
      l.gate_up = keep(normal({e, 2 * f, h}), &LayerShare::gate_up);
      l.down = keep(normal({e, h, f}), &LayerShare::down);
    }
    d->layers_.push_back(std::move(l));
  }
  return d;
}

namespace {

// The floating-point weights of a layer (const or not), in one order for parameters() and
// cast().
template <class Layer>
auto float_weights(Layer& l) {
  return std::array{&l.input_norm,  &l.post_attention_norm,
                    &l.w_qkv,       &l.b_qkv,
                    &l.w_o,         &l.b_o,
                    &l.sinks,       &l.router,
                    &l.router_bias, &l.gate_up,
                    &l.down,        &l.gate_up_bias,
                    &l.down_bias};
}

}  // namespace

std::vector<at::Tensor> GptOssDecoder::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& l : layers_) {
    if (l.gate_up_blocks.defined()) {
      fail("gpt-oss target: MXFP4 experts are not trainable (write the bf16 layout to train)");
    }
    for (const at::Tensor* t : float_weights(l)) {
      if (t->defined()) out.push_back(*t);
    }
  }
  return out;
}

std::shared_ptr<GptOssDecoder> GptOssDecoder::cast(at::ScalarType dtype) const {
  std::shared_ptr<GptOssDecoder> d(new GptOssDecoder(*this));
  d->gate_up_buffer_ = d->down_buffer_ = at::Tensor();
  for (auto& l : d->layers_) {
    for (at::Tensor* t : float_weights(l)) {
      if (t->defined()) *t = t->to(dtype);
    }
  }
  return d;
}

at::Tensor GptOssDecoder::layer(const TargetModel& target, int64_t i, const at::Tensor& x,
                                const at::Tensor& cos, const at::Tensor& sin, const Attend& attend,
                                Mxfp4Gemm mxfp4) const {
  const ModelConfig& c = config_;
  const GptOssLayerWeights& w = layers_[i];
  const double eps = c.rms_norm_eps;
  // This rank's heads (all of them on one rank).
  const int64_t t = x.size(0), d = c.head_dim;
  const int64_t heads = c.num_heads / split_.ranks;
  const int64_t kv_heads = kv_heads_of(c, split_.rank, split_.ranks).second;
  const int64_t nq = heads * d, nkv = kv_heads * d;
  auto qkv = at::linear(rms_norm(x, w.input_norm, eps), w.w_qkv, w.b_qkv);
  auto q = kernels::rotary(qkv.narrow(1, 0, nq).view({t, heads, d}), cos, sin);
  auto k = kernels::rotary(qkv.narrow(1, nq, nkv).view({t, kv_heads, d}), cos, sin);
  auto v = qkv.narrow(1, nq + nkv, nkv).view({t, kv_heads, d});
  auto o = at::linear(attend(i, q, k, v).reshape({t, nq}), w.w_o, w.b_o);
  target.tp_reduce(o, "target_tp_attention");
  auto x1 = x + o;
  auto h1 = rms_norm(x1, w.post_attention_norm, eps);
  at::Tensor moe;
  // MXFP4 on CUDA: the fused kernels read the experts in place (kAuto: in bf16 always, in fp16
  // while few pairs per expert are routed); else passes with fewer routed pairs than experts
  // dequantise only their pairs' experts, and larger ones this layer's experts into the shared
  // buffers first.
  const int64_t pairs = t * c.num_experts_per_tok;
  const bool routed =
      !w.gate_up.defined() &&
      (fused_mxfp4(h1, mxfp4) ? mxfp4 != Mxfp4Gemm::kAuto || h1.scalar_type() == at::kBFloat16 ||
                                    pairs <= kStreamingMxfp4MaxPairsPerExpert * c.num_experts
                              : pairs < c.num_experts);
  if (w.gate_up.defined()) {
    moe = gpt_oss_experts(h1, w, c, w.gate_up, w.down);
  } else if (routed) {
    moe = gpt_oss_routed_mxfp4_experts(h1, w, c, mxfp4);
  } else {
    if (!gate_up_buffer_.defined()) {
      // This rank's share of the intermediate.
      gate_up_buffer_ =
          at::empty({c.num_experts, w.gate_up_blocks.size(1), c.hidden_size}, x.options());
      down_buffer_ =
          at::empty({c.num_experts, c.hidden_size, w.down_blocks.size(2) * 32}, x.options());
    }
    kernels::mxfp4_dequantize_out(gate_up_buffer_, w.gate_up_blocks, w.gate_up_scales);
    kernels::mxfp4_dequantize_out(down_buffer_, w.down_blocks, w.down_scales);
    moe = gpt_oss_experts(h1, w, c, gate_up_buffer_, down_buffer_);
  }
  target.tp_reduce(moe, "target_tp_mlp");
  return x1 + moe;
}

ForwardResult GptOssDecoder::forward(const TargetModel& target, const at::Tensor& tokens,
                                     const PackedBatch& batch,
                                     const ForwardRequest& request) const {
  return run(target, tokens, batch.positions, batch.cu_seqlens, request, /*all_layers=*/false,
             [&](int64_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
               return sink_attention(q, k, v, layers_[i].sinks, window(i), batch);
             });
}

ForwardResult GptOssDecoder::forward_cached(const TargetModel& target, const at::Tensor& tokens,
                                            const AppendBatch& batch, KVCache& cache,
                                            const ForwardRequest& request) const {
  std::optional<WindowPlan> plan;
  if (cache.has_rings()) plan = WindowPlan::make(cache, batch);
  return run(target, tokens, batch.positions, batch.cu_seqlens, request, /*all_layers=*/true,
             [&](int64_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
               if (cache.ring_rows(i) == 0) {
                 cache.update(i, batch.rows, k, v);
                 return cached_sink_attention(q, cache, i, batch, layers_[i].sinks, window(i));
               }
               // Gathered before the ring is written: a long append wraps over its prefix.
               auto [ring_k, ring_v] = plan->gather(cache, i, k, v);
               cache.update(i, plan->write_rows, k, v);
               const GatheredKeys gathered{*plan, ring_k, ring_v};
               return cached_sink_attention(q, cache, i, batch, layers_[i].sinks, window(i),
                                            &gathered);
             });
}

ForwardResult GptOssDecoder::run(const TargetModel& target, const at::Tensor& tokens,
                                 const at::Tensor& positions, const at::Tensor& cu_seqlens,
                                 const ForwardRequest& request, bool all_layers,
                                 const Attend& attend) const {
  if (request.gemms == PrefillGemms::kFp8) {
    fail("gpt-oss target: --prefill-gemms fp8 is not implemented (aten or tuned)");
  }
  std::optional<c10::NoGradGuard> no_grad;
  if (!request.grad) no_grad.emplace();
  for (int64_t id : request.tap_layers) {
    if (id < 0 || id >= config_.num_layers) {
      fail("target forward: tap layer {} is out of range [0, {})", id, config_.num_layers);
    }
  }
  ForwardResult result;
  result.taps.resize(request.tap_layers.size());
  auto x = target.embed(tokens);
  auto [cos, sin] = rotary_.tables(positions, x.scalar_type());
  const int64_t layers =
      !all_layers && request.logits == Logits::kNone && !request.tap_layers.empty()
          ? layers_for_taps(request.tap_layers)
          : config_.num_layers;
  for (int64_t i = 0; i < layers; ++i) {
    x = layer(target, i, x, cos, sin, attend, request.mxfp4);
    for (size_t j = 0; j < request.tap_layers.size(); ++j) {
      if (request.tap_layers[j] == i) result.taps[j] = x;
    }
  }
  if (request.logits == Logits::kNone) return result;
  if (request.logits == Logits::kLast) {
    x = x.index_select(0, cu_seqlens.narrow(0, 1, cu_seqlens.size(0) - 1).to(at::kLong) - 1);
  }
  result.logits = target.lm_head(rms_norm(x, target.final_norm(), config_.rms_norm_eps));
  return result;
}

std::vector<std::pair<std::string, at::Tensor>> GptOssDecoder::hf_state_dict() const {
  const ModelConfig& c = config_;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const GptOssLayerWeights& l = layers_[i];
    const std::string p = c.layer_prefix(i), a = p + "self_attn.", x = p + "mlp.experts.";
    out.push_back({p + "input_layernorm.weight", l.input_norm});
    out.push_back({p + "post_attention_layernorm.weight", l.post_attention_norm});
    const std::pair<const char*, std::pair<int64_t, int64_t>> parts[] = {
        {"q", {0, q}}, {"k", {q, kv}}, {"v", {q + kv, kv}}};
    for (const auto& [name, range] : parts) {
      out.push_back(
          {fmt::format("{}{}_proj.weight", a, name), l.w_qkv.narrow(0, range.first, range.second)});
      if (l.b_qkv.defined()) {
        out.push_back(
            {fmt::format("{}{}_proj.bias", a, name), l.b_qkv.narrow(0, range.first, range.second)});
      }
    }
    out.push_back({a + "o_proj.weight", l.w_o});
    if (l.b_o.defined()) out.push_back({a + "o_proj.bias", l.b_o});
    out.push_back({a + "sinks", l.sinks});
    out.push_back({p + "mlp.router.weight", l.router});
    out.push_back({p + "mlp.router.bias", l.router_bias});
    if (l.gate_up_blocks.defined()) {
      out.push_back({x + "gate_up_proj_blocks", l.gate_up_blocks});
      out.push_back({x + "gate_up_proj_scales", l.gate_up_scales});
      out.push_back({x + "down_proj_blocks", l.down_blocks});
      out.push_back({x + "down_proj_scales", l.down_scales});
    } else {
      out.push_back({x + "gate_up_proj", l.gate_up.transpose(1, 2)});
      out.push_back({x + "down_proj", l.down.transpose(1, 2)});
    }
    out.push_back({x + "gate_up_proj_bias", l.gate_up_bias});
    out.push_back({x + "down_proj_bias", l.down_bias});
  }
  return out;
}

int64_t GptOssDecoder::expert_bytes() const {
  int64_t bytes = 0;
  for (const auto& l : layers_) {
    for (const at::Tensor* t : {&l.gate_up, &l.down, &l.gate_up_blocks, &l.gate_up_scales,
                                &l.down_blocks, &l.down_scales, &l.gate_up_bias, &l.down_bias}) {
      if (t->defined()) bytes += static_cast<int64_t>(t->nbytes());
    }
  }
  return bytes;
}

int64_t GptOssDecoder::dequant_buffer_bytes() const {
  if (layers_.empty() || layers_[0].gate_up.defined()) return 0;
  const ModelConfig& c = config_;
  return 3 * c.num_experts * c.hidden_size * (c.moe_intermediate_size / split_.ranks) *
         static_cast<int64_t>(c10::elementSize(layers_[0].w_qkv.scalar_type()));
}

}  // namespace dflash::models
