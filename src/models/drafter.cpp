#include "models/drafter.h"

#include <c10/core/GradMode.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "common/error.h"
#include "common/file.h"
#include "common/json_file.h"
#include "io/safetensors.h"
#include "kernels/cudnn_attention.h"
#include "kernels/decode_ops.h"
#include "kernels/fp8_rows.h"
#include "kernels/residual_norm.h"
#include "kernels/rotary.h"
#include "kernels/small_linear.h"
#include "kernels/swiglu.h"
#include "models/linear_group.h"
#include "models/prefix_attention.h"
#include "models/target.h"

namespace dflash::models {
namespace {

using nlohmann::json;

std::string layer_name(int64_t i, const char* rest) { return fmt::format("layers.{}.{}", i, rest); }

struct BlockQkv {
  at::Tensor q, k, v;  // [rows, Hq, D], [rows, Hkv, D] x2
};

// {x + pending, rms_norm(x + pending) * weight}: the add and the norm in one pass each way
// (kernels::residual_rms_norm); x itself when nothing is pending.
std::pair<at::Tensor, at::Tensor> add_and_norm(const Residual& r, const at::Tensor& weight,
                                               double eps) {
  if (!r.pending.defined()) return {r.x, rms_norm(r.x, weight, eps)};
  return kernels::residual_rms_norm(r.x, r.pending, weight, eps);
}

// q_norm/k_norm and RoPE over the q/k/v_proj products [rows, heads * D]: q at q_cos/q_sin
// (the query rows, which may be fewer than the key rows), k at cos/sin; q may be undefined (the
// context has no queries). Weights are cast to `dtype` (a no-op when they already are).
BlockQkv norm_and_rotate(const DrafterLayerWeights& w, const ModelConfig& c, const at::Tensor& q,
                         const at::Tensor& k, const at::Tensor& v, const at::Tensor& q_cos,
                         const at::Tensor& q_sin, const at::Tensor& cos, const at::Tensor& sin,
                         at::ScalarType dtype) {
  const double eps = c.rms_norm_eps;
  const int64_t d = c.head_dim;
  BlockQkv out;
  if (q.defined()) {
    out.q = kernels::norm_rotary(q.view({q.size(0), c.num_heads, d}), w.q_norm.to(dtype), q_cos,
                                 q_sin, eps);
  }
  out.k = kernels::norm_rotary(k.view({k.size(0), c.num_kv_heads, d}), w.k_norm.to(dtype), cos, sin,
                               eps);
  out.v = v.view({v.size(0), c.num_kv_heads, d});
  return out;
}

// The block's queries at cos/sin, inference: `qkv` is the block rows' q/k/v_proj output (one
// GEMM); the q/k norms, RoPE and the write of K and V to cache rows `rows` of `layer` are one
// kernel (kernels::qk_norm_rotary_into_cache; three launches as norm_and_rotate and
// KVCache::update).
at::Tensor block_queries(const ModelConfig& c, const at::Tensor& qkv, const at::Tensor& q_norm,
                         const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin,
                         KVCache& cache, int64_t layer, const at::Tensor& rows,
                         bool q_group_major) {
  return kernels::qk_norm_rotary_into_cache(qkv, c.num_heads, c.num_kv_heads, q_norm, k_norm, cos,
                                            sin, c.rms_norm_eps, cache.keys(layer),
                                            cache.values(layer), rows, q_group_major);
}

// Rows of block positions 1..B-1 of [blocks*B, ...] rows (a copy; its backward scatters).
at::Tensor prediction_rows(const at::Tensor& t, int64_t blocks, int64_t block_size) {
  auto sizes = t.sizes().vec();
  sizes[0] = blocks * (block_size - 1);
  return t.view({blocks, block_size, -1}).narrow(1, 1, block_size - 1).reshape(sizes);
}

// [blocks + 1, C] distinct rows (each block's anchor row, then the MASK row) -> the blocks'
// rows: [blocks*B, C] (anchor, then MASK B-1 times), or [blocks*(B-1), C] (the MASK rows) with
// `predictions`. The backward sums the MASK rows' gradients (in fp32 for bf16).
at::Tensor spread_to_blocks(const at::Tensor& distinct, int64_t blocks, int64_t block_size,
                            bool predictions) {
  const int64_t width = distinct.size(1);
  auto mask = distinct.narrow(0, blocks, 1);
  if (predictions) return mask.expand({blocks * (block_size - 1), width}).contiguous();
  return at::cat({distinct.narrow(0, 0, blocks).unsqueeze(1),
                  mask.unsqueeze(0).expand({blocks, block_size - 1, width})},
                 1)
      .view({blocks * block_size, width});
}

// K/V injection: the same k_proj/v_proj (and k_norm, RoPE at absolute positions) over the
// context rows as over the block rows, written to cache rows `rows` of `layer`. The context is
// not passed through input_layernorm (z-lab's DFlashDraftModel feeds hidden_norm(fc(taps))
// straight to k_proj/v_proj), and it skips Q, O and the MLP. Inference: `kv` is the context
// rows' k/v_proj output (one GEMM), then the norm, RoPE and the write in one kernel (no query
// heads).
void write_context_kv(const ModelConfig& c, const at::Tensor& kv, const at::Tensor& k_norm,
                      const at::Tensor& cos, const at::Tensor& sin, KVCache& cache, int64_t layer,
                      const at::Tensor& rows) {
  kernels::qk_norm_rotary_into_cache(kv, /*q_heads=*/0, c.num_kv_heads, k_norm, k_norm, cos, sin,
                                     c.rms_norm_eps, cache.keys(layer), cache.values(layer), rows);
}

void check_features(const DrafterConfig& config, const at::Tensor& features) {
  const int64_t kh = config.num_taps() * config.layers.hidden_size;
  if (features.dim() != 2 || features.size(1) != kh) {
    fail("drafter: features must be [tokens, {}] ({} taps x hidden {}), got {}", kh,
         config.num_taps(), config.layers.hidden_size, features.sizes());
  }
}

// hidden_norm(fc(features)): the context every drafter layer reads.
at::Tensor fused_context(const DrafterConfig& config, const at::Tensor& features,
                         const at::Tensor& fc, const at::Tensor& hidden_norm,
                         at::ScalarType dtype) {
  check_features(config, features);
  auto fused = kernels::inference_linear(features.to(dtype), fc.to(dtype));
  return rms_norm(fused, hidden_norm.to(dtype), config.layers.rms_norm_eps);
}

// The rest of a drafter layer after attention: o_proj and residual, then the SwiGLU MLP, whose
// output is left pending for the next norm to add.
// With `fp8`, every projection is an FP8 linear_group (see Drafter::forward).
Residual layer_output(const DrafterLayerWeights& w, const ModelConfig& c, const at::Tensor& x,
                      const at::Tensor& attn, at::ScalarType dtype, bool fp8) {
  const int64_t rows = x.size(0);
  auto linear = [&](const at::Tensor& in, const at::Tensor& weight) {
    return fp8 ? linear_group({in}, {weight}, {{0, 0}}, true)[0]
               : kernels::inference_linear(in, weight);
  };
  auto o = linear(attn.reshape({rows, c.num_heads * c.head_dim}), w.o_proj.to(dtype));
  auto [x1, h2] = add_and_norm({x, o}, w.post_attention_norm.to(dtype), c.rms_norm_eps);
  auto both =
      linear_group({h2}, {w.gate_proj.to(dtype), w.up_proj.to(dtype)}, {{0, 0}, {0, 1}}, fp8);
  return {x1, linear(kernels::swiglu(both[0], both[1]), w.down_proj.to(dtype))};
}

}  // namespace

double default_gamma(int64_t block_size) {
  if (block_size == 10) return 5.0;
  if (block_size == 8) return 4.0;
  return 7.0;
}

std::vector<int64_t> default_target_layer_ids(int64_t target_layers, int64_t k) {
  if (k < 1) fail("drafter: the number of tapped target layers must be at least 1, got {}", k);
  if (target_layers < 5) {
    fail(
        "drafter: the default tap spread needs a target of at least 5 layers (ids 1..L-3), "
        "the target has {}; pass target_layer_ids explicitly",
        target_layers);
  }
  // K = 1 makes the formula divide by zero: tap the middle layer (L // 2).
  if (k == 1) return {target_layers / 2};
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < k; ++i) {
    // Python evaluates 1 + i*(L-4)/(K-1) as an exact integer product, one correctly rounded
    // true division and a float add; the same steps in double give the same value bit for bit.
    const double x =
        1.0 + static_cast<double>(i * (target_layers - 4)) / static_cast<double>(k - 1);
    // Python's round() breaks ties to even (20.5 -> 20 for L = 30); std::round breaks them away
    // from zero, and nearbyint depends on the floating-point environment's rounding mode.
    double r = std::round(x);
    if (std::abs(r - x) == 0.5) r = 2.0 * std::round(x / 2.0);
    ids.push_back(static_cast<int64_t>(r));
  }
  return ids;
}

