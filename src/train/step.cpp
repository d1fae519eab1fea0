#include "train/step.h"

#include <fmt/ranges.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "common/error.h"
#include "obs/stages.h"
#include "train/loss.h"

namespace dflash::train {
namespace {

// The sample's first max_seq_len tokens.
SampleView cut(const SampleView& s, int64_t max_seq_len) {
  const auto n = static_cast<size_t>(max_seq_len);
  return {s.id, s.ids.first(std::min(s.ids.size(), n)), s.mask.first(std::min(s.mask.size(), n))};
}

MicroResult empty_result(const models::DrafterConfig& config, at::Device device) {
  auto f32 = at::TensorOptions().device(device).dtype(at::kFloat);
  MicroResult r;
  r.weighted_ce = at::zeros({}, f32);
  r.correct = at::zeros({config.block_size}, f32);
  r.count = at::zeros({config.block_size}, f32);
  r.predictions = at::empty({0}, f32.dtype(at::kLong));
  return r;
}

struct SelectUniqueRows : public torch::autograd::Function<SelectUniqueRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& rows) {
    ctx->save_for_backward({rows});
    ctx->saved_data["sizes"] = x.sizes().vec();
    return x.index_select(0, rows);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto rows = ctx->get_saved_variables()[0];
    auto grad = at::zeros(ctx->saved_data["sizes"].toIntVector(), grads[0].options());
    return {grad.index_copy_(0, rows, grads[0]), at::Tensor()};
  }
};

}  // namespace

at::Tensor select_unique_rows(const at::Tensor& x, const at::Tensor& rows) {
  return SelectUniqueRows::apply(x, rows);
}

MicroBatch MicroBatch::to(at::Device device) const {
  MicroBatch out = *this;
  out.packed = models::PackedBatch::from_lengths(lengths, device);
  if (device == tokens.device()) return out;
  auto move = [&](const at::Tensor& t) { return t.to(device, /*non_blocking=*/true); };
  out.tokens = move(tokens);
  for (at::Tensor* t : out.blocks.tensors()) *t = move(*t);
  return out;
}

std::vector<int64_t> sample_anchors(const SampleView& sample, int64_t epoch,
                                    const AnchorOptions& options) {
  if (sample.ids.size() != sample.mask.size()) {
    fail("sample {}: {} tokens but a loss mask of {}", sample.id, sample.ids.size(),
         sample.mask.size());
  }
  return sample_anchors(sample.mask, options.max_anchors, options.seed, epoch, sample.id,
                        options.min_anchors);
}

MicroBatch form_micro_batch(int64_t position, int64_t epoch, std::span<const SampleView> samples,
                            int64_t max_seq_len, const AnchorOptions& anchor_options,
                            const models::DrafterConfig& config, bool pin) {
  MicroBatch mb;
  mb.position = position;
  mb.epoch = epoch;
  std::vector<std::vector<int64_t>> tokens, anchors;
  std::vector<std::vector<uint8_t>> masks;
  std::vector<int64_t> flat;
  for (const SampleView& s : samples) {
    const SampleView c = cut(s, max_seq_len);
    auto a = sample_anchors(c, epoch, anchor_options);
    if (a.empty()) {
      ++mb.skipped_sequences;
      continue;
    }
    tokens.emplace_back(c.ids.begin(), c.ids.end());
    masks.emplace_back(c.mask.begin(), c.mask.end());
    anchors.push_back(std::move(a));
    mb.sample_ids.push_back(s.id);
    mb.lengths.push_back(static_cast<int64_t>(tokens.back().size()));
    for (int64_t t : tokens.back()) {
      if (t < 0 || t >= config.layers.vocab_size) {
        fail(
            "sample {} has token id {} outside the target's vocabulary of {} (prepared with "
            "another tokenizer?)",
            s.id, t, config.layers.vocab_size);
      }
    }
    flat.insert(flat.end(), tokens.back().begin(), tokens.back().end());
  }
  mb.tokens = at::tensor(flat, at::kLong);
  mb.blocks = build_blocks(tokens, masks, anchors, config, at::kCPU);
  if (pin) {
    mb.tokens = mb.tokens.pin_memory();
    for (at::Tensor* t : mb.blocks.tensors()) *t = t->pin_memory();
  }
  return mb;
}

