#include "models/target.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "common/error.h"
#include "common/json_file.h"
#include "dist/comm.h"
#include "io/safetensors.h"
#include "kernels/decode_ops.h"
#include "kernels/fp8_prefill.h"
#include "kernels/rotary.h"
#include "kernels/small_linear.h"
#include "kernels/tuned_gemm.h"
#include "kernels/wgmma_linear.h"
#include "models/gpt_oss.h"
#include "obs/stages.h"

namespace dflash::models {
namespace {

// Whether a pass over x takes the fused kernels of kernels/decode_ops.h (one launch and one
// read of the activations where ATen makes several), at any number of rows: prefill spends
// as much on ATen's elementwise passes as on attention. Training the target (autograd) and
// fp32 (the parity paths against transformers) keep ATen. Which rows also take small_linear or
// wgmma_linear for the projections is decided per call (kernels::inference_linear).
bool fused_kernels(const at::Tensor& x) {
  return x.is_cuda() && !c10::GradMode::is_enabled() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

using Shapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Layer i's MLP tensors, with their expected shapes: a sparse layer's experts per expert or,
// with `fused_experts`, as the two 3-D tensors of transformers 5's Qwen3MoeExperts; its shared
// expert where the config has one.
void mlp_tensors(const ModelConfig& c, int64_t i, bool fused_experts, Shapes& out) {
  const std::string p = c.layer_prefix(i) + "mlp.";
  const int64_t h = c.hidden_size;
  if (!c.is_moe_layer(i)) {
    out.push_back({p + "gate_proj.weight", {c.intermediate_size, h}});
    out.push_back({p + "up_proj.weight", {c.intermediate_size, h}});
    out.push_back({p + "down_proj.weight", {h, c.intermediate_size}});
    return;
  }
  const int64_t e = c.num_experts, f = c.moe_intermediate_size;
  out.push_back({p + "gate.weight", {e, h}});
  if (const int64_t sf = c.shared_expert_intermediate_size; sf > 0) {
    out.push_back({p + "shared_expert.gate_proj.weight", {sf, h}});
    out.push_back({p + "shared_expert.up_proj.weight", {sf, h}});
    out.push_back({p + "shared_expert.down_proj.weight", {h, sf}});
    out.push_back({p + "shared_expert_gate.weight", {1, h}});
  }
  if (fused_experts) {
    out.push_back({p + "experts.gate_up_proj", {e, 2 * f, h}});
    out.push_back({p + "experts.down_proj", {e, h, f}});
    return;
  }
  for (int64_t j = 0; j < e; ++j) {
    const std::string x = fmt::format("{}experts.{}.", p, j);
    out.push_back({x + "gate_proj.weight", {f, h}});
    out.push_back({x + "up_proj.weight", {f, h}});
    out.push_back({x + "down_proj.weight", {h, f}});
  }
}

// A linear-attention layer's tensors: Qwen3-Next's grouped in_proj_qkvz / in_proj_ba
// (`grouped`) or Qwen3.5's split projections.
void linear_attention_tensors(const ModelConfig& c, const std::string& p, bool grouped,
                              Shapes& out) {
  const auto& l = c.linear;
  const int64_t h = c.hidden_size, nv = l.num_value_heads;
  if (grouped) {
    out.push_back({p + "in_proj_qkvz.weight", {l.conv_dim() + l.value_dim(), h}});
    out.push_back({p + "in_proj_ba.weight", {2 * nv, h}});
  } else {
    out.push_back({p + "in_proj_qkv.weight", {l.conv_dim(), h}});
    out.push_back({p + "in_proj_z.weight", {l.value_dim(), h}});
    out.push_back({p + "in_proj_b.weight", {nv, h}});
    out.push_back({p + "in_proj_a.weight", {nv, h}});
  }
  out.push_back({p + "conv1d.weight", {l.conv_dim(), 1, l.conv_kernel_dim}});
  out.push_back({p + "A_log", {nv}});
  out.push_back({p + "dt_bias", {nv}});
  out.push_back({p + "norm.weight", {l.value_head_dim}});
  out.push_back({p + "out_proj.weight", {h, l.value_dim()}});
}

// How a checkpoint lays out what the config leaves open: sparse layer i's experts fused (else
// per expert), linear-attention layer i's input projections grouped (else split).
struct Layout {
  const io::Checkpoint* ckpt = nullptr;  // none (writing): per expert, split
  const ModelConfig& c;
  bool fused_experts(int64_t i) const {
    return ckpt != nullptr && ckpt->contains(c.layer_prefix(i) + "mlp.experts.gate_up_proj");
  }
  bool grouped_in_proj(int64_t i) const {
    return ckpt != nullptr && ckpt->contains(c.layer_prefix(i) + "linear_attn.in_proj_qkvz.weight");
  }
};

// `first_expert`: the first of the experts `w` holds (expert parallelism; else 0).
at::Tensor sparse_mlp(const ModelConfig& c, const TargetLayerWeights& w, const at::Tensor& x,
                      int64_t first_expert) {
  auto out = moe_mlp(x, w.router, w.experts_gate_up, w.experts_down, c.num_experts_per_tok,
                     c.norm_topk_prob, ExpertGemm::kAuto, first_expert);
  if (!w.shared_gate.defined()) return out;
  return out + shared_expert(x, w.shared_gate_up, w.shared_down, w.shared_gate);
}

// Every tensor a config implies, with its expected shape, in Hugging Face naming, laid out as
// `layout` says.
Shapes expected_tensors(const ModelConfig& c, const Layout& layout) {
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  Shapes out;
  out.push_back({c.weight_prefix() + "embed_tokens.weight", {c.vocab_size, h}});
  if (c.arch == Architecture::kGptOss) {
    auto layers = GptOssDecoder::expected_tensors(c, c.gpt_oss.mxfp4);
    out.insert(out.end(), layers.begin(), layers.end());
  }
  for (int64_t i = 0; i < c.num_layers && c.arch != Architecture::kGptOss; ++i) {
    const std::string p = c.layer_prefix(i);
    out.push_back({p + "input_layernorm.weight", {h}});
    out.push_back({p + "post_attention_layernorm.weight", {h}});
    if (c.is_linear_layer(i)) {
      linear_attention_tensors(c, p + "linear_attn.", layout.grouped_in_proj(i), out);
      mlp_tensors(c, i, c.is_moe_layer(i) && layout.fused_experts(i), out);
      continue;
    }
    out.push_back({p + "self_attn.q_proj.weight", {c.attn_output_gate ? 2 * q : q, h}});
    out.push_back({p + "self_attn.k_proj.weight", {kv, h}});
    out.push_back({p + "self_attn.v_proj.weight", {kv, h}});
    out.push_back({p + "self_attn.o_proj.weight", {h, q}});
    if (c.attention_bias) {
      out.push_back({p + "self_attn.q_proj.bias", {q}});
      out.push_back({p + "self_attn.k_proj.bias", {kv}});
      out.push_back({p + "self_attn.v_proj.bias", {kv}});
    }
    if (c.qk_norm) {
      out.push_back({p + "self_attn.q_norm.weight", {c.head_dim}});
      out.push_back({p + "self_attn.k_norm.weight", {c.head_dim}});
    }
    mlp_tensors(c, i, c.is_moe_layer(i) && layout.fused_experts(i), out);
  }
  out.push_back({c.weight_prefix() + "norm.weight", {h}});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", {c.vocab_size, h}});
  return out;
}

// The names of the tensors `c` implies, each checked in `ckpt`.
std::vector<std::string> checked_tensors(const io::Checkpoint& ckpt, const ModelConfig& c,
                                         const std::filesystem::path& dir) {
  std::vector<std::string> names;
  for (const auto& [name, shape] : expected_tensors(c, Layout{&ckpt, c})) {
    if (!ckpt.contains(name)) {
      fail("{}: tensor {} is missing (config.json implies it)", dir.string(), name);
    }
    const auto& info = ckpt.info(name);
    if (info.shape != shape) {
      fail("{}: tensor {} has shape [{}], config.json implies [{}]", dir.string(), name,
           fmt::join(info.shape, ", "), fmt::join(shape, ", "));
    }
    names.push_back(name);
  }
  return names;
}

// Layer i's MLP weights into `l` (dense, or router, experts in either layout and the shared
// expert), taken by name through `take`; of the per-expert layout only `experts`' tensors are
// taken (expert parallelism; `take` slices the fused layout itself).
template <class Take>
void load_mlp(const ModelConfig& c, int64_t i, const Layout& layout, const ExpertRange& experts,
              Take&& take, TargetLayerWeights& l) {
  const std::string p = c.layer_prefix(i) + "mlp.";
  if (!c.is_moe_layer(i)) {
    // Where the loader kept FP8 blocks instead.
    if (!l.gate_up_blocks.defined()) {
      l.w_gate_up = at::cat({take(p + "gate_proj.weight"), take(p + "up_proj.weight")});
    }
    if (!l.down_blocks.defined()) l.w_down = take(p + "down_proj.weight");
    return;
  }
  l.router = take(p + "gate.weight");
  if (c.shared_expert_intermediate_size > 0) {
    l.shared_gate_up = at::cat(
        {take(p + "shared_expert.gate_proj.weight"), take(p + "shared_expert.up_proj.weight")});
    l.shared_down = take(p + "shared_expert.down_proj.weight");
    l.shared_gate = take(p + "shared_expert_gate.weight");
  }
  if (layout.fused_experts(i)) {
    l.experts_gate_up = take(p + "experts.gate_up_proj");
    l.experts_down = take(p + "experts.down_proj");
    return;
  }
  std::vector<at::Tensor> gate_up, down;
  for (int64_t e = experts.first; e < experts.first + experts.count; ++e) {
    const std::string x = fmt::format("{}experts.{}.", p, e);
    gate_up.push_back(at::cat({take(x + "gate_proj.weight"), take(x + "up_proj.weight")}));
    down.push_back(take(x + "down_proj.weight"));
  }
  l.experts_gate_up = at::stack(gate_up);
  l.experts_down = at::stack(down);
}

// A Gated DeltaNet layer's shape on one of `ranks` ranks: its share of the key heads and their
// value heads (check_tensor_parallel: the ranks divide linear_num_key_heads).
LinearAttentionShape linear_share(LinearAttentionShape s, int64_t ranks) {
  s.num_key_heads /= ranks;
  s.num_value_heads /= ranks;
  return s;
}

// Keeps this rank's heads of a whole Gated DeltaNet layer (w_in in the split layout): of w_in
// the q and k rows of its key heads, the v, z, b and a rows of their value heads (each key
// head's value heads on its rank, as the delta rule's repeat_interleave pairs them), the conv
// channels of its q, k and v, A_log and dt_bias of its value heads, out_proj's input columns of
// its values (row-parallel: tp_reduce sums it); the gated RMSNorm is per head, whole.
void keep_linear_share(LinearAttentionWeights& w, const LinearAttentionShape& s,
                       const Split& split) {
  const int64_t kd = s.key_dim(), vd = s.value_dim(), nv = s.num_value_heads;
  auto own = [](const at::Tensor& t) { return t.clone(at::MemoryFormat::Contiguous); };
  w.w_in = own(split(w.w_in, 0, {kd, kd, vd, vd, nv, nv}));
  w.conv = own(split(w.conv, 0, {kd, kd, vd}));
  w.a_log = own(split(w.a_log, 0, {nv}));
  w.dt_bias = own(split(w.dt_bias, 0, {nv}));
  if (w.w_out.defined()) w.w_out = own(split(w.w_out, 1, {vd}));  // else held in FP8 blocks
}

// How a checkpoint tensor splits over a tensor-parallel group (a hybrid's attention and MLP
// layers as a transformer's, the shared expert's projections as a dense MLP's): along `dim`
// (column-parallel weights and biases, the vocabulary: 0; row-parallel weights: their input
// columns), in `halves` equal parts each split on its own (a fused gate_up); dim -1: whole on
// every rank (norms, the router, the shared expert's gate), split by heads (k and v, kv_share)
// or read whole and split after (Gated DeltaNet, keep_linear_share).
struct TensorSplit {
  int64_t dim = -1;
  int64_t halves = 1;
};
TensorSplit tensor_split(const std::string& name) {
  auto ends = [&](std::string_view suffix) { return name.ends_with(suffix); };
  if (ends("embed_tokens.weight") || name == "lm_head.weight") return {0};
  for (const char* column :
       {"q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight"}) {
    if (ends(column)) return {0};
  }
  if (ends("o_proj.weight") || ends("down_proj.weight")) return {1};
  if (ends("experts.gate_up_proj")) return {1, 2};
  if (ends("experts.down_proj")) return {2};
  return {};
}

// The [rows, columns] of the scale blocks of an FP8 block-quantised checkpoint as published
// (Qwen3-*-FP8, DeepSeek-V3: config.json's quantization_config names quant_method "fp8", fmt
// "e4m3" and weight_block_size), empty for an unquantised one. gpt-oss' MXFP4 experts are its
// own (GptOssFields); any other quantisation is refused rather than read as plain weights.
std::vector<int64_t> fp8_weight_block(const std::filesystem::path& dir, const ModelConfig& c) {
  if (c.arch == Architecture::kGptOss) return {};
  const auto config = read_json_file(dir / "config.json");
  const auto q = config.find("quantization_config");
  if (q == config.end() || q->is_null()) return {};
  const std::string where = (dir / "config.json").string() + ": quantization_config";
  if (!q->is_object() || q->value("quant_method", "") != "fp8" ||
      q->value("fmt", "e4m3") != "e4m3") {
    fail("{}: {} is not supported (FP8 block quantisation: quant_method \"fp8\", fmt \"e4m3\")",
         where, q->dump());
  }
  const auto block = q->value("weight_block_size", std::vector<int64_t>{});
  if (block.size() != 2 || block[0] <= 0 || block[1] <= 0) {
    fail(
        "{}: weight_block_size must be the [rows, columns] of a scale block, e.g. [128, 128]; got "
        "{}",
        where, q->value("weight_block_size", nlohmann::json()).dump());
  }
  return block;
}

// An FP8 block-quantised weight in fp32: w (e4m3, [out, in]) times its block's entry of
// scale_inv ([ceil(out / block[0]), ceil(in / block[1])], fp32), as the published checkpoints
// define it (transformers' FP8 dequantisation, DeepSeek's weight_dequant).
at::Tensor dequantize_fp8_blocks(const at::Tensor& w, const at::Tensor& scale_inv,
                                 const std::vector<int64_t>& block, const std::string& name) {
  if (w.dim() != 2) fail("{}: an FP8 block-quantised weight must be 2-d, got {}", name, w.sizes());
  const int64_t out = w.size(0), in = w.size(1);
  const std::vector<int64_t> scales = {(out + block[0] - 1) / block[0],
                                       (in + block[1] - 1) / block[1]};
  if (scale_inv.sizes().vec() != scales) {
    fail(
        "{}: an FP8 weight of shape {} in blocks of [{}, {}] needs {}_scale_inv of shape [{}], got "
        "{}",
        name, w.sizes(), block[0], block[1], name, fmt::join(scales, ", "), scale_inv.sizes());
  }
  const auto s = scale_inv.to(at::kFloat)
                     .repeat_interleave(block[0], 0)
                     .repeat_interleave(block[1], 1)
                     .narrow(0, 0, out)
                     .narrow(1, 0, in);
  return w.to(at::kFloat) * s;
}

// Of the block weight `w` read whole, the part `keep` keeps (keep(t, dim): this rank's slice of
// t along dim, as the loader slices the dequantised tensor), or undefined with `why` set where
// that part is not whole 128 x 128 blocks. Along `dim` the scales follow the indices kept.
template <class Keep>
kernels::Fp8Blocks share_blocks(const kernels::Fp8Blocks& w, int64_t dim, Keep&& keep,
                                const std::string& name, std::string& why) {
  constexpr int64_t b = kernels::kFp8Block;
  if (dim < 0) return w;
  const at::Tensor index = keep(at::arange(w.data.size(dim)), 0);
  const at::Tensor chunks = index.numel() % b == 0 ? index.view({-1, b}) : at::Tensor();
  if (!chunks.defined() || index.numel() == 0 ||
      !chunks.select(1, 0).remainder(b).eq(0).all().item<bool>() ||
      !chunks.sub(chunks.select(1, 0).unsqueeze(1)).eq(at::arange(b)).all().item<bool>()) {
    why = fmt::format("{}: this rank's slice of dimension {} is not whole blocks of {}", name, dim,
                      b);
    return {};
  }
  // e4m3 through uint8 views: the CPU's cat and index kernels do not take float8.
  const at::Tensor data = keep(w.data.view(at::kByte), dim).contiguous().view(at::kFloat8_e4m3fn);
  return {data, w.scale_inv.index_select(dim, chunks.select(1, 0).div(b, "floor")).contiguous()};
}

// The parts (q, k, v; gate, up) of a fused projection one above another, data and scales.
kernels::Fp8Blocks stack_blocks(const std::vector<kernels::Fp8Blocks>& parts) {
  if (parts.size() == 1) return parts[0];
  std::vector<at::Tensor> data, scales;
  for (const auto& p : parts) {
    data.push_back(p.data.view(at::kByte));
    scales.push_back(p.scale_inv);
  }
  return {at::cat(data).view(at::kFloat8_e4m3fn), at::cat(scales)};
}

// The rows [offset, offset + rows) of a block weight stacked by stack_blocks (whole blocks).
kernels::Fp8Blocks block_rows(const kernels::Fp8Blocks& w, int64_t offset, int64_t rows) {
  constexpr int64_t b = kernels::kFp8Block;
  return {w.data.narrow(0, offset, rows), w.scale_inv.narrow(0, offset / b, (rows + b - 1) / b)};
}

// TargetModel::load's keep_fp8_blocks: a fused projection of block-quantised checkpoint tensors
// kept in FP8 blocks as stored (this rank's slice, copied to the device), or undefined where
// it is not kept (the loader then dequantises its parts), counted with the first reason where
// some part is block-quantised.
struct BlockReader {
  const io::Checkpoint& ckpt;
  const std::set<std::string>& fp8;  // the tensors with a weight_scale_inv
  const std::vector<int64_t>& block;
  const ModelConfig& c;
  Split split;
  bool tp;
  at::Device device;
  std::string dir;
  bool keep;
  std::string first_dequantised = {};
  int64_t dequantised = 0;

  // This rank's blocks of one tensor, or undefined with `why` set.
  kernels::Fp8Blocks part(const std::string& name, std::string& why) const {
    kernels::Fp8Blocks whole{ckpt.tensor(name), ckpt.tensor(name + "_scale_inv").to(at::kFloat)};
    kernels::check_blocks(whole, dir + ": " + name);
    const bool kv = name.find("self_attn.k_proj.") != std::string::npos ||
                    name.find("self_attn.v_proj.") != std::string::npos;
    int64_t dim = -1;
    if (tp) {
      dim = kv ? 0 : name.ends_with("linear_attn.out_proj.weight") ? 1 : tensor_split(name).dim;
    }
    auto keep_share = [&](const at::Tensor& t, int64_t d) {
      return kv ? kv_share(t, c, split) : split(t, d, {t.size(d)});
    };
    auto out = share_blocks(whole, dim, keep_share, name, why);
    if (out.defined()) why = kernels::fp8_block_gemm_unsupported(out, name);
    return why.empty() ? out : kernels::Fp8Blocks{};
  }

  kernels::Fp8Blocks take(const std::vector<std::string>& names) {
    const auto quantised = std::count_if(names.begin(), names.end(),
                                         [&](const std::string& n) { return fp8.contains(n); });
    if (!keep || quantised == 0) return {};
    std::string why;
    std::vector<kernels::Fp8Blocks> parts;
    for (const auto& name : names) {
      if (!fp8.contains(name)) {
        why = fmt::format("{} is not block-quantised beside its fused parts", name);
      } else if (block != std::vector<int64_t>{kernels::kFp8Block, kernels::kFp8Block}) {
        why = fmt::format("weight_block_size [{}] is not [128, 128]", fmt::join(block, ", "));
      } else {
        parts.push_back(part(name, why));
      }
      if (!why.empty()) {
        if (dequantised++ == 0) first_dequantised = why;
        return {};
      }
    }
    auto w = stack_blocks(parts);
    auto to_device = [&](const at::Tensor& t) {
      return t.to(at::TensorOptions().device(device), /*non_blocking=*/false, /*copy=*/true,
                  at::MemoryFormat::Contiguous);
    };
    return {to_device(w.data), to_device(w.scale_inv)};
  }

  void report() const {
    if (dequantised == 0) return;
    fmt::print(stderr,
               "target: {}: {} FP8 block-quantised projection(s) dequantised at load, not kept "
               "in blocks (the first: {})\n",
               dir, dequantised, first_dequantised);
  }
};

// a x weight^T through the row-scaled FP8 GEMM, written in `options`' dtype.
at::Tensor mm8(const kernels::Fp8Rows& a, const kernels::Fp8Rows& weight,
               const at::TensorOptions& options) {
  auto out = at::empty({a.data.size(0), weight.data.size(0)}, options);
  kernels::mm_fp8_rows_out(out, a, weight);
  return out;
}

// Fails where a forward cannot run layer `w`: a compute-dtype one (not `fp8`) whose projections
// are held in e4m3 alone, an fp8 one before quantize_weights_fp8.
void check_projections_held(const TargetLayerWeights& w, bool fp8) {
  const bool dense_mlp = !w.router.defined();
  const bool compute_held =
      (w.linear.conv.defined() ? w.linear.w_in.defined() && w.linear.w_out.defined()
                               : w.w_qkv.defined() && w.w_o.defined()) &&
      (!dense_mlp || (w.w_gate_up.defined() && w.w_down.defined()));
  if (!fp8 && !compute_held) {
    fail(
        "target forward: this target holds projections in e4m3 alone (FP8 blocks kept at load, "
        "or release_compute_projections); only --prefill-gemms fp8 can run it");
  }
  auto held8 = [](const kernels::Fp8Rows& rows, const kernels::Fp8Blocks& blocks) {
    return rows.data.defined() || blocks.defined();
  };
  if (fp8 && !(held8(w.qkv_fp8, w.qkv_blocks) && held8(w.o_fp8, w.o_blocks) &&
               (!dense_mlp ||
                (held8(w.gate_up_fp8, w.gate_up_blocks) && held8(w.down_fp8, w.down_blocks))))) {
    fail(
        "target forward: --prefill-gemms fp8 needs the layers' e4m3 weights "
        "(TargetModel::quantize_weights_fp8)");
  }
}

// A dense MLP's FP8 GEMMs in a fused pass after the residual add of the token mixer's output o:
// the residual sum and the MLP's output. The norm and the activation write the e4m3 rows a
// row-scaled weight reads, in one pass each; block weights take bf16 rows, which
// linear_fp8_blocks quantizes in groups.
std::pair<at::Tensor, at::Tensor> fused_fp8_mlp(const TargetLayerWeights& w, const at::Tensor& x,
                                                const at::Tensor& o, double eps) {
  at::Tensor sum, gate_up;
  if (w.gate_up_blocks.defined()) {
    auto r = kernels::add_rms_norm(x, o, w.post_attention_norm, eps);
    sum = r.sum;
    gate_up = kernels::linear_fp8_blocks(r.normed, w.gate_up_blocks);
  } else {
    auto r = kernels::add_rms_norm_e4m3(x, o, w.post_attention_norm, eps);
    sum = r.sum;
    gate_up = mm8(r.normed, w.gate_up_fp8, x.options());
  }
  auto out = w.down_blocks.defined()
                 ? kernels::linear_fp8_blocks(kernels::silu_mul(gate_up), w.down_blocks)
                 : mm8(kernels::silu_mul_e4m3(gate_up), w.down_fp8, x.options());
  return {sum, out};
}

}  // namespace

ExpertRange expert_range(int64_t num_experts, int64_t rank, int64_t ranks) {
  const int64_t first = rank * num_experts / ranks;
  return {first, (rank + 1) * num_experts / ranks - first};
}

std::pair<int64_t, int64_t> kv_heads_of(const ModelConfig& c, int64_t rank, int64_t ranks) {
  return {rank * c.num_kv_heads / ranks, std::max<int64_t>(c.num_kv_heads / ranks, 1)};
}

at::Tensor kv_share(const at::Tensor& t, const ModelConfig& c, const Split& split) {
  const auto [first, count] = kv_heads_of(c, split.rank, split.ranks);
  return t.narrow(0, first * c.head_dim, count * c.head_dim);
}

at::Tensor qkv_share(const at::Tensor& t, const ModelConfig& c, const Split& split,
                     int64_t q_rows) {
  const int64_t kv = c.num_kv_heads * c.head_dim;
  return at::cat({split(t.narrow(0, 0, q_rows), 0, {q_rows}),
                  kv_share(t.narrow(0, q_rows, kv), c, split),
                  kv_share(t.narrow(0, q_rows + kv, kv), c, split)});
}

void check_tensor_parallel(const ModelConfig& c, int64_t ranks, bool expert_parallel) {
  if (ranks < 1) fail("--target-tp must be at least 1, got {}", ranks);
  if (expert_parallel && ranks == 1) {
    fail(
        "--target-ep splits the experts over a --target-tp group; with --target-tp 1 there is "
        "none");
  }
  if (ranks == 1) return;
  const bool gpt_oss = c.arch == Architecture::kGptOss;
  if (gpt_oss && expert_parallel) {
    fail(
        "--target-tp {} --target-ep: gpt_oss targets are not split by experts (their experts "
        "split along intermediate_size); drop --target-ep",
        ranks);
  }
  auto divides = [&](int64_t value, const char* field) {
    if (value % ranks != 0) {
      fail(
          "--target-tp {}: config.json's {} = {} is not a multiple of {} (each rank holds {} / {})",
          ranks, field, value, ranks, field, ranks);
    }
  };
  divides(c.num_heads, "num_attention_heads");
  if (c.num_kv_heads % ranks != 0 && ranks % c.num_kv_heads != 0) {
    fail(
        "--target-tp {}: config.json's num_key_value_heads = {} neither is a multiple of {} (each "
        "rank holds num_key_value_heads / {}) nor divides it (each KV head replicated on {} / "
        "num_key_value_heads ranks)",
        ranks, c.num_kv_heads, ranks, ranks, ranks);
  }
  bool dense = false, sparse = false, linear = false;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    (c.is_moe_layer(i) ? sparse : dense) = true;
    linear = linear || c.is_linear_layer(i);
  }
  // A key head's value heads stay on its rank, so the key heads split evenly.
  if (linear) divides(c.linear.num_key_heads, "linear_num_key_heads");
  if (dense) divides(c.intermediate_size, "intermediate_size");
  if (sparse && c.shared_expert_intermediate_size > 0) {
    divides(c.shared_expert_intermediate_size, "shared_expert_intermediate_size");
  }
  if (expert_parallel && !sparse) {
    fail("--target-ep: {} has no sparse (MoE) layers to split by experts",
         architecture_name(c.arch));
  }
  if (expert_parallel && c.num_experts < ranks) {
    fail("--target-tp {} --target-ep: config.json's num_experts = {} leaves some rank no expert",
         ranks, c.num_experts);
  }
  if (sparse && !expert_parallel) {
    // gpt-oss' experts are of config.json's intermediate_size.
    divides(c.moe_intermediate_size, gpt_oss ? "intermediate_size" : "moe_intermediate_size");
  }
  if (gpt_oss && c.gpt_oss.mxfp4 && (c.intermediate_size / 32) % ranks != 0) {
    fail(
        "--target-tp {}: config.json's intermediate_size / 32 = {} / 32 = {} (MXFP4 groups) is "
        "not a multiple of {} (each rank holds whole 32-value groups of down_proj's inputs)",
        ranks, c.intermediate_size, c.intermediate_size / 32, ranks);
  }
  if (Split{ranks - 1, ranks}.piece(c.vocab_size).second <= 0) {
    fail("--target-tp {}: config.json's vocab_size = {} leaves the last rank no vocabulary rows",
         ranks, c.vocab_size);
  }
}

int64_t TargetModel::tp_size() const { return tp_ != nullptr ? tp_->size() : 1; }

void TargetModel::split_over(dist::Comm* tp, bool expert_parallel) {
  const int64_t ranks = tp != nullptr ? tp->size() : 1;
  check_tensor_parallel(config_, ranks, expert_parallel);
  if (ranks == 1) return;
  tp_ = tp;
  expert_parallel_ = expert_parallel;
  if (expert_parallel) first_expert_ = experts().first;
}

ExpertRange TargetModel::experts() const {
  if (!expert_parallel_) return {0, config_.num_experts};
  return expert_range(config_.num_experts, tp_->rank(), tp_->size());
}

void TargetModel::tp_reduce(at::Tensor& partial, std::string_view stage) const {
  if (tp_ == nullptr) return;
  // Its own stage in `dflash report`, GPU-timed too (inside the target forward's span).
  obs::Scope scope(obs::Stage::kTargetAllReduce, partial.device());
  if (!partial.is_contiguous()) partial = partial.contiguous();
  tp_->all_reduce_sum(partial, stage);
}

TargetModel::TargetModel(ModelConfig config, at::Device device)
    : config_(std::move(config)), rotary_(config_, device) {}

void TargetModel::check(const std::filesystem::path& dir) {
  checked_tensors(io::Checkpoint::open(dir), load_model_config(dir / "config.json"), dir);
}

TargetModel TargetModel::load(const std::filesystem::path& dir, at::Device device,
                              at::ScalarType dtype, dist::Comm* tp, bool expert_parallel,
                              bool keep_fp8_blocks) {
  TargetModel m(load_model_config(dir / "config.json"), device);
  const ModelConfig& c = m.config_;
  m.split_over(tp, expert_parallel);
  auto ckpt = io::Checkpoint::open(dir);
  auto to_load = checked_tensors(ckpt, c, dir);
  // FP8 block-quantised weights (those with a weight_scale_inv beside them) are dequantised
  // one at a time where they are read, not in the bulk load.
  const auto block = fp8_weight_block(dir, c);
  std::set<std::string> fp8;
  for (const auto& name : to_load) {
    const bool scaled = ckpt.contains(name + "_scale_inv");
    if (scaled && block.empty()) {
      fail("{}: tensor {}_scale_inv is there but config.json names no FP8 quantization_config",
           dir.string(), name);
    }
    if (!scaled && ckpt.info(name).dtype == at::kFloat8_e4m3fn) {
      fail("{}: tensor {} is e4m3 without a {}_scale_inv", dir.string(), name, name);
    }
    if (scaled) fp8.insert(name);
  }
  std::erase_if(to_load, [&](const std::string& name) { return fp8.contains(name); });
  // A tensor-parallel rank copies its slices out of the mapped files, one at a time.
  const Split split{m.tp_ != nullptr ? tp->rank() : 0, m.tp_size()};
  const bool gpt_oss = c.arch == Architecture::kGptOss;
  if (gpt_oss) {  // the decoder layers load themselves (MXFP4 blocks stay uint8)
    m.gpt_oss_ = GptOssDecoder::load(ckpt, c, device, dtype, split);
    to_load = {"model.embed_tokens.weight", "model.norm.weight"};
    if (!c.tie_word_embeddings) to_load.push_back("lm_head.weight");
  }
  const ExpertRange experts = m.experts();
  std::map<std::string, at::Tensor> w;
  if (m.tp_ == nullptr) w = ckpt.load(to_load, device, dtype);
  const Layout layout{&ckpt, c};
  auto take = [&](const std::string& name) {
    at::Tensor t;
    if (fp8.contains(name)) {
      const std::string scale = name + "_scale_inv";
      auto both =
          ckpt.load({name, scale}, m.tp_ != nullptr ? at::Device(at::kCPU) : device, at::kFloat);
      t = dequantize_fp8_blocks(both.at(name), both.at(scale), block, dir.string() + ": " + name);
    } else if (m.tp_ != nullptr) {
      t = ckpt.tensor(name);
    }
    if (t.defined()) {
      if (m.expert_parallel_ && name.find(".experts.") != std::string::npos) {
        // Whole experts: of the fused layout this rank's range, the per-expert tensors as read.
        if (name.ends_with("_proj")) t = t.narrow(0, experts.first, experts.count);
      } else if (m.tp_ != nullptr && (name.find("self_attn.k_proj.") != std::string::npos ||
                                      name.find("self_attn.v_proj.") != std::string::npos)) {
        t = kv_share(t, c, split);
      } else if (const auto s = tensor_split(name); m.tp_ != nullptr && s.dim >= 0) {
        const int64_t part = t.size(s.dim) / s.halves;
        t = split(t, s.dim, std::vector<int64_t>(s.halves, part));
      }
      return t.to(device, dtype, /*non_blocking=*/false, /*copy=*/true,
                  at::MemoryFormat::Contiguous);
    }
    auto node = w.extract(name);
    return node.mapped();
  };
  auto take_norm = [&](const std::string& name) {
    return c.norm_plus_one ? norm_weight_from_file(take(name)) : take(name);
  };
  BlockReader blocks{ckpt,   fp8,          block,          c, split, m.tp_ != nullptr,
                     device, dir.string(), keep_fp8_blocks};
  auto take_blocks = [&](const std::vector<std::string>& names) { return blocks.take(names); };
  // Multi-token-prediction heads (Qwen3.5, Qwen3-Next) are not part of the target's forward.
  const auto names = ckpt.names();
  if (auto mtp = std::count_if(names.begin(), names.end(),
                               [](const std::string& n) { return n.starts_with("mtp."); });
      mtp > 0) {
    fmt::print(stderr, "target: {}: {} mtp.* tensors (multi-token prediction) are not loaded\n",
               dir.string(), mtp);
  }
  m.embed_ = take(c.weight_prefix() + "embed_tokens.weight");
  for (int64_t i = 0; i < c.num_layers && !gpt_oss; ++i) {
    const std::string p = c.layer_prefix(i);
    TargetLayerWeights l;
    l.input_norm = take_norm(p + "input_layernorm.weight");
    l.post_attention_norm = take_norm(p + "post_attention_layernorm.weight");
    if (!c.is_moe_layer(i)) {
      l.gate_up_blocks = take_blocks({p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"});
      l.down_blocks = take_blocks({p + "mlp.down_proj.weight"});
    }
    load_mlp(c, i, layout, experts, take, l);
    if (c.is_linear_layer(i)) {
      const std::string a = p + "linear_attn.";
      l.linear.w_in = layout.grouped_in_proj(i)
                          ? qwen3_next_in_proj(take(a + "in_proj_qkvz.weight"),
                                               take(a + "in_proj_ba.weight"), c.linear)
                          : at::cat({take(a + "in_proj_qkv.weight"), take(a + "in_proj_z.weight"),
                                     take(a + "in_proj_b.weight"), take(a + "in_proj_a.weight")});
      l.linear.conv = take(a + "conv1d.weight").squeeze(1);
      l.linear.a_log = take(a + "A_log");
      l.linear.dt_bias = take(a + "dt_bias");
      l.linear.norm = take(a + "norm.weight");
      l.o_blocks = take_blocks({a + "out_proj.weight"});
      if (!l.o_blocks.defined()) l.linear.w_out = take(a + "out_proj.weight");
      // Read whole (one layer at a time), as qwen3_next_in_proj regroups whole tensors.
      if (m.tp_ != nullptr) keep_linear_share(l.linear, c.linear, split);
      m.layers_.push_back(std::move(l));
      continue;
    }
    const std::string q = p + "self_attn.q_proj.weight", k = p + "self_attn.k_proj.weight",
                      v = p + "self_attn.v_proj.weight";
    l.qkv_blocks = take_blocks({q, k, v});
    if (!l.qkv_blocks.defined()) l.w_qkv = at::cat({take(q), take(k), take(v)});
    if (c.attention_bias) {
      l.b_qkv = at::cat({take(p + "self_attn.q_proj.bias"), take(p + "self_attn.k_proj.bias"),
                         take(p + "self_attn.v_proj.bias")});
    }
    if (c.qk_norm) {
      l.q_norm = take_norm(p + "self_attn.q_norm.weight");
      l.k_norm = take_norm(p + "self_attn.k_norm.weight");
    }
    l.o_blocks = take_blocks({p + "self_attn.o_proj.weight"});
    if (!l.o_blocks.defined()) l.w_o = take(p + "self_attn.o_proj.weight");
    m.layers_.push_back(std::move(l));
  }
  blocks.report();
  m.norm_ = take_norm(c.weight_prefix() + "norm.weight");
  m.lm_head_ = c.tie_word_embeddings ? m.embed_ : take("lm_head.weight");
  m.vocab_start_ = split.piece(c.vocab_size).first;
  return m;
}

at::ScalarType parse_dtype(const std::string& name, at::Device device) {
  if (name == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp32" || name == "float32") return at::kFloat;
  fail("dtype must be auto, bf16 or fp32, got \"{}\"", name);
}

at::Generator seeded_generator(at::Device device, uint64_t seed) {
  if (device.is_cpu()) return at::make_generator<at::CPUGeneratorImpl>(seed);
  if (!device.is_cuda()) fail("random weights: no generator for device {}", device.str());
  // Drawn where the weights live: 8B numbers take minutes on a CPU.
  at::Generator gen = at::cuda::detail::createCUDAGenerator(device.index());
  gen.set_current_seed(seed);
  return gen;
}

TargetModel TargetModel::random(const ModelConfig& c, at::Device device, at::ScalarType dtype,
                                uint64_t seed, dist::Comm* tp, bool expert_parallel,
                                bool fp8_blocks) {
  c.validate("random target");
  TargetModel m(c, device);
  m.split_over(tp, expert_parallel);
  auto gen = seeded_generator(device, seed);
  auto opts = at::TensorOptions().device(device).dtype(dtype);
  auto normal = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, opts) * 0.02; };
  // A tensor-parallel rank draws every weight whole (the same numbers as one rank) and keeps
  // its slice of the split ones: `parts` along `dim` as Split reads them.
  const Split split{m.tp_ != nullptr ? tp->rank() : 0, m.tp_size()};
  auto sliced = [&](std::vector<int64_t> shape, int64_t dim, std::vector<int64_t> parts) {
    auto t = normal(std::move(shape));
    return m.tp_ != nullptr ? split(t, dim, parts).clone(at::MemoryFormat::Contiguous) : t;
  };
  // A fused [q; k; v] (weight or bias, q_rows of q): qkv_share.
  auto qkv_sliced = [&](std::vector<int64_t> shape, int64_t q_rows) {
    auto t = normal(std::move(shape));
    return m.tp_ != nullptr ? qkv_share(t, c, split, q_rows) : t;
  };
  auto ones = [&](int64_t n) { return at::ones({n}, opts); };
  // fp8_blocks: a projection drawn (parts of `parts` rows one above another) held in blocks
  // instead, where every part is whole blocks (the projections load would keep).
  auto to_blocks = [&](at::Tensor& w, kernels::Fp8Blocks& blocks,
                       const std::vector<int64_t>& parts) {
    constexpr int64_t b = kernels::kFp8Block;
    if (!fp8_blocks || w.size(1) % b != 0 ||
        std::any_of(parts.begin(), parts.end(), [](int64_t p) { return p % b != 0; })) {
      return;
    }
    blocks = kernels::quantize_blocks_e4m3(w);
    w.reset();
  };
  const int64_t h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  m.embed_ = sliced({c.vocab_size, h}, 0, {c.vocab_size});
  m.vocab_start_ = split.piece(c.vocab_size).first;
  if (c.arch == Architecture::kGptOss) m.gpt_oss_ = GptOssDecoder::random(c, gen, opts, split);
  for (int64_t i = 0; i < c.num_layers && !m.gpt_oss_; ++i) {
    TargetLayerWeights l;
    l.input_norm = ones(h);
    l.post_attention_norm = ones(h);
    // The token mixer's weights, then the MLP's: the order the generator fills them in is what
    // a seed means (random-model's checkpoints stay the same across versions).
    if (c.is_linear_layer(i)) {
      const auto& s = c.linear;
      const int64_t nv = s.num_value_heads;
      l.linear.w_in = normal({s.conv_dim() + s.value_dim() + 2 * nv, h});
      l.linear.conv = normal({s.conv_dim(), s.conv_kernel_dim}) * 10;  // std 0.2
      // transformers' init: A uniform in [1, 16) (decays exp(-A softplus(.))), dt_bias 1.
      l.linear.a_log = (at::rand({nv}, gen, opts) * 15 + 1).log();
      l.linear.dt_bias = ones(nv);
      l.linear.norm = ones(s.value_head_dim);
      l.linear.w_out = normal({h, s.value_dim()});
      if (m.tp_ != nullptr) keep_linear_share(l.linear, s, split);
      to_blocks(l.linear.w_out, l.o_blocks, {h});
    } else {
      const int64_t q_rows = c.attn_output_gate ? 2 * q : q;
      l.w_qkv = qkv_sliced({q_rows + 2 * kv, h}, q_rows);
      if (c.attention_bias) l.b_qkv = qkv_sliced({q + 2 * kv}, q);
      if (c.qk_norm) {
        l.q_norm = ones(c.head_dim);
        l.k_norm = ones(c.head_dim);
      }
      l.w_o = sliced({h, q}, 1, {q});
      const int64_t kv_rows = kv_heads_of(c, split.rank, split.ranks).second * c.head_dim;
      to_blocks(l.w_qkv, l.qkv_blocks, {l.w_qkv.size(0) - 2 * kv_rows, kv_rows, kv_rows});
      to_blocks(l.w_o, l.o_blocks, {h});
    }
    if (c.is_moe_layer(i)) {
      const int64_t e = c.num_experts, f = c.moe_intermediate_size;
      l.router = normal({e, h});
      if (m.expert_parallel_) {
        const ExpertRange mine = m.experts();
        auto held = [&](std::vector<int64_t> shape) {
          return normal(std::move(shape)).narrow(0, mine.first, mine.count).clone();
        };
        l.experts_gate_up = held({e, 2 * f, h});
        l.experts_down = held({e, h, f});
      } else {
        l.experts_gate_up = sliced({e, 2 * f, h}, 1, {f, f});
        l.experts_down = sliced({e, h, f}, 2, {f});
      }
      if (const int64_t sf = c.shared_expert_intermediate_size; sf > 0) {
        // Split like a dense MLP; its gate [1, H] is whole: sigmoid(x gate^T) scales each
        // rank's partial sum, so their sum is the whole expert's output.
        l.shared_gate_up = sliced({2 * sf, h}, 0, {sf, sf});
        l.shared_down = sliced({h, sf}, 1, {sf});
        l.shared_gate = normal({1, h});
      }
    } else {
      const int64_t f = c.intermediate_size;
      l.w_gate_up = sliced({2 * f, h}, 0, {f, f});
      l.w_down = sliced({h, f}, 1, {f});
      to_blocks(l.w_gate_up, l.gate_up_blocks, {l.w_gate_up.size(0) / 2, l.w_gate_up.size(0) / 2});
      to_blocks(l.w_down, l.down_blocks, {h});
    }
    m.layers_.push_back(std::move(l));
  }
  m.norm_ = ones(h);
  m.lm_head_ = c.tie_word_embeddings ? m.embed_ : sliced({c.vocab_size, h}, 0, {c.vocab_size});
  return m;
}

bool fp8_block_projection(const std::string& name) {
  if (name.find(".experts.") != std::string::npos ||
      name.find("shared_expert") != std::string::npos) {
    return false;
  }
  for (const char* role :
       {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "linear_attn.out_proj.weight"}) {
    if (name.ends_with(role)) return true;
  }
  return false;
}

PrefillGemms parse_prefill_gemms(const std::string& name) {
  if (auto value = enum_value(kPrefillGemmsNames, name)) return *value;
  fail("prefill_gemms must be {}, got '{}'", enum_choices(kPrefillGemmsNames), name);
}

Mxfp4Gemm parse_mxfp4_gemm(const std::string& name) {
  if (auto value = enum_value(kMxfp4GemmNames, name)) return *value;
  fail("mxfp4 GEMM must be {}, got '{}'", enum_choices(kMxfp4GemmNames), name);
}

int64_t TargetModel::quantize_weights_fp8(int64_t layers) {
  if (layers < 0 || layers > config_.num_layers) {
    fail("quantize_weights_fp8: {} layers asked of a target with {}", layers, config_.num_layers);
  }
  if (gpt_oss_) fail("--prefill-gemms fp8 is not implemented for gpt-oss targets");
  if (auto why = kernels::fp8_gemm_unsupported(device(), dtype()); !why.empty()) {
    fail("--prefill-gemms fp8 cannot run here: {}", why);
  }
  int64_t bytes = 0;
  auto quantize = [&](const at::Tensor& w, int64_t i, const char* name) {
    if (w.size(0) % 16 != 0 || w.size(1) % 16 != 0) {
      fail(
          "--prefill-gemms fp8: layer {}'s {} is {}, the FP8 GEMM needs both sizes multiples "
          "of 16",
          i, name, w.sizes());
    }
    auto q = kernels::quantize_rows_e4m3(w);
    bytes += q.data.nbytes() + q.scale.nbytes();
    return q;
  };
  // Each projection not yet in e4m3 (nor kept in FP8 blocks at load).
  auto once = [&](kernels::Fp8Rows& rows, const kernels::Fp8Blocks& blocks, const at::Tensor& w,
                  int64_t i, const char* name) {
    if (!rows.data.defined() && !blocks.defined()) rows = quantize(w, i, name);
  };
  for (int64_t i = 0; i < layers; ++i) {
    auto& l = layers_[i];
    if (l.linear.conv.defined()) {
      once(l.qkv_fp8, l.qkv_blocks, l.linear.w_in, i, "linear-attention in_proj");
      once(l.o_fp8, l.o_blocks, l.linear.w_out, i, "linear-attention out_proj");
    } else {
      once(l.qkv_fp8, l.qkv_blocks, l.w_qkv, i, "q/k/v projection");
      once(l.o_fp8, l.o_blocks, l.w_o, i, "o projection");
    }
    if (l.router.defined()) continue;
    once(l.gate_up_fp8, l.gate_up_blocks, l.w_gate_up, i, "gate/up projection");
    once(l.down_fp8, l.down_blocks, l.w_down, i, "down projection");
  }
  return bytes;
}

int64_t TargetModel::release_compute_projections() {
  int64_t bytes = 0;
  for (auto& l : layers_) {
    const std::pair<at::Tensor*, const kernels::Fp8Rows*> held[] = {
        {&l.w_qkv, &l.qkv_fp8},         {&l.w_o, &l.o_fp8},
        {&l.linear.w_in, &l.qkv_fp8},   {&l.linear.w_out, &l.o_fp8},
        {&l.w_gate_up, &l.gate_up_fp8}, {&l.w_down, &l.down_fp8}};
    for (const auto& [t, rows] : held) {
      if (!t->defined() || !rows->data.defined()) continue;
      bytes += t->nbytes();
      t->reset();
    }
  }
  return bytes;
}

std::pair<int64_t, int64_t> TargetModel::fp8_block_bytes() const {
  int64_t bytes = 0, count = 0;
  for (const auto& l : layers_) {
    for (const auto* b : {&l.qkv_blocks, &l.o_blocks, &l.gate_up_blocks, &l.down_blocks}) {
      if (!b->defined()) continue;
      bytes += b->nbytes();
      ++count;
    }
  }
  return {bytes, count};
}

at::Tensor TargetModel::embed(const at::Tensor& tokens) const {
  if (tp_ == nullptr) return at::embedding(embed_, tokens);
  // Each token's row is on one rank; the others add zeros (exact in any dtype).
  const int64_t rows = embed_.size(0);
  const auto local = tokens - vocab_start_;
  const auto elsewhere = (local < 0).logical_or_(local >= rows).unsqueeze(-1);
  auto x = at::embedding(embed_, local.clamp(0, rows - 1)).masked_fill_(elsewhere, 0);
  tp_reduce(x, "target_tp_embedding");
  return x;
}

at::Tensor TargetModel::lm_head(const at::Tensor& hidden) const {
  const int64_t rows = hidden.numel() / std::max<int64_t>(hidden.size(-1), 1);
  const bool few = fused_kernels(hidden) && rows <= kernels::kWgmmaLinearMaxRows;
  auto logits = few ? kernels::inference_linear(hidden, lm_head_) : at::linear(hidden, lm_head_);
  return gather_vocab(logits, -1);
}

at::Tensor TargetModel::gather_vocab(const at::Tensor& slice, int64_t dim) const {
  if (tp_ == nullptr) return slice;
  // Every rank's slice padded to the first rank's size (all_gather's one shape), then cut back.
  dim = dim < 0 ? dim + slice.dim() : dim;
  const int64_t ranks = tp_->size(), width = Split{0, ranks}.piece(config_.vocab_size).second;
  at::Tensor padded = slice;
  if (slice.size(dim) < width) {
    auto sizes = slice.sizes().vec();
    sizes[dim] = width - slice.size(dim);
    padded = at::cat({slice, at::zeros(sizes, slice.options())}, dim);
  }
  std::vector<at::Tensor> slices;
  {
    obs::Scope scope(obs::Stage::kTargetAllReduce, slice.device());
    slices = tp_->all_gather(padded.contiguous(), "target_tp_vocab");
  }
  for (int64_t r = 0; r < ranks; ++r) {
    slices[r] = slices[r].narrow(dim, 0, Split{r, ranks}.piece(config_.vocab_size).second);
  }
  return at::cat(slices, dim);
}

template <class Attend>
at::Tensor TargetModel::decoder_layer(const TargetLayerWeights& w, at::Tensor x,
                                      at::Tensor& pending, const at::Tensor& cos,
                                      const at::Tensor& sin, bool fused, PrefillGemms gemms,
                                      const CacheRows& cache, const Sequences& seqs,
                                      Attend&& attend, at::Tensor* entering) const {
  const ModelConfig& c = config_;
  const double eps = c.rms_norm_eps;
  // This rank's heads (all of them without tensor parallelism).
  const int64_t t = x.size(0), d = c.head_dim;
  const int64_t heads = c.num_heads / tp_size(), kv_heads = kv_heads_of(c, 0, tp_size()).second;
  const int64_t nq = heads * d, nkv = kv_heads * d;
  const bool small = fused && t <= kernels::kSmallLinearFasterRows;
  const bool tuned = fused && !small && gemms == PrefillGemms::kTuned;
  const bool fp8 = gemms == PrefillGemms::kFp8 && !c10::GradMode::is_enabled();
  const bool linear_mixer = w.linear.conv.defined(), dense_mlp = !w.router.defined();
  check_projections_held(w, fp8);
  auto linear8 = [&](const kernels::Fp8Rows& in, const kernels::Fp8Rows& weight) {
    return mm8(in, weight, x.options());
  };
  // An FP8 projection of compute-dtype rows: its input in 1 x 128 groups for block weights,
  // else in rows.
  auto proj8 = [&](const at::Tensor& in, const kernels::Fp8Rows& rows,
                   const kernels::Fp8Blocks& blocks) {
    return blocks.defined() ? kernels::linear_fp8_blocks(in, blocks)
                            : linear8(kernels::quantize_rows_e4m3(in), rows);
  };
  auto linear = [&](const at::Tensor& in, const at::Tensor& weight, const at::Tensor& bias) {
    // A decode step's row or a speculative block's: small_linear / wgmma_linear where they fit.
    if (fused && t <= kernels::kWgmmaLinearMaxRows) {
      return kernels::inference_linear(in, weight, bias);
    }
    if (tuned && !bias.defined()) return kernels::linear_tuned(in, weight);
    return bias.defined() ? at::linear(in, weight, bias) : at::linear(in, weight);
  };
  // The input norm, adding the previous layer's deferred MLP output where there is one; its
  // rows as `add_norm` writes them (bf16, or e4m3 for the FP8 GEMM), a plain norm's through
  // `finish`.
  auto input_norm = [&](auto&& add_norm, auto&& finish) {
    if (!pending.defined()) return finish(rms_norm(x, w.input_norm, eps));
    auto r = add_norm(x, pending, w.input_norm, eps);
    x = r.sum;
    if (entering != nullptr) *entering = x;
    return r.normed;
  };
  // The token mixer's projections: its input from the normed rows (e4m3 rows written by the
  // norm for the FP8 GEMM), its output from the mixed rows.
  // The fused norm writes e4m3 rows; block weights take the bf16 rows, grouped by proj8.
  auto mixer_in = [&](const at::Tensor& weight, const kernels::Fp8Rows& weight8,
                      const kernels::Fp8Blocks& blocks, const at::Tensor& bias) {
    if (!fp8 || blocks.defined()) {
      auto h = input_norm(kernels::add_rms_norm, [](at::Tensor h) { return h; });
      if (!fp8) return linear(h, weight, bias);
      auto out = proj8(h, weight8, blocks);
      if (bias.defined()) out.add_(bias);
      return out;
    }
    auto out =
        linear8(input_norm(kernels::add_rms_norm_e4m3,
                           [](const at::Tensor& h) { return kernels::quantize_rows_e4m3(h); }),
                weight8);
    if (bias.defined()) out.add_(bias);
    return out;
  };
  auto mixer_out = [&](const at::Tensor& in, const at::Tensor& weight,
                       const kernels::Fp8Rows& weight8, const kernels::Fp8Blocks& blocks) {
    return fp8 ? proj8(in, weight8, blocks) : linear(in, weight, {});
  };
  // The token mixer's output: a linear-attention layer's Gated DeltaNet, else attention.
  auto attention = [&] {
    at::Tensor qkv = mixer_in(w.w_qkv, w.qkv_fp8, w.qkv_blocks, w.b_qkv);
    at::Tensor q, k, v, gate;
    // The fused q/k norm + rotary kernels rotate whole heads of plain q rows; gated attention
    // (q and gate interleaved per head, partial rotary) takes the composition below.
    const bool fused_qk = fused && c.qk_norm && !c.attn_output_gate && c.rotary_dim() == d;
    if (fused_qk && cache.keys.defined()) {
      // One launch instead of the two index_copy_ of KVCache::update (72 a step in Qwen3-8B).
      q = kernels::qk_norm_rotary_into_cache(qkv, heads, kv_heads, w.q_norm, w.k_norm, cos, sin,
                                             eps, cache.keys, cache.values, cache.rows,
                                             cache.q_group_major);
    } else if (fused_qk) {
      std::tie(q, k) =
          kernels::qk_norm_rotary(qkv, heads, kv_heads, w.q_norm, w.k_norm, cos, sin, eps);
      v = qkv.narrow(1, nq + nkv, nkv).view({t, kv_heads, d});
    } else {
      const int64_t q_rows = c.attn_output_gate ? 2 * nq : nq;
      if (c.attn_output_gate) {
        auto q_gate = qkv.narrow(1, 0, q_rows).view({t, heads, 2 * d});
        q = q_gate.narrow(2, 0, d);
        gate = q_gate.narrow(2, d, d).reshape({t, nq});
      } else {
        q = qkv.narrow(1, 0, nq).view({t, heads, d});
      }
      k = qkv.narrow(1, q_rows, nkv).view({t, kv_heads, d});
      v = qkv.narrow(1, q_rows + nkv, nkv).view({t, kv_heads, d});
      if (c.qk_norm) {
        q = rms_norm(q, w.q_norm, eps);
        k = rms_norm(k, w.k_norm, eps);
      }
      q = partial_rotary(q, cos, sin);
      k = partial_rotary(k, cos, sin);
    }
    auto attn = attend(q, k, v).reshape({t, nq});
    if (gate.defined()) attn = attn * at::sigmoid(gate);
    return mixer_out(attn, w.w_o, w.o_fp8, w.o_blocks);
  };
  // A linear-attention layer keeps its conv weight when its projections are released.
  at::Tensor o =
      linear_mixer ? mixer_out(gated_delta_net(mixer_in(w.linear.w_in, w.qkv_fp8, w.qkv_blocks, {}),
                                               w.linear, linear_share(c.linear, tp_size()), eps,
                                               seqs.cu_seqlens, seqs.lengths, seqs.linear),
                               w.linear.w_out, w.o_fp8, w.o_blocks)
                   : attention();
  tp_reduce(o, "target_tp_attention");
  const bool dense_fp8 = fp8 && dense_mlp;
  if (!fused) {
    auto x1 = x + o;
    auto h1 = rms_norm(x1, w.post_attention_norm, eps);
    at::Tensor mlp;
    if (dense_fp8) {
      auto act = kernels::silu_mul(proj8(h1, w.gate_up_fp8, w.gate_up_blocks));
      mlp = proj8(act, w.down_fp8, w.down_blocks);
    } else {
      mlp = w.router.defined() ? sparse_mlp(c, w, h1, first_expert_)
                               : swiglu_mlp(h1, w.w_gate_up, w.w_down);
    }
    tp_reduce(mlp, "target_tp_mlp");
    return x1 + mlp;
  }
  if (dense_fp8) {
    at::Tensor sum;
    std::tie(sum, pending) = fused_fp8_mlp(w, x, o, eps);
    tp_reduce(pending, "target_tp_mlp");
    return sum;
  }
  auto r = kernels::add_rms_norm(x, o, w.post_attention_norm, eps);
  pending = w.router.defined()
                ? sparse_mlp(c, w, r.normed, first_expert_)
                : linear(kernels::silu_mul(linear(r.normed, w.w_gate_up, {})), w.w_down, {});
  tp_reduce(pending, "target_tp_mlp");
  return r.sum;
}

template <class Attend>
ForwardResult TargetModel::run(const at::Tensor& tokens, const at::Tensor& positions,
                               const Sequences& seqs, const ForwardRequest& request, KVCache* cache,
                               const at::Tensor& cache_rows, bool q_group_major,
                               Attend&& attend) const {
  const at::Tensor& cu_seqlens = seqs.cu_seqlens;
  std::optional<c10::NoGradGuard> no_grad;
  if (!request.grad) no_grad.emplace();
  for (int64_t id : request.tap_layers) {
    if (id < 0 || id >= config_.num_layers) {
      fail("target forward: tap layer {} is out of range [0, {})", id, config_.num_layers);
    }
  }
  ForwardResult result;
  result.taps.resize(request.tap_layers.size());
  auto x = embed(tokens);
  auto [cos, sin] = rotary_.tables(positions, x.scalar_type());
  const bool fused = fused_kernels(x);
  at::Tensor pending;  // fused: the last layer's MLP output, not yet added to x
  // Without logits or a cache to fill (training's features) the layers after the last tapped
  // one change nothing returned: Qwen3-8B's default taps end at layer 33 of 36.
  int64_t layers = config_.num_layers;
  if (request.logits == Logits::kNone && cache == nullptr && !request.tap_layers.empty()) {
    layers = layers_for_taps(request.tap_layers);
  }
  for (int64_t i = 0; i < layers; ++i) {
    const CacheRows rows =
        cache != nullptr ? CacheRows{cache->keys(i), cache->values(i), cache_rows, q_group_major}
                         : CacheRows{};
    std::optional<LinearCacheStep> linear;
    if (cache != nullptr && seqs.linear != nullptr && config_.is_linear_layer(i)) {
      linear.emplace(*seqs.linear);
      linear->state = cache->linear_state(i);
    }
    const Sequences layer_seqs{seqs.cu_seqlens, seqs.lengths, linear ? &*linear : nullptr};
    at::Tensor entering;
    x = decoder_layer(
        layers_[i], x, pending, cos, sin, fused, request.gemms, rows, layer_seqs,
        [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
          return attend(i, q, k, v);
        },
        &entering);
    // Holding x only where tapped lets every other layer's output be freed. A tapped layer
    // whose MLP add is deferred is read from the next layer's norm, which sums it anyway (the
    // same bits as x + pending, one pass fewer); the last one computed adds it here.
    for (size_t j = 0; j < request.tap_layers.size(); ++j) {
      if (request.tap_layers[j] == i - 1 && !result.taps[j].defined()) result.taps[j] = entering;
      if (request.tap_layers[j] != i) continue;
      if (!pending.defined()) {
        result.taps[j] = x;
      } else if (i + 1 == layers) {
        result.taps[j] = x + pending;
      }
    }
  }
  if (request.logits == Logits::kNone) return result;
  if (request.logits == Logits::kLast) {
    auto last = request.logit_rows.defined()
                    ? request.logit_rows
                    : cu_seqlens.narrow(0, 1, cu_seqlens.size(0) - 1).to(at::kLong) - 1;
    x = x.index_select(0, last);
    if (pending.defined()) pending = pending.index_select(0, last);
  }
  const double eps = config_.rms_norm_eps;
  result.logits = lm_head(pending.defined() ? kernels::add_rms_norm(x, pending, norm_, eps).normed
                                            : rms_norm(x, norm_, eps));
  return result;
}

ForwardResult TargetModel::forward(const at::Tensor& tokens, const PackedBatch& batch,
                                   const ForwardRequest& request) const {
  if (tokens.dim() != 1 || tokens.size(0) != batch.total) {
    fail("target forward: tokens must be [{}] (the packed batch), got [{}]", batch.total,
         fmt::join(tokens.sizes(), ", "));
  }
  if (gpt_oss_) return gpt_oss_->forward(*this, tokens, batch, request);
  return run(tokens, batch.positions, {batch.cu_seqlens, batch.lengths}, request, nullptr, {},
             /*q_group_major=*/false,
             [&](int64_t, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
               return packed_causal_attention(q, k, v, batch, request.attention);
             });
}

KVCache TargetModel::make_cache(int64_t slots, int64_t capacity, int64_t window_span) const {
  const int64_t kv_heads = kv_heads_of(config_, 0, tp_size()).second;
  WindowRings rings;
  if (gpt_oss_ && window_span > 0) {
    rings.span = window_span;
    for (int64_t i = 0; i < config_.num_layers; ++i) {
      rings.windows.push_back(config_.gpt_oss.sliding(i) ? config_.gpt_oss.sliding_window : 0);
    }
  }
  return KVCache(config_, kv_heads, linear_share(config_.linear, tp_size()), slots, capacity,
                 device(), dtype(), rings);
}

ForwardResult TargetModel::forward_cached(const at::Tensor& tokens, const AppendBatch& batch,
                                          KVCache& cache, const ForwardRequest& request) const {
  if (tokens.dim() != 1 || tokens.size(0) != batch.total) {
    fail("target cached forward: tokens must be [{}] (the append batch), got [{}]", batch.total,
         fmt::join(tokens.sizes(), ", "));
  }
  const at::Tensor& k0 = cache.keys(0);
  const int64_t kv_heads = kv_heads_of(config_, 0, tp_size()).second;
  if (cache.num_layers() != config_.num_layers || k0.size(1) != kv_heads ||
      k0.size(2) != config_.head_dim || k0.scalar_type() != dtype() || k0.device() != device()) {
    fail(
        "target cached forward: the cache ({} layers of [{}], {} on {}) is not for this model "
        "({} layers, {} KV heads x {} on this rank, {} on {}; TargetModel::make_cache)",
        cache.num_layers(), fmt::join(k0.sizes(), ", "), c10::toString(k0.scalar_type()),
        k0.device().str(), config_.num_layers, kv_heads, config_.head_dim, c10::toString(dtype()),
        device().str());
  }
  if (batch.is_tree() && config_.is_hybrid()) {
    fail(
        "target cached forward: a tree batch needs attention in every layer; {}'s linear-attention "
        "layers keep one state per slot, which cannot follow the tree's branches",
        architecture_name(config_.arch));
  }
  bool first_slots = true, same_counts = true;
  for (int64_t i = 0; i < batch.size(); ++i) {
    if (cache.length(batch.slots[i]) != batch.starts[i]) {
      fail("target cached forward: slot {} holds {} tokens but the batch appends at {}",
           batch.slots[i], cache.length(batch.slots[i]), batch.starts[i]);
    }
    first_slots = first_slots && batch.slots[i] == i;
    same_counts = same_counts && batch.counts[i] == batch.counts[0];
  }
  // Hybrids: the recurrent form for equal blocks (decode steps, verify passes), else the
  // chunked one (prefill). A verify keeps the states after each block token: the state after a
  // partially accepted block is then a copy from the block buffers (KVCache::crop), with fixed
  // shapes and no host sync (what a CUDA graph needs); recomputing the accepted prefix from the
  // pre-block state would cost a second pass.
  const int64_t steps = batch.counts[0];
  const bool recurrent = same_counts && steps <= std::max<int64_t>(1, cache.block_tokens());
  const bool keep = request.keep_block_states && cache.has_linear_state();
  if (keep && (!recurrent || steps > cache.block_tokens())) {
    fail(
        "target cached forward: a verify pass keeping block states needs equal blocks of at most "
        "{} tokens (KVCache::keep_block_states), got counts {}",
        cache.block_tokens(), fmt::join(batch.counts, ", "));
  }
  for (int64_t slot : batch.slots) {
    if (cache.holds_block(slot)) {
      fail("target cached forward: slot {} holds an uncommitted verify block (crop it first)",
           slot);
    }
  }
  if (gpt_oss_ && request.logit_rows.defined()) {
    fail("target cached forward: gpt-oss takes no logit_rows");
  }
  const LinearCacheStep linear{{}, &batch, recurrent ? steps : 0, first_slots, keep};
  // The fused q/k kernel writes q group-major where the batch attends per token; layers that
  // write their own K/V (k defined) keep q head-major.
  const at::Tensor group_offsets =
      gpt_oss_ ? at::Tensor()
               : group_major_query_offsets(batch, config_.num_heads / tp_size(), kv_heads, dtype());
  auto result =
      gpt_oss_
          ? gpt_oss_->forward_cached(*this, tokens, batch, cache, request)
          : run(tokens, batch.positions,
                {batch.cu_seqlens, batch.counts, config_.is_hybrid() ? &linear : nullptr}, request,
                &cache, batch.rows, group_offsets.defined(),
                [&](int64_t layer, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
                  if (k.defined()) {
                    cache.update(layer, batch.rows, k, v);
                    return cached_causal_attention(q, cache, layer, batch);
                  }
                  return cached_causal_attention(q, cache, layer, batch, 0, group_offsets);
                });
  for (int64_t i = 0; i < batch.size(); ++i) {
    if (keep) {
      cache.extend_block(batch.slots[i], batch.counts[i]);
    } else {
      cache.extend(batch.slots[i], batch.counts[i]);
    }
  }
  return result;
}

std::vector<std::pair<std::string, at::Tensor>> TargetModel::hf_state_dict() const {
  if (tp_ != nullptr)
    fail("target: a tensor-parallel rank holds slices; it cannot write the model");
  // The text-only layout (model.*) whatever was read, as to_hf_json writes the config.
  ModelConfig c = config_;
  c.multimodal = false;
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  const int64_t q_rows = c.attn_output_gate ? 2 * q : q;
  auto norm = [&](const at::Tensor& w) { return c.norm_plus_one ? norm_weight_to_file(w) : w; };
  std::vector<std::pair<std::string, at::Tensor>> out;
  // Rows [offset, offset + rows) of a projection, held dense or in FP8 blocks (written as the
  // published checkpoints are: the e4m3 weight and its weight_scale_inv).
  auto put = [&](const std::string& name, const at::Tensor& dense, const kernels::Fp8Blocks& blocks,
                 int64_t offset, int64_t rows) {
    if (!blocks.defined()) {
      out.push_back({name, dense.narrow(0, offset, rows)});
      return;
    }
    auto b = block_rows(blocks, offset, rows);
    out.push_back({name, b.data});
    out.push_back({name + "_scale_inv", b.scale_inv});
  };
  out.push_back({"model.embed_tokens.weight", embed_});
  if (gpt_oss_) {
    auto layers = gpt_oss_->hf_state_dict();
    out.insert(out.end(), layers.begin(), layers.end());
  }
  for (int64_t i = 0; i < c.num_layers && !gpt_oss_; ++i) {
    const auto& l = layers_[i];
    const std::string p = c.layer_prefix(i);
    out.push_back({p + "input_layernorm.weight", norm(l.input_norm)});
    out.push_back({p + "post_attention_layernorm.weight", norm(l.post_attention_norm)});
    if (l.linear.w_in.defined()) {
      const std::string a = p + "linear_attn.";
      const auto& s = c.linear;
      if (c.arch == Architecture::kQwen3Next) {
        auto [qkvz, ba] = qwen3_next_in_proj_inverse(l.linear.w_in, s);
        out.push_back({a + "in_proj_qkvz.weight", qkvz});
        out.push_back({a + "in_proj_ba.weight", ba});
      } else {
        const int64_t nv = s.num_value_heads, cd = s.conv_dim(), vd = s.value_dim();
        out.push_back({a + "in_proj_qkv.weight", l.linear.w_in.narrow(0, 0, cd)});
        out.push_back({a + "in_proj_z.weight", l.linear.w_in.narrow(0, cd, vd)});
        out.push_back({a + "in_proj_b.weight", l.linear.w_in.narrow(0, cd + vd, nv)});
        out.push_back({a + "in_proj_a.weight", l.linear.w_in.narrow(0, cd + vd + nv, nv)});
      }
      out.push_back({a + "conv1d.weight", l.linear.conv.unsqueeze(1)});
      out.push_back({a + "A_log", l.linear.a_log});
      out.push_back({a + "dt_bias", l.linear.dt_bias});
      out.push_back({a + "norm.weight", l.linear.norm});
      put(a + "out_proj.weight", l.linear.w_out, l.o_blocks, 0, c.hidden_size);
    } else {
      put(p + "self_attn.q_proj.weight", l.w_qkv, l.qkv_blocks, 0, q_rows);
      put(p + "self_attn.k_proj.weight", l.w_qkv, l.qkv_blocks, q_rows, kv);
      put(p + "self_attn.v_proj.weight", l.w_qkv, l.qkv_blocks, q_rows + kv, kv);
      if (c.attention_bias) {
        out.push_back({p + "self_attn.q_proj.bias", l.b_qkv.narrow(0, 0, q)});
        out.push_back({p + "self_attn.k_proj.bias", l.b_qkv.narrow(0, q, kv)});
        out.push_back({p + "self_attn.v_proj.bias", l.b_qkv.narrow(0, q + kv, kv)});
      }
      if (c.qk_norm) {
        out.push_back({p + "self_attn.q_norm.weight", norm(l.q_norm)});
        out.push_back({p + "self_attn.k_norm.weight", norm(l.k_norm)});
      }
      put(p + "self_attn.o_proj.weight", l.w_o, l.o_blocks, 0, c.hidden_size);
    }
    if (!l.router.defined()) {
      const int64_t f = c.intermediate_size;
      put(p + "mlp.gate_proj.weight", l.w_gate_up, l.gate_up_blocks, 0, f);
      put(p + "mlp.up_proj.weight", l.w_gate_up, l.gate_up_blocks, f, f);
      put(p + "mlp.down_proj.weight", l.w_down, l.down_blocks, 0, c.hidden_size);
      continue;
    }
    // The published per-expert layout, which every reader of Qwen3 MoE checkpoints takes.
    const int64_t f = c.moe_intermediate_size;
    out.push_back({p + "mlp.gate.weight", l.router});
    if (l.shared_gate.defined()) {
      const int64_t sf = c.shared_expert_intermediate_size;
      out.push_back({p + "mlp.shared_expert.gate_proj.weight", l.shared_gate_up.narrow(0, 0, sf)});
      out.push_back({p + "mlp.shared_expert.up_proj.weight", l.shared_gate_up.narrow(0, sf, sf)});
      out.push_back({p + "mlp.shared_expert.down_proj.weight", l.shared_down});
      out.push_back({p + "mlp.shared_expert_gate.weight", l.shared_gate});
    }
    for (int64_t e = 0; e < c.num_experts; ++e) {
      const std::string x = fmt::format("{}mlp.experts.{}.", p, e);
      out.push_back({x + "gate_proj.weight", l.experts_gate_up[e].narrow(0, 0, f)});
      out.push_back({x + "up_proj.weight", l.experts_gate_up[e].narrow(0, f, f)});
      out.push_back({x + "down_proj.weight", l.experts_down[e]});
    }
  }
  out.push_back({"model.norm.weight", norm(norm_)});
  if (!c.tie_word_embeddings) out.push_back({"lm_head.weight", lm_head_});
  return out;
}

std::vector<at::Tensor> TargetModel::parameters() const {
  if (tp_ != nullptr) fail("target: a tensor-parallel target is frozen; it is not trainable");
  std::vector<at::Tensor> out = {embed_};
  if (gpt_oss_) {
    for (const auto& t : gpt_oss_->parameters()) out.push_back(t);
  }
  for (const auto& l : layers_) {
    for (const at::Tensor& t : {l.input_norm,
                                l.post_attention_norm,
                                l.w_qkv,
                                l.b_qkv,
                                l.q_norm,
                                l.k_norm,
                                l.w_o,
                                l.w_gate_up,
                                l.w_down,
                                l.router,
                                l.experts_gate_up,
                                l.experts_down,
                                l.shared_gate_up,
                                l.shared_down,
                                l.shared_gate,
                                l.linear.w_in,
                                l.linear.conv,
                                l.linear.a_log,
                                l.linear.dt_bias,
                                l.linear.norm,
                                l.linear.w_out}) {
      if (t.defined()) out.push_back(t);
    }
  }
  out.push_back(norm_);
  if (!config_.tie_word_embeddings) out.push_back(lm_head_);
  return out;
}

TargetModel TargetModel::cast(at::ScalarType dtype) const {
  TargetModel m(*this);
  if (gpt_oss_) m.gpt_oss_ = gpt_oss_->cast(dtype);
  auto to = [&](at::Tensor& t) {
    if (t.defined()) t = t.to(dtype);
  };
  to(m.embed_);
  for (auto& l : m.layers_) {
    for (at::Tensor* t : {&l.input_norm,
                          &l.post_attention_norm,
                          &l.w_qkv,
                          &l.b_qkv,
                          &l.q_norm,
                          &l.k_norm,
                          &l.w_o,
                          &l.w_gate_up,
                          &l.w_down,
                          &l.router,
                          &l.experts_gate_up,
                          &l.experts_down,
                          &l.shared_gate_up,
                          &l.shared_down,
                          &l.shared_gate,
                          &l.linear.w_in,
                          &l.linear.conv,
                          &l.linear.a_log,
                          &l.linear.dt_bias,
                          &l.linear.norm,
                          &l.linear.w_out}) {
      to(*t);
    }
  }
  to(m.norm_);
  m.lm_head_ = config_.tie_word_embeddings ? m.embed_ : lm_head_.to(dtype);
  return m;
}

int64_t layers_for_taps(const std::vector<int64_t>& taps) {
  if (taps.empty()) fail("layers_for_taps: no tapped layer");
  return *std::max_element(taps.begin(), taps.end()) + 1;
}

double prefill_flops(const ModelConfig& c, const std::vector<int64_t>& lengths, int64_t logit_rows,
                     int64_t layers) {
  const double h = c.hidden_size, q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  if (layers < 0) layers = c.num_layers;
  // A sparse layer's experts counted only as often as tokens are routed to them.
  double linear_params = 0, full_layers = 0, per_token = 0;
  const auto& l = c.linear;
  for (int64_t i = 0; i < layers; ++i) {
    linear_params += static_cast<double>(c.mlp_parameters(i, true));
    if (c.is_linear_layer(i)) {
      linear_params +=
          h * static_cast<double>(l.conv_dim() + 2 * l.value_dim() + 2 * l.num_value_heads);
      // The chunked delta rule (chunks of 64) per token and value head: q and k against the
      // state and the state's update (3 products of Dk x Dv), and the chunk-local products of
      // 64 rows over Dk and Dv; the depthwise conv.
      const double dk = static_cast<double>(l.key_head_dim),
                   dv = static_cast<double>(l.value_head_dim);
      per_token += static_cast<double>(l.num_value_heads) * (6 * dk * dv + 2 * 64 * (dk + dv)) +
                   2.0 * static_cast<double>(l.conv_dim() * l.conv_kernel_dim);
      continue;
    }
    linear_params += h * ((c.attn_output_gate ? 2 : 1) * q + 2 * kv) + q * h;
    full_layers += 1;
  }
  double flops = 0;
  for (int64_t n : lengths) {
    const double s = static_cast<double>(n);
    flops += (2 * linear_params + per_token) * s + full_layers * 2 * s * (s + 1) * q;
  }
  return flops + 2.0 * h * c.vocab_size * logit_rows;
}

}  // namespace dflash::models