void DrafterConfig::validate(const ModelConfig& target) const {
  const std::string who = "drafter config";
  layers.validate(who);
  if (!layers.qk_norm || layers.attention_bias) {
    fail("{}: drafter layers are Qwen3 layers (q_norm/k_norm, no attention bias)", who);
  }
  if (layers.hidden_size != target.hidden_size) {
    fail(
        "{}: hidden_size {} differs from the target's {}; the drafter must have the target's "
        "width (it reads target features and uses the target's LM head)",
        who, layers.hidden_size, target.hidden_size);
  }
  if (layers.vocab_size != target.vocab_size) {
    fail("{}: vocab_size {} differs from the target's {} (the drafter uses the target's LM head)",
         who, layers.vocab_size, target.vocab_size);
  }
  if (num_target_layers != target.num_layers) {
    fail(
        "{}: num_target_layers is {} but the target has {} layers (a drafter trained for "
        "another target?)",
        who, num_target_layers, target.num_layers);
  }
  if (target_layer_ids.empty()) fail("{}: target_layer_ids is empty", who);
  std::set<int64_t> seen;
  for (int64_t id : target_layer_ids) {
    if (id < 0 || id >= target.num_layers) {
      fail("{}: target layer id {} is out of range [0, {}) for the target", who, id,
           target.num_layers);
    }
    if (!seen.insert(id).second) fail("{}: target layer id {} appears twice", who, id);
  }
  if (block_size < 2) fail("{}: block_size must be at least 2, got {}", who, block_size);
  if (mask_token_id < 0 || mask_token_id >= target.vocab_size) {
    fail("{}: mask_token_id {} is outside the target vocabulary [0, {})", who, mask_token_id,
         target.vocab_size);
  }
  if (!(gamma > 0)) fail("{}: gamma must be positive, got {}", who, gamma);
  if (!sliding_layers.empty()) {
    if (static_cast<int64_t>(sliding_layers.size()) != layers.num_layers) {
      fail("{}: {} sliding-layer flags for {} layers", who, sliding_layers.size(),
           layers.num_layers);
    }
    if (sliding_window < 1) {
      fail("{}: sliding_window must be a positive number of positions (layers slide), got {}", who,
           sliding_window);
    }
  }
}

DrafterConfig make_drafter_config(const ModelConfig& target, const DrafterOptions& o) {
  if (o.num_layers < 1) fail("drafter: num_layers must be at least 1, got {}", o.num_layers);
  DrafterConfig c;
  c.layers = target;
  c.layers.arch = Architecture::kQwen3;
  // Dense whatever the target: an MoE target's drafter takes the config's intermediate_size.
  c.layers.num_experts = 0;
  c.layers.num_experts_per_tok = 0;
  c.layers.moe_intermediate_size = 0;
  c.layers.mlp_only_layers.clear();
  c.layers.shared_expert_intermediate_size = 0;
  // Qwen3 layers whatever the target: a hybrid target's linear-attention layers, partial
  // rotary, output gate, (1 + w) norms and multimodal layout are not the drafter's.
  c.layers.layer_types.clear();
  c.layers.linear = {};
  c.layers.partial_rotary_factor = 1.0;
  c.layers.attn_output_gate = false;
  c.layers.norm_plus_one = false;
  c.layers.multimodal = false;
  // Nor are gpt-oss' windows, sinks and clamped experts.
  c.layers.gpt_oss = {};
  c.layers.qk_norm = true;
  c.layers.attention_bias = false;
  c.layers.tie_word_embeddings = false;
  c.layers.num_layers = o.num_layers;
  c.layers.torch_dtype = "bfloat16";
  c.target_layer_ids = o.target_layer_ids.empty()
                           ? default_target_layer_ids(target.num_layers, o.num_layers)
                           : o.target_layer_ids;
  c.num_target_layers = target.num_layers;
  c.block_size = o.block_size;
  c.mask_token_id = o.mask_token_id;
  c.gamma = o.gamma.value_or(default_gamma(o.block_size));
  if (o.sliding_window < 0) {
    fail("drafter: the sliding window must be positive (0: none), got {}", o.sliding_window);
  }
  if (o.sliding_window > 0) {
    if (o.num_layers < 2) {
      fail("drafter: a sliding window needs at least 2 layers (the last one stays full), got {}",
           o.num_layers);
    }
    c.sliding_layers.assign(o.num_layers, true);
    c.sliding_layers.back() = false;
    c.sliding_window = o.sliding_window;
  }
  c.validate(target);
  return c;
}

json drafter_config_json(const DrafterConfig& c) {
  json j = to_hf_json(c.layers);
  j["architectures"] = {"DFlashDraftModel"};
  j["model_type"] = "qwen3";
  j["attention_bias"] = false;
  j["tie_word_embeddings"] = false;
  j["attention_dropout"] = 0.0;
  std::vector<std::string> types;
  for (int64_t i = 0; i < c.layers.num_layers; ++i) {
    types.push_back(c.window(i) > 0 ? "sliding_attention" : "full_attention");
  }
  j["layer_types"] = types;
  // transformers' Qwen3Config drops sliding_window unless use_sliding_window is set, and
  // z-lab's DFlashDraftModel reads the window from that config.
  const bool slides = !c.sliding_layers.empty();
  j["use_sliding_window"] = slides;
  if (slides) j["sliding_window"] = c.sliding_window;
  if (!j.contains("rope_scaling")) j["rope_scaling"] = nullptr;
  j["block_size"] = c.block_size;
  j["num_target_layers"] = c.num_target_layers;
  j["dflash_config"] = {{"mask_token_id", c.mask_token_id},
                        {"target_layer_ids", c.target_layer_ids}};
  if (!c.mask_token.empty()) j["dflash_config"]["mask_token"] = c.mask_token;
  return j;
}