double label_weight_sum(std::span<const SampleView> samples, int64_t epoch, int64_t max_seq_len,
                        const AnchorOptions& anchor_options, const models::DrafterConfig& config) {
  double sum = 0;
  const int64_t bs = config.block_size;
  for (const SampleView& s : samples) {
    const SampleView c = cut(s, max_seq_len);
    const int64_t n = static_cast<int64_t>(c.mask.size());
    for (int64_t a : sample_anchors(c, epoch, anchor_options)) {
      for (int64_t k = 1; k < bs && a + k < n; ++k) {
        // Rounded through fp32 exactly as build_blocks stores the weights.
        if (c.mask[a + k]) sum += static_cast<float>(position_weight(k, config.gamma));
      }
    }
  }
  return sum;
}

DrafterGemms parse_drafter_gemms(const std::string& name, const std::string& what) {
  if (auto value = enum_value(kDrafterGemmsNames, name)) return *value;
  fail("{} must be {}, got \"{}\"", what, enum_choices(kDrafterGemmsNames), name);
}

DrafterGemms resolve_drafter_gemms(DrafterGemms requested, const models::DrafterConfig& config,
                                   at::Device device, at::ScalarType dtype) {
  if (requested == DrafterGemms::kCompute) return requested;
  // Off the GPU the FP8 GEMM is the dequantizing reference: slower, so only when asked for.
  if (!device.is_cuda() && requested == DrafterGemms::kAuto) return DrafterGemms::kCompute;
  const auto& c = config.layers;
  const int64_t widths[] = {c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                            c.intermediate_size};
  std::string why = kernels::fp8_gemm_unsupported(device, dtype);
  if (why.empty() &&
      std::any_of(std::begin(widths), std::end(widths), [](int64_t w) { return w % 16; })) {
    why = fmt::format(
        "the drafter's widths must be multiples of 16 (the FP8 GEMM reduces over them): hidden "
        "{}, q {}, k/v {}, intermediate {}",
        c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size);
  }
  if (why.empty()) return DrafterGemms::kFp8;
  if (requested == DrafterGemms::kAuto) return DrafterGemms::kCompute;
  fail("the fp8 drafter GEMMs cannot run: {}; use --drafter-gemms compute", why);
}

MicroResult forward_backward(const models::Drafter& drafter, const models::TargetHead& head,
                             const MicroBatch& mb, double grad_scale, const StepOptions& options,
                             const std::function<void()>& before_backward) {
  const auto& config = drafter.config();
  const at::Device device = drafter.device();
  if (mb.lengths.empty()) return empty_result(config, device);
  const int64_t width = config.num_taps() * config.layers.hidden_size;
  if (!mb.features.defined() || mb.features.dim() != 2 || mb.features.size(1) != width ||
      mb.features.size(0) != mb.num_tokens()) {
    fail("training step: features must be [{}, {}] ({} tokens, {} taps x hidden {}), got {}",
         mb.num_tokens(), width, mb.num_tokens(), config.num_taps(), config.layers.hidden_size,
         mb.features.defined() ? mb.features.sizes() : at::IntArrayRef{});
  }
  const auto& blocks = mb.blocks;
  if (mb.packed.size() != static_cast<int64_t>(mb.lengths.size())) {
    fail("training step: micro-batch {} was not moved to the device (MicroBatch::to)", mb.position);
  }
  at::Tensor rows;
  {
    obs::Scope scope(obs::Stage::kDrafterForward, device);
    auto hidden = drafter.forward(mb.features, mb.packed, blocks.layout, head, options.dtype,
                                  options.attention, models::BlockRows::kPredictions,
                                  options.drafter_gemms == DrafterGemms::kFp8);
    // label_rows ascend without repeats: as many labels as predicting rows is every row in
    // order, read as it is (no copy); otherwise the rows are selected and their gradients go
    // back to their places (no index_add).
    rows = blocks.num_labels == hidden.size(0) ? hidden
                                               : select_unique_rows(hidden, blocks.label_rows);
  }
  HeadLoss loss;
  {
    obs::Scope scope(obs::Stage::kLoss, device);
    const bool fp8 = options.head_grad == HeadGrad::kFp8;
    if (fp8 && !head.lm_head_t_fp8.data.defined()) {
      fail("training step: the fp8 head gradient needs the head's e4m3 copy (head_grad_fp8)");
    }
    loss = chunked_head_loss(rows, head.lm_head, blocks.labels, blocks.weights, blocks.label_k,
                             config.block_size, grad_scale, options.head_chunk_rows,
                             fp8 ? &head.lm_head_t_fp8 : nullptr);
  }
  if (before_backward) before_backward();
  if (rows.requires_grad() && blocks.num_labels > 0) {
    obs::Scope scope(obs::Stage::kBackward, device);
    rows.backward(loss.grad_hidden);
  }
  MicroResult r;
  r.weighted_ce = loss.weighted_ce;
  r.correct = loss.correct;
  r.count = loss.count;
  r.predictions = loss.predictions;
  r.weight_sum = blocks.weight_sum;
  r.blocks = blocks.layout.num_blocks();
  r.labels = blocks.num_labels;
  return r;
}