DrafterConfig parse_drafter_config(const json& j, const std::string& origin) {
  if (!j.is_object()) fail("{}: expected a JSON object", origin);
  auto arch = j.find("architectures");
  if (arch == j.end() || !arch->is_array() || arch->empty() ||
      (*arch)[0] != json("DFlashDraftModel")) {
    fail("{}: architectures must be [\"DFlashDraftModel\"] (is this a DFlash drafter?)", origin);
  }
  DrafterConfig c;
  // Sliding layers are the drafter's own fields here: parse_model_config refuses them for a
  // target.
  json layers_json = j;
  layers_json.erase("use_sliding_window");
  c.layers = parse_model_config(layers_json, origin);
  if (c.layers.arch != Architecture::kQwen3) {
    fail("{}: model_type must be \"qwen3\" for a DFlash drafter", origin);
  }
  try {
    c.block_size = j.at("block_size").get<int64_t>();
    c.num_target_layers = j.at("num_target_layers").get<int64_t>();
    const json& d = j.at("dflash_config");
    c.mask_token_id = d.at("mask_token_id").get<int64_t>();
    c.target_layer_ids = d.at("target_layer_ids").get<std::vector<int64_t>>();
    c.mask_token = d.value("mask_token", "");
  } catch (const json::exception& e) {
    fail(
        "{}: DFlash fields (block_size, num_target_layers, dflash_config.mask_token_id, "
        "dflash_config.target_layer_ids) missing or of the wrong type: {}",
        origin, e.what());
  }
  const auto types = optional_field<std::vector<std::string>>(j, "layer_types", {}, origin);
  if (!types.empty() && static_cast<int64_t>(types.size()) != c.layers.num_layers) {
    fail("{}: layer_types has {} entries, num_hidden_layers is {}", origin, types.size(),
         c.layers.num_layers);
  }
  for (size_t i = 0; i < types.size(); ++i) {
    if (types[i] != "sliding_attention" && types[i] != "full_attention") {
      fail(
          "{}: layer_types[{}] is \"{}\" (a DFlash drafter has sliding_attention or "
          "full_attention layers)",
          origin, i, types[i]);
    }
  }
  if (std::find(types.begin(), types.end(), "sliding_attention") != types.end()) {
    if (!optional_field<bool>(j, "use_sliding_window", false, origin)) {
      fail(
          "{}: layer_types has sliding_attention layers but use_sliding_window is false: "
          "transformers then drops sliding_window and the layers would slide without a window; "
          "set use_sliding_window to true",
          origin);
    }
    for (const auto& t : types) c.sliding_layers.push_back(t == "sliding_attention");
    c.sliding_window = optional_field<int64_t>(j, "sliding_window", 0, origin);
    if (c.sliding_window < 1) {
      fail("{}: sliding_window must be a positive number of positions (layers slide), got {}",
           origin, c.sliding_window);
    }
  }
  c.gamma = default_gamma(c.block_size);
  return c;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> drafter_parameter_shapes(
    const DrafterConfig& config) {
  const ModelConfig& c = config.layers;
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t f = c.intermediate_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  out.push_back({"fc.weight", {h, config.num_taps() * h}});
  out.push_back({"hidden_norm.weight", {h}});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    out.push_back({layer_name(i, "input_layernorm.weight"), {h}});
    out.push_back({layer_name(i, "post_attention_layernorm.weight"), {h}});
    out.push_back({layer_name(i, "self_attn.q_proj.weight"), {q, h}});
    out.push_back({layer_name(i, "self_attn.k_proj.weight"), {kv, h}});
    out.push_back({layer_name(i, "self_attn.v_proj.weight"), {kv, h}});
    out.push_back({layer_name(i, "self_attn.o_proj.weight"), {h, q}});
    out.push_back({layer_name(i, "self_attn.q_norm.weight"), {c.head_dim}});
    out.push_back({layer_name(i, "self_attn.k_norm.weight"), {c.head_dim}});
    out.push_back({layer_name(i, "mlp.gate_proj.weight"), {f, h}});
    out.push_back({layer_name(i, "mlp.up_proj.weight"), {f, h}});
    out.push_back({layer_name(i, "mlp.down_proj.weight"), {h, f}});
  }
  out.push_back({"norm.weight", {h}});
  return out;
}

TargetHead TargetHead::of(const TargetModel& target) {
  // lm_head_weight() is the embedding tensor itself for tied targets: no fresh head, no copy.
  TargetHead head;
  head.embedding = target.embedding();
  head.lm_head = target.lm_head_weight();
  return head;
}

at::Tensor block_positions(const std::vector<int64_t>& anchors, int64_t block_size) {
  std::vector<int64_t> pos;
  pos.reserve(anchors.size() * block_size);
  for (int64_t a : anchors) {
    for (int64_t k = 0; k < block_size; ++k) pos.push_back(a + k);
  }
  return at::tensor(pos, at::kLong);
}

DrafterAttention parse_drafter_attention(const std::string& name, const std::string& what) {
  if (auto value = enum_value(kDrafterAttentionNames, name)) return *value;
  fail("{}: the drafter's attention must be {}, got '{}'", what,
       enum_choices(kDrafterAttentionNames), name);
}

DrafterAttention resolve_drafter_attention(DrafterAttention requested, at::Device device,
                                           at::ScalarType dtype) {
  if (requested != DrafterAttention::kAuto) return requested;
  // Over the shared segments cuDNN's backward measured 1.6x flash's and its forward 1.6x
  // (bench-kernels, H200); its tails' backward was slower than flash's, so they keep it.
  const bool flash = device.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf);
  return !flash ? DrafterAttention::kDense
         : kernels::cudnn_attention_supported(device)
             ? DrafterAttention::kGatheredCudnnSharedForward
             : DrafterAttention::kGathered;
}

at::Tensor dense_block_mask(int64_t context_len, const std::vector<int64_t>& anchors,
                            int64_t block_size, at::Device device, int64_t window) {
  const int64_t n = static_cast<int64_t>(anchors.size()), rows = n * block_size;
  auto anchor = at::tensor(anchors, at::kLong).to(device).repeat_interleave(block_size);  // [rows]
  auto key = at::arange(context_len, at::TensorOptions().dtype(at::kLong).device(device));
  auto ctx = key.unsqueeze(0) < anchor.unsqueeze(1);  // strictly before the anchor
  auto row = at::arange(rows, key.options());
  auto block_of_row = row.div(block_size, "floor");
  auto own = block_of_row.unsqueeze(1) == block_of_row.unsqueeze(0);  // own block, both ways
  if (window > 0) {
    auto position = anchor + row.remainder(block_size);  // a + k
    ctx = ctx & (key.unsqueeze(0) > (position - window).unsqueeze(1));
    // Rows of one block are consecutive, so k - k' is the row distance.
    auto back = row.unsqueeze(1) - row.unsqueeze(0);
    own = own & (back >= 0) & (back < window);
  }
  return at::cat({ctx, own}, 1);
}

Drafter::Drafter(DrafterConfig config, at::Device device)
    : config_(std::move(config)), rotary_(config_.layers, device) {}

void Drafter::allocate(at::Device device, const std::optional<at::Generator>& gen) {
  const ModelConfig& c = config_.layers;
  auto opts = at::TensorOptions().device(device).dtype(at::kFloat);
  // Drawn on the CPU and copied: a seed gives the same drafter on every device, so a GPU run
  // starts where the CPU run of the same command does.
  auto normal = [&](std::vector<int64_t> shape) {
    if (!gen) return at::empty(shape, opts);
    return at::empty(shape, at::kFloat).normal_(0, 0.02, *gen).to(device);
  };
  auto ones = [&](int64_t n) { return at::ones({n}, opts); };
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  fc_ = normal({h, config_.num_taps() * h});
  hidden_norm_ = ones(h);
  layers_.clear();
  for (int64_t i = 0; i < c.num_layers; ++i) {
    DrafterLayerWeights l;
    l.input_norm = ones(h);
    l.post_attention_norm = ones(h);
    l.q_proj = normal({q, h});
    l.k_proj = normal({kv, h});
    l.v_proj = normal({kv, h});
    l.o_proj = normal({h, q});
    l.q_norm = ones(c.head_dim);
    l.k_norm = ones(c.head_dim);
    l.gate_proj = normal({c.intermediate_size, h});
    l.up_proj = normal({c.intermediate_size, h});
    l.down_proj = normal({h, c.intermediate_size});
    layers_.push_back(std::move(l));
  }
  norm_ = ones(h);
}

void Drafter::register_parameters() {
  named_.clear();
  named_.push_back({"fc.weight", fc_});
  named_.push_back({"hidden_norm.weight", hidden_norm_});
  for (int64_t i = 0; i < static_cast<int64_t>(layers_.size()); ++i) {
    auto& l = layers_[i];
    named_.push_back({layer_name(i, "input_layernorm.weight"), l.input_norm});
    named_.push_back({layer_name(i, "post_attention_layernorm.weight"), l.post_attention_norm});
    named_.push_back({layer_name(i, "self_attn.q_proj.weight"), l.q_proj});
    named_.push_back({layer_name(i, "self_attn.k_proj.weight"), l.k_proj});
    named_.push_back({layer_name(i, "self_attn.v_proj.weight"), l.v_proj});
    named_.push_back({layer_name(i, "self_attn.o_proj.weight"), l.o_proj});
    named_.push_back({layer_name(i, "self_attn.q_norm.weight"), l.q_norm});
    named_.push_back({layer_name(i, "self_attn.k_norm.weight"), l.k_norm});
    named_.push_back({layer_name(i, "mlp.gate_proj.weight"), l.gate_proj});
    named_.push_back({layer_name(i, "mlp.up_proj.weight"), l.up_proj});
    named_.push_back({layer_name(i, "mlp.down_proj.weight"), l.down_proj});
  }
  named_.push_back({"norm.weight", norm_});
  const auto shapes = drafter_parameter_shapes(config_);
  for (size_t i = 0; i < named_.size(); ++i) {
    // The export's name list and the weights the forward uses must never drift apart.
    if (shapes[i].first != named_[i].first ||
        named_[i].second.sizes() != at::IntArrayRef(shapes[i].second)) {
      fail("drafter: internal parameter list mismatch at {}", named_[i].first);
    }
    named_[i].second.requires_grad_(true);
  }
}

Drafter Drafter::random(const DrafterConfig& config, at::Device device, uint64_t seed) {
  Drafter d(config, device);
  d.allocate(device, seeded_generator(at::kCPU, seed));
  d.register_parameters();
  return d;
}

Drafter Drafter::from_target_layers(const DrafterConfig& config, const TargetModel& target,
                                    const std::vector<int64_t>& source_layers, uint64_t seed) {
  const ModelConfig& t = target.config();
  config.validate(t);
  if (static_cast<int64_t>(source_layers.size()) != config.layers.num_layers) {
    fail("drafter init: {} source layers given for {} drafter layers", source_layers.size(),
         config.layers.num_layers);
  }
  const ModelConfig& c = config.layers;
  if (c.num_heads != t.num_heads || c.num_kv_heads != t.num_kv_heads || c.head_dim != t.head_dim ||
      c.intermediate_size != t.intermediate_size) {
    fail(
        "drafter init: copying target layers needs the target's layer shape (heads {}/{}, "
        "head_dim {}, intermediate {})",
        t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size);
  }
  Drafter d = random(config, target.device(), seed);
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < source_layers.size(); ++i) {
    const int64_t src = source_layers[i];
    if (src < 0 || src >= t.num_layers) {
      fail("drafter init: source layer {} is out of range [0, {})", src, t.num_layers);
    }
    if (target.gpt_oss() != nullptr) {
      fail("drafter init: gpt-oss layers (sinks, MoE) cannot be copied into drafter layers");
    }
    const TargetLayerWeights& s = target.layers()[src];
    if (!s.w_gate_up.defined()) {
      fail("drafter init: target layer {} has a sparse (MoE) MLP; copy only dense layers", src);
    }
    if (!s.w_qkv.defined() || t.attn_output_gate) {
      fail(
          "drafter init: target layer {} is a {} layer, not a Qwen3 one; copy only plain attention "
          "layers",
          src, s.w_qkv.defined() ? "gated attention" : "linear-attention (Gated DeltaNet)");
    }
    DrafterLayerWeights& l = d.layers_[i];
    l.input_norm.copy_(s.input_norm);
    l.post_attention_norm.copy_(s.post_attention_norm);
    l.q_proj.copy_(s.w_qkv.narrow(0, 0, q));
    l.k_proj.copy_(s.w_qkv.narrow(0, q, kv));
    l.v_proj.copy_(s.w_qkv.narrow(0, q + kv, kv));
    l.o_proj.copy_(s.w_o);
    if (s.q_norm.defined()) l.q_norm.copy_(s.q_norm);
    if (s.k_norm.defined()) l.k_norm.copy_(s.k_norm);
    l.gate_proj.copy_(s.w_gate_up.narrow(0, 0, c.intermediate_size));
    l.up_proj.copy_(s.w_gate_up.narrow(0, c.intermediate_size, c.intermediate_size));
    l.down_proj.copy_(s.w_down);
  }
  return d;
}

Drafter Drafter::load(const std::filesystem::path& dir, const ModelConfig& target,
                      at::Device device) {
  const auto config_path = dir / "config.json";
  DrafterConfig config = parse_drafter_config(read_json_file(config_path), config_path.string());
  auto ckpt = io::Checkpoint::open(dir);
  std::vector<std::pair<std::string, at::Tensor>> values;
  for (const auto& [name, shape] : drafter_parameter_shapes(config)) {
    if (!ckpt.contains(name)) fail("{}: tensor {} is missing", dir.string(), name);
    values.push_back({name, ckpt.tensor(name)});
  }
  return from_tensors(config, values, target, device, dir.string());
}

Drafter Drafter::from_tensors(const DrafterConfig& config,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const ModelConfig& target, at::Device device,
                              const std::string& origin) {
  try {
    config.validate(target);
  } catch (const Error& e) {
    fail("{}: does not fit the target: {}", origin, e.what());
  }
  Drafter out(config, device);
  out.allocate(device, std::nullopt);
  out.register_parameters();
  out.assign(tensors, origin);
  return out;
}

void Drafter::assign(const std::vector<std::pair<std::string, at::Tensor>>& values,
                     const std::string& origin) {
  std::map<std::string, at::Tensor> by_name(values.begin(), values.end());
  c10::NoGradGuard no_grad;
  for (auto& [name, p] : named_) {
    auto it = by_name.find(name);
    if (it == by_name.end()) fail("{}: tensor {} is missing", origin, name);
    if (it->second.sizes() != p.sizes()) {
      fail("{}: tensor {} has shape {}, the drafter config implies {} (another config?)", origin,
           name, it->second.sizes(), p.sizes());
    }
    if (!at::isFloatingType(it->second.scalar_type())) {
      fail("{}: tensor {} is not floating point", origin, name);
    }
    p.copy_(it->second);
  }
}

std::vector<at::Tensor> Drafter::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& [name, p] : named_) out.push_back(p);
  return out;
}

int64_t Drafter::num_parameters() const {
  int64_t n = 0;
  for (const auto& [name, p] : named_) n += p.numel();
  return n;
}

void write_drafter_export(const std::filesystem::path& dir, const DrafterConfig& config,
                          const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::filesystem::create_directories(dir);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : named) tensors.push_back({name, t.detach().to(at::kBFloat16)});
  io::write_checkpoint(dir, tensors, /*max_shard_bytes=*/~0ull);
  write_file_atomic(dir / "config.json", drafter_config_json(config).dump(2));
}