MicroResult forward_backward(const models::Drafter& drafter, const models::TargetHead& head,
                             const StepInput& in, const std::vector<std::vector<int64_t>>& anchors,
                             double grad_scale, const StepOptions& options) {
  const auto& config = drafter.config();
  const size_t n = in.tokens.size();
  if (in.loss_masks.size() != n || anchors.size() != n) {
    fail("training step: {} sequences, {} loss masks, {} anchor lists", n, in.loss_masks.size(),
         anchors.size());
  }
  const int64_t width = config.num_taps() * config.layers.hidden_size;
  if (!in.features.defined() || in.features.dim() != 2 || in.features.size(1) != width) {
    fail("training step: features must be [tokens, {}] ({} taps x hidden {}), got {}", width,
         config.num_taps(), config.layers.hidden_size,
         in.features.defined() ? in.features.sizes() : at::IntArrayRef{});
  }
  // This entry point serves tests and tools, not the hot loop, so it can afford a host check.
  if (!at::isfinite(in.features).all().item<bool>()) {
    fail(
        "training step: the target features contain NaN or Inf (bad target weights or "
        "activations overflowing in the target's dtype)");
  }
  // Sequences without anchors are left out of the drafter's packed batch entirely.
  std::vector<std::vector<int64_t>> tokens, anchor_lists;
  std::vector<std::vector<uint8_t>> masks;
  std::vector<at::Tensor> feature_parts;
  MicroBatch mb;
  int64_t offset = 0;
  for (size_t s = 0; s < n; ++s) {
    const int64_t len = static_cast<int64_t>(in.tokens[s].size());
    if (!anchors[s].empty()) {
      tokens.push_back(in.tokens[s]);
      masks.push_back(in.loss_masks[s]);
      anchor_lists.push_back(anchors[s]);
      mb.lengths.push_back(len);
      feature_parts.push_back(in.features.narrow(0, offset, len));
    }
    offset += len;
  }
  if (in.features.size(0) != offset) {
    fail("training step: features have {} rows, the sequences {} tokens", in.features.size(0),
         offset);
  }
  if (tokens.empty()) return empty_result(config, drafter.device());
  mb.blocks = build_blocks(tokens, masks, anchor_lists, config, at::kCPU);
  std::vector<int64_t> flat;
  for (const auto& t : tokens) flat.insert(flat.end(), t.begin(), t.end());
  mb.tokens = at::tensor(flat, at::kLong);
  mb = mb.to(drafter.device());
  mb.features = feature_parts.size() == n ? in.features : at::cat(feature_parts, 0);
  return forward_backward(drafter, head, mb, grad_scale, options);
}

double simulated_acceptance(const std::vector<double>& accuracy) {
  double tau = 1, prod = 1;
  for (double a : accuracy) {
    prod *= a;
    tau += prod;
  }
  return tau;
}

}  // namespace dflash::train