void Drafter::save(const std::filesystem::path& dir) const {
  write_drafter_export(dir, config_, named_);
}

namespace {

// named_ order: fc, hidden_norm, each layer's weights in DrafterLayerWeights' field order, norm.
constexpr size_t kPerLayer = 11;
// The layer field the context's keys read too (k_norm): forward() reads it twice, once for the
// block's keys and once for the context's. (k_proj and v_proj serve both as well, but inside
// one linear_group, which sums their two gradients in its GEMMs.)
constexpr size_t kContextKNorm = 7;

bool read_twice_in_forward(size_t i, size_t num_layers) {
  return i >= 2 && i < 2 + num_layers * kPerLayer && (i - 2) % kPerLayer == kContextKNorm;
}

// A compute copy read in the forward: its gradient reaches the fp32 master as Tensor::to's does.
struct ReadCopy : public torch::autograd::Function<ReadCopy> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& /*master*/,
                            const at::Tensor& copy) {
    return copy;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext*,
                                               torch::autograd::tensor_list grads) {
    return {grads[0].to(at::kFloat), at::Tensor()};
  }
};

}  // namespace

const std::vector<at::Tensor>& Drafter::compute_copies(at::ScalarType dtype,
                                                       bool gradients_on_copies) {
  if (dtype == at::kFloat) fail("drafter: the masters are fp32; no compute copies in fp32");
  if (copies_.empty() || copy_dtype_ != dtype) {
    c10::NoGradGuard no_grad;
    copies_.clear();
    copy_versions_.clear();
    for (const auto& [name, p] : named_) {
      copies_.push_back(p.detach().to(dtype));
      copy_versions_.push_back(p._version());
    }
    copy_dtype_ = dtype;
  }
  gradients_on_copies_ = gradients_on_copies;
  for (size_t i = 0; i < copies_.size(); ++i) {
    copies_[i].requires_grad_(copy_holds_grad(i));
    if (!copy_holds_grad(i)) copies_[i].mutable_grad() = at::Tensor();
  }
  return copies_;
}

bool Drafter::copy_holds_grad(size_t i) const {
  // A weight read twice keeps the fp32 route: its two gradients are summed in fp32 there, and
  // would be in bf16 on a copy.
  return gradients_on_copies_ && !read_twice_in_forward(i, layers_.size());
}

at::Tensor Drafter::compute_weight(size_t i, at::ScalarType dtype) const {
  const at::Tensor& p = named_[i].second;
  if (copies_.empty() || copy_dtype_ != dtype) return p.to(dtype);
  if (p._version() != copy_versions_[i]) {
    c10::NoGradGuard no_grad;
    copies_[i].copy_(p.detach());
    copy_versions_[i] = p._version();
  }
  return copy_holds_grad(i) ? copies_[i] : ReadCopy::apply(p, copies_[i]);
}

at::Tensor Drafter::context(const at::Tensor& features, at::ScalarType dtype) const {
  return fused_context(config_, features, fc_, hidden_norm_, dtype);
}

at::Tensor Drafter::forward(const at::Tensor& features, const PackedBatch& batch,
                            const BlockLayout& layout, const TargetHead& head, at::ScalarType dtype,
                            DrafterAttention attention, BlockRows rows, bool fp8_gemms) const {
  const int64_t n = layout.num_blocks(), bs = layout.block_size;
  if (features.size(0) != batch.total) {
    fail("drafter: features have {} rows, the packed batch has {} tokens", features.size(0),
         batch.total);
  }
  if (layout.block_size != config_.block_size) {
    fail("drafter: block layout has block size {}, the drafter {}", layout.block_size,
         config_.block_size);
  }
  if (n == 0) fail("drafter: no blocks to run");
  if (!layout.anchor_ids.defined() || layout.anchor_ids.dim() != 1 ||
      layout.anchor_ids.size(0) != n) {
    fail("drafter: the block layout's anchor_ids must be [{}] (one per block), got {}", n,
         layout.anchor_ids.defined() ? layout.anchor_ids.sizes() : at::IntArrayRef{});
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = layout.sequence[i];
    if (s < 0 || s >= batch.size() || (i > 0 && s < layout.sequence[i - 1])) {
      fail("drafter: blocks must be grouped by sequence in batch order (block {})", i);
    }
    if (layout.anchor[i] < 0 || layout.anchor[i] >= batch.lengths[s]) {
      fail("drafter: anchor {} of block {} is outside its sequence of length {}", layout.anchor[i],
           i, batch.lengths[s]);
    }
  }
  if (head.embedding.size(1) != config_.layers.hidden_size) {
    fail("drafter: target embedding width {} differs from the drafter's {}", head.embedding.size(1),
         config_.layers.hidden_size);
  }
  attention = resolve_drafter_attention(attention, features.device(), dtype);
  // A weight used twice (k_norm serves the block and the context) is read twice, so that its
  // two gradients reach the fp32 master separately, as two casts did.
  auto weight = [&](size_t i) { return compute_weight(i, dtype); };
  auto ctx = fused_context(config_, features, weight(0), weight(1), dtype);
  // The embedding is frozen: at::embedding of a tensor without requires_grad records nothing.
  // The blocks' inputs have blocks + 1 distinct rows: each anchor's token, then the MASK's.
  auto distinct_ids = at::cat(
      {layout.anchor_ids, at::full({1}, config_.mask_token_id, layout.anchor_ids.options())});
  auto distinct = at::embedding(head.embedding, distinct_ids).to(dtype);
  Residual stream{spread_to_blocks(distinct, n, bs, /*predictions=*/false), {}};
  const at::Device device = stream.x.device();
  auto [ctx_cos, ctx_sin] = rotary_.tables(batch.positions, dtype);
  auto [blk_cos, blk_sin] = rotary_.tables(layout.positions, dtype);
  // Built once for all layers.
  std::optional<kernels::PrefixGatherPlan> gathered;
  std::optional<PrefixAttentionPlan> in_place;
  const bool cudnn = attention == DrafterAttention::kGatheredCudnnShared ||
                     attention == DrafterAttention::kGatheredCudnnSharedForward ||
                     attention == DrafterAttention::kGatheredCudnn;
  if (attention == DrafterAttention::kGathered || cudnn) {
    const bool flash = device.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf);
    if (flash) {
      in_place = PrefixAttentionPlan::build(batch.lengths, layout.sequence, layout.anchor,
                                            layout.block_size, device);
      if (cudnn) {
        auto use = [](bool cudnn) {
          return cudnn ? AttentionKernel::kCudnn : AttentionKernel::kFlash;
        };
        in_place->set_kernels({AttentionKernel::kCudnn,
                               use(attention == DrafterAttention::kGatheredCudnn),
                               use(attention == DrafterAttention::kGatheredCudnnSharedForward)});
      }
    } else if (cudnn) {
      fail("drafter: the cuDNN attention needs CUDA bf16/fp16, got {} {}", device.str(),
           c10::toString(dtype));
    } else {
      gathered = kernels::PrefixGatherPlan::build(batch.lengths, layout.sequence, layout.anchor,
                                                  layout.block_size, device);
    }
  }
  // A sliding layer's keys per block where flash runs: context rows [a - W + 1, a), then the
  // block (flash's causal window does the rest). Sliding layers take dense attention elsewhere.
  std::optional<kernels::PrefixGatherPlan> windowed;
  const int64_t window = config_.sliding_window;
  if (in_place && window > 0) {
    std::vector<int64_t> begins;
    for (int64_t a : layout.anchor) begins.push_back(std::max<int64_t>(0, a - window + 1));
    windowed = kernels::PrefixGatherPlan::build(batch.lengths, layout.sequence, layout.anchor,
                                                layout.block_size, device, begins);
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    const size_t first = 2 + l * kPerLayer;
    DrafterLayerWeights layer;
    at::Tensor* fields[] = {&layer.input_norm, &layer.post_attention_norm,
                            &layer.q_proj,     &layer.k_proj,
                            &layer.v_proj,     &layer.o_proj,
                            &layer.q_norm,     &layer.k_norm,
                            &layer.gate_proj,  &layer.up_proj,
                            &layer.down_proj};
    for (size_t f = 0; f < kPerLayer; ++f) *fields[f] = weight(first + f);
    const at::Tensor context_k_norm = weight(first + kContextKNorm);
    const bool predictions = rows == BlockRows::kPredictions && l + 1 == layers_.size();
    stream = layer_forward(layer, context_k_norm, stream, l == 0 ? distinct : at::Tensor(),
                           predictions, ctx, ctx_cos, ctx_sin, blk_cos, blk_sin, batch, layout,
                           dtype, gathered ? &*gathered : nullptr, in_place ? &*in_place : nullptr,
                           config_.window(static_cast<int64_t>(l)), windowed ? &*windowed : nullptr,
                           fp8_gemms);
  }
  return add_and_norm(stream, weight(named_.size() - 1), config_.layers.rms_norm_eps).second;
}

Residual Drafter::layer_forward(const DrafterLayerWeights& w, const at::Tensor& context_k_norm,
                                const Residual& input, const at::Tensor& distinct, bool predictions,
                                const at::Tensor& ctx, const at::Tensor& ctx_cos,
                                const at::Tensor& ctx_sin, const at::Tensor& blk_cos,
                                const at::Tensor& blk_sin, const PackedBatch& batch,
                                const BlockLayout& layout, at::ScalarType dtype,
                                const kernels::PrefixGatherPlan* gathered,
                                const PrefixAttentionPlan* in_place, int64_t window,
                                const kernels::PrefixGatherPlan* windowed, bool fp8_gemms) const {
  const ModelConfig& c = config_.layers;
  const int64_t n = layout.num_blocks(), bs = layout.block_size, d = c.head_dim;
  const int64_t hkv = c.num_kv_heads, groups = c.num_heads / hkv;
  // Query rows per block: the anchor row predicts nothing, so a last layer returning only the
  // predicting rows needs neither its query nor anything after attention.
  const int64_t qb = predictions ? bs - 1 : bs;
  at::Tensor x, h;
  if (distinct.defined()) {
    // First layer: its norm and projections over the distinct rows (1/B of the rows), the
    // products spread to the blocks. Exact: equal rows have equal products.
    x = input.x;
    h = rms_norm(distinct, w.input_norm.to(dtype), c.rms_norm_eps);
  } else {
    std::tie(x, h) = add_and_norm(input, w.input_norm.to(dtype), c.rms_norm_eps);
  }
  if (predictions) x = prediction_rows(x, n, bs);
  const int64_t rows = x.size(0);
  // Block-sparse attention folds GQA into the query rows (below), which wants q's heads in
  // group-major order (the G query heads of one KV head G*Hkv*D apart): q_proj's rows and
  // o_proj's columns permuted to that order make the fold, and the unfold of the output, free
  // views. Permuting the two weights copies 2 x Hq*D*H elements per layer, against four copies of
  // the [rows, Hq, D] activations (forward and backward).
  // A sliding layer runs flash with its window over keys gathered per block (GQA unfolded: the
  // fold would break the window's alignment of query rows to positions) or dense attention.
  DrafterLayerWeights wp = w;
  const bool sparse = window == 0 && (gathered != nullptr || in_place != nullptr);
  const bool sliding_flash = window > 0 && windowed != nullptr;
  if (sparse && groups > 1) {
    const int64_t h = c.hidden_size;
    wp.q_proj = swap_middle_dims(w.q_proj, 1, hkv, groups, d * h);
    wp.o_proj = swap_middle_dims(w.o_proj, h, hkv, groups, d);
  }
  const at::Tensor q_cos = predictions ? prediction_rows(blk_cos, n, bs) : blk_cos;
  const at::Tensor q_sin = predictions ? prediction_rows(blk_sin, n, bs) : blk_sin;
  // The five products of the attention inputs (q, the block's k/v, the context's k/v) as one
  // node: h's three gradients and each of k_proj/v_proj's two are summed in the GEMMs.
  std::vector<at::Tensor> inputs = {h, ctx};
  int64_t q_input = 0;
  if (predictions && !distinct.defined()) {
    inputs.push_back(prediction_rows(h, n, bs));
    q_input = 2;
  }
  auto p = linear_group(inputs, {wp.q_proj.to(dtype), w.k_proj.to(dtype), w.v_proj.to(dtype)},
                        {{q_input, 0}, {0, 1}, {0, 2}, {1, 1}, {1, 2}}, fp8_gemms);
  if (distinct.defined()) {
    p[0] = spread_to_blocks(p[0], n, bs, predictions);
    for (int i : {1, 2}) p[i] = spread_to_blocks(p[i], n, bs, /*predictions=*/false);
  }
  auto [q, k_blk, v_blk] =
      norm_and_rotate(wp, c, p[0], p[1], p[2], q_cos, q_sin, blk_cos, blk_sin, dtype);
  DrafterLayerWeights context_w;
  context_w.k_norm = context_k_norm;
  const auto context =
      norm_and_rotate(context_w, c, at::Tensor(), p[3], p[4], {}, {}, ctx_cos, ctx_sin, dtype);
  const at::Tensor &k_ctx = context.k, &v_ctx = context.v;

  at::Tensor attn;  // [rows, Hq, D], heads in wp's order
  if (sliding_flash) {
    const kernels::PrefixGatherPlan& plan = *windowed;
    const int64_t kv_width = hkv * d;
    auto gather_rows = [&](const at::Tensor& ctx_part, const at::Tensor& blk_part) {
      auto all = at::cat({ctx_part, blk_part}).view({-1, kv_width});
      return kernels::prefix_gather(all, plan).view({-1, hkv, d});
    };
    auto cu_q = at::arange(0, (n + 1) * qb, qb, q.options().dtype(at::kInt));
    // Flash aligns the causal window to the end of each segment: query k of a block (position
    // a + k, its block's last rows when only the predicting rows run) meets its own row.
    attn = std::get<0>(at::_flash_attention_forward(
        q, gather_rows(k_ctx, k_blk), gather_rows(v_ctx, v_blk), cu_q, plan.cu_keys, qb,
        plan.max_keys, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false, std::nullopt,
        flash_window_left(window), 0));
  } else if (!sparse) {
    std::vector<at::Tensor> outs;
    int64_t ctx_start = 0, block = 0;
    for (int64_t s = 0; s < batch.size(); ++s) {
      const int64_t len = batch.lengths[s];
      std::vector<int64_t> anchors;
      const int64_t first = block;
      while (block < layout.num_blocks() && layout.sequence[block] == s) {
        anchors.push_back(layout.anchor[block++]);
      }
      if (!anchors.empty()) {
        const int64_t blocks = static_cast<int64_t>(anchors.size()), nrows = blocks * bs;
        auto keys = at::cat({k_ctx.narrow(0, ctx_start, len), k_blk.narrow(0, first * bs, nrows)});
        auto vals = at::cat({v_ctx.narrow(0, ctx_start, len), v_blk.narrow(0, first * bs, nrows)});
        auto mask = dense_block_mask(len, anchors, bs, x.device(), window);
        if (predictions) mask = prediction_rows(mask, blocks, bs);
        auto view = [](const at::Tensor& a) { return a.transpose(0, 1).unsqueeze(0); };
        auto o = at::scaled_dot_product_attention(view(q.narrow(0, first * qb, blocks * qb)),
                                                  view(keys), view(vals), mask, 0.0, false,
                                                  std::nullopt, /*enable_gqa=*/true);
        outs.push_back(o.squeeze(0).transpose(0, 1));
      }
      ctx_start += len;
    }
    attn = outs.size() == 1 ? outs[0] : at::cat(outs, 0);
  } else {
    // Block-sparse: work and memory are linear in sum(a_i + B) and nothing is spent on
    // masked-out keys.
    // GQA folded into the query rows: the G = Hq/Hkv query heads that share a KV head become
    // G*B query rows of one KV head (rows ordered block, position, group), so attention runs
    // with Hkv heads and no GQA. Flash's GQA backward would otherwise expand dK/dV of every
    // gathered key to Hq heads and sum them back (the biggest cost of the step when measured),
    // and a block's 16 queries alone would fill an eighth of a 128-row tile.
    auto q_packed = q.view({n * qb * groups, hkv, d});
    const int64_t q_rows = groups * qb;
    at::Tensor packed;  // [n*G*qb, Hkv, D]
    if (in_place != nullptr) {
      // Context keys in place, blocks of close anchors grouped (prefix_attention.h).
      packed = prefix_attention(q_packed, k_ctx, v_ctx, k_blk, v_blk, *in_place);
    } else {
      const kernels::PrefixGatherPlan& plan = *gathered;
      // Each block's keys gathered into their own segment, one SDPA each (flash has no fp32):
      // lets CPU and fp32 GPU tests check the gather plan and the head packing.
      const int64_t kv_width = c.num_kv_heads * d;
      auto gather_rows = [&](const at::Tensor& ctx_part, const at::Tensor& blk_part) {
        auto all = at::cat({ctx_part, blk_part}).view({-1, kv_width});
        return kernels::prefix_gather(all, plan).view({-1, c.num_kv_heads, d});
      };
      auto k_g = gather_rows(k_ctx, k_blk);
      auto v_g = gather_rows(v_ctx, v_blk);
      std::vector<at::Tensor> outs;
      int64_t key_start = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t nk = plan.key_lengths[i];
        auto view = [](const at::Tensor& a) { return a.transpose(0, 1).unsqueeze(0); };
        auto o = at::scaled_dot_product_attention(view(q_packed.narrow(0, i * q_rows, q_rows)),
                                                  view(k_g.narrow(0, key_start, nk)),
                                                  view(v_g.narrow(0, key_start, nk)));
        outs.push_back(o.squeeze(0).transpose(0, 1));
        key_start += nk;
      }
      packed = at::cat(outs, 0);
    }
    attn = packed.view({rows, c.num_heads, d});
  }
  return layer_output(wp, c, x, attn, dtype, fp8_gemms);
}

at::Tensor DraftModel::Linear::operator()(const at::Tensor& x) const {
  if (!data.defined()) return kernels::inference_linear(x, weight);
  auto rows = x.reshape({-1, x.size(-1)});
  auto out = at::empty({rows.size(0), data.size(0)}, x.options());
  kernels::mm_fp8_rows_out(out, kernels::quantize_rows_e4m3(rows), {data, scale});
  auto sizes = x.sizes().vec();
  sizes.back() = data.size(0);
  return out.view(sizes);
}

DraftModel::Linear DraftModel::Linear::rows(int64_t first, int64_t count) const {
  if (!data.defined()) return {weight.narrow(0, first, count), {}, {}};
  return {{}, data.narrow(0, first, count), scale.narrow(0, first, count)};
}

DraftModel::DraftModel(const Drafter& drafter, TargetHead head, at::ScalarType dtype,
                       int64_t block_size, bool fp8_weights)
    : config_(drafter.config_), rotary_(drafter.rotary_), dtype_(dtype) {
  if (block_size != 0) {
    if (block_size < 2) fail("draft model: block size must be at least 2, got {}", block_size);
    config_.block_size = block_size;
  }
  if (fp8_weights && dtype != at::kBFloat16) {
    fail("draft model: FP8 drafter weights need the bf16 dtype (FP8 GEMMs write bf16), got {}",
         at::toString(dtype));
  }
  // Detached: inference must not extend the autograd graph of a drafter that is training.
  auto cast = [&](const at::Tensor& p) { return p.detach().to(dtype); };
  auto linear = [&](const at::Tensor& weight) {
    // The FP8 GEMM takes sizes in multiples of 16 (a test model's odd vocabulary keeps bf16).
    if (!fp8_weights || weight.size(0) % 16 != 0 || weight.size(1) % 16 != 0) {
      return Linear{weight, {}, {}};
    }
    // The e4m3 rows replace the bf16 weight (half the memory; nothing reads it).
    auto rows = kernels::quantize_rows_e4m3(weight);
    return Linear{{}, rows.data, rows.scale};
  };
  fc_ = linear(cast(drafter.fc_));
  hidden_norm_ = cast(drafter.hidden_norm_);
  norm_ = cast(drafter.norm_);
  for (const auto& l : drafter.layers_) {
    // One GEMM each for q/k/v (k/v alone over the context rows) and gate/up: at a speculative
    // step's few rows a GEMM costs its launch, not its bytes. Cast, then concatenated: no
    // transient copy of the pieces in the master dtype.
    auto qkv = linear(at::cat({cast(l.q_proj), cast(l.k_proj), cast(l.v_proj)}));
    const int64_t q = l.q_proj.size(0), kv = l.k_proj.size(0);
    layers_.push_back({cast(l.input_norm), cast(l.post_attention_norm), cast(l.q_norm),
                       cast(l.k_norm), qkv, qkv.rows(q, 2 * kv),
                       linear(at::cat({cast(l.gate_proj), cast(l.up_proj)})),
                       linear(cast(l.o_proj)), linear(cast(l.down_proj))});
  }
  if (head.embedding.size(1) != config_.layers.hidden_size ||
      head.lm_head.size(0) != config_.layers.vocab_size) {
    fail("draft model: target head [{}] / [{}] does not fit the drafter (hidden {}, vocab {})",
         head.embedding.sizes(), head.lm_head.sizes(), config_.layers.hidden_size,
         config_.layers.vocab_size);
  }
  embedding_ = head.embedding;
  lm_head_ = linear(head.lm_head.to(dtype));
}

KVCache DraftModel::make_cache(int64_t slots, int64_t max_context) const {
  return KVCache(config_.layers, slots, max_context + config_.block_size, device(), dtype_);
}

void DraftModel::extend(KVCache& cache, const std::vector<int64_t>& slots,
                        const std::vector<int64_t>& counts, const at::Tensor& features) const {
  c10::NoGradGuard no_grad;
  if (slots.size() != counts.size()) {
    fail("draft model: {} slots but {} counts", slots.size(), counts.size());
  }
  std::vector<int64_t> with_tokens, their_counts;
  int64_t rows = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t room = cache.capacity() - config_.block_size - cache.length(slots[i]);
    if (counts[i] < 0 || counts[i] > room) {
      fail("drafter cache: slot {} holds {} tokens; {} more exceed its {}", slots[i],
           cache.length(slots[i]), counts[i], cache.capacity() - config_.block_size);
    }
    if (counts[i] == 0) continue;
    with_tokens.push_back(slots[i]);
    their_counts.push_back(counts[i]);
    rows += counts[i];
  }
  if (features.size(0) != rows) {
    fail("draft model: features have {} rows for {} context tokens", features.size(0), rows);
  }
  if (rows == 0) return;
  auto batch = AppendBatch::make(cache, with_tokens, their_counts);
  write_context(cache, batch, features);
  for (int64_t i = 0; i < batch.size(); ++i) cache.extend(batch.slots[i], batch.counts[i]);
}

void DraftModel::write_context(KVCache& cache, const AppendBatch& batch,
                               const at::Tensor& features) const {
  c10::NoGradGuard no_grad;
  if (features.dim() != 2 || features.size(0) != batch.total) {
    fail("draft model: features must be [{}, K*H] (the batch's tokens), got {}", batch.total,
         features.sizes());
  }
  check_features(config_, features);
  auto ctx =
      rms_norm(fc_(features.to(device(), dtype_)), hidden_norm_, config_.layers.rms_norm_eps);
  auto [cos, sin] = rotary_.tables(batch.positions, dtype_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    write_context_kv(config_.layers, layers_[l].kv(ctx), layers_[l].k_norm, cos, sin, cache,
                     static_cast<int64_t>(l), batch.rows);
  }
}

at::Tensor DraftModel::hidden(KVCache& cache, const std::vector<int64_t>& slots,
                              const at::Tensor& last_tokens) const {
  if (slots.empty()) fail("draft model: no slots to draft for");
  // The block's K/V go to the rows just past each slot's context, so that a slot's keys
  // (context, then block) are one run of cache rows; the slot's length does not move, so
  // the next extend overwrites them.
  return hidden(
      cache,
      AppendBatch::make(cache, slots, std::vector<int64_t>(slots.size(), config_.block_size)),
      last_tokens);
}

at::Tensor DraftModel::hidden(KVCache& cache, const AppendBatch& batch,
                              const at::Tensor& last_tokens) const {
  c10::NoGradGuard no_grad;
  const int64_t n = batch.size(), bs = config_.block_size;
  if (batch.total != n * bs) {
    fail("draft model: the batch must append one block of {} tokens per slot, got {} tokens for {}",
         bs, batch.total, n);
  }
  if (last_tokens.dim() != 1 || last_tokens.size(0) != n) {
    fail("draft model: last_tokens must be [{}] (one per slot), got {}", n, last_tokens.sizes());
  }
  const ModelConfig& c = config_.layers;
  auto ids = at::full({n, bs}, config_.mask_token_id, batch.positions.options());
  ids.select(1, 0).copy_(last_tokens);
  Residual stream{at::embedding(embedding_, ids.view({n * bs})).to(dtype_), {}};
  auto [cos, sin] = rotary_.tables(batch.positions, dtype_);
  // Full layers attending per token take q group-major (models::group_major_queries).
  const at::Tensor group_offsets =
      group_major_query_offsets(batch, c.num_heads, c.num_kv_heads, dtype_);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto& w = layers_[l];
    auto [x, h] = add_and_norm(stream, w.input_norm, c.rms_norm_eps);
    // A sliding layer's block is causal with its window, a full layer's both ways.
    const int64_t window = config_.window(static_cast<int64_t>(l));
    const bool group_major = window == 0 && group_offsets.defined();
    auto q = block_queries(c, w.qkv(h), w.q_norm, w.k_norm, cos, sin, cache,
                           static_cast<int64_t>(l), batch.rows, group_major);
    auto attn = window > 0
                    ? cached_causal_attention(q, cache, static_cast<int64_t>(l), batch, window)
                    : cached_block_attention(q, cache, static_cast<int64_t>(l), batch,
                                             group_major ? group_offsets : at::Tensor());
    // o_proj and the residual, then the SwiGLU MLP (gate/up one GEMM), its output pending.
    auto o = w.o(attn.reshape({x.size(0), c.num_heads * c.head_dim}));
    auto [x1, h2] = add_and_norm({x, o}, w.post_attention_norm, c.rms_norm_eps);
    auto both = w.gate_up(h2);
    const int64_t ffn = both.size(1) / 2;
    stream = {x1, w.down(kernels::swiglu(both.narrow(1, 0, ffn), both.narrow(1, ffn, ffn)))};
  }
  return add_and_norm(stream, norm_, c.rms_norm_eps).second.view({n, bs, c.hidden_size});
}

at::Tensor DraftModel::logits(KVCache& cache, const std::vector<int64_t>& slots,
                              const at::Tensor& last_tokens) const {
  return predictions(hidden(cache, slots, last_tokens));
}

at::Tensor DraftModel::logits(KVCache& cache, const AppendBatch& batch,
                              const at::Tensor& last_tokens) const {
  return predictions(hidden(cache, batch, last_tokens));
}

at::Tensor DraftModel::predictions(const at::Tensor& hidden) const {
  c10::NoGradGuard no_grad;
  return lm_head_(hidden.narrow(1, 1, config_.block_size - 1));
}

at::Tensor DraftModel::draft(KVCache& cache, const std::vector<int64_t>& slots,
                             const at::Tensor& last_tokens) const {
  return logits(cache, slots, last_tokens).argmax(-1);
}

at::Tensor DraftModel::draft(KVCache& cache, const AppendBatch& batch,
                             const at::Tensor& last_tokens) const {
  return logits(cache, batch, last_tokens).argmax(-1);
}

double drafter_step_flops(const DrafterConfig& config, const std::vector<int64_t>& lengths,
                          const std::vector<int64_t>& anchors, int64_t logit_rows) {
  const ModelConfig& c = config.layers;
  const double h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const double f = c.intermediate_size, bs = config.block_size;
  double tokens = 0;
  for (int64_t n : lengths) tokens += static_cast<double>(n);
  const double blocks = static_cast<double>(anchors.size()), block_rows = blocks * bs;
  const double predicting = blocks * (bs - 1);
  double keys = 0;  // sum over a block's positions of the keys each attends to, over blocks
  for (int64_t a : anchors) keys += static_cast<double>(a) + bs;
  // The same for a sliding layer (row k: context keys j > a + k - W, own rows k' <= k), per
  // query position.
  double sliding_keys = 0;
  for (int64_t a : anchors) {
    for (int64_t k = 0; k < config.block_size; ++k) {
      const int64_t w = config.sliding_window;
      sliding_keys +=
          static_cast<double>(std::clamp<int64_t>(w - 1 - k, 0, a) + std::min<int64_t>(k + 1, w));
    }
  }
  // As the training step runs it: the first layer projects Q/K/V from its input's blocks + 1
  // distinct rows, and the last layer computes queries, attention, O and the MLP for the
  // predicting rows only (BlockRows::kPredictions).
  auto layer = [&](int64_t l) {
    const bool first = l == 0, last = l + 1 == c.num_layers;
    const double qkv_rows = first ? blocks + 1 : block_rows;
    const double q_rows = first ? blocks + 1 : (last ? predicting : block_rows);
    const double post_rows = last ? predicting : block_rows, query_positions = last ? bs - 1 : bs;
    const double attended = config.window(l) > 0 ? sliding_keys : query_positions * keys;
    return 2 * (q_rows * h * q + qkv_rows * h * 2 * kv + post_rows * (q * h + 3 * h * f)) +
           2 * tokens * h * 2 * kv  // the context's K/V
           + 4 * attended * q;      // QK^T and PV
  };
  const double fc = 2 * tokens * config.num_taps() * h * h;
  double forward = fc;
  for (int64_t l = 0; l < c.num_layers; ++l) forward += layer(l);
  const double head = 2 * static_cast<double>(logit_rows) * h * c.vocab_size;
  // Backward is twice the forward (input and weight grads); the frozen LM head needs only the
  // input grad, so it costs one more forward's worth.
  return 3 * forward + 2 * head;
}

}  // namespace dflash::models
