// Helpers shared by the drafter and training tests: the DFlash fixtures (tiny target, fp32
// drafter, sequences and anchors) loaded into C++ objects, and target taps computed in C++.
#pragma once
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/file.h"
#include "io/safetensors.h"
#include "models/drafter.h"
#include "models/target.h"
#include "test_util.h"
#include "train/trainer.h"

namespace dflash::testing {

template <class T>
std::vector<T> to_vector(const at::Tensor& t) {
  auto c = t.contiguous();
  if constexpr (std::is_same_v<T, uint8_t>) {
    auto u = c.to(at::kByte);
    return std::vector<T>(u.data_ptr<uint8_t>(), u.data_ptr<uint8_t>() + u.numel());
  } else {
    auto l = c.to(at::kLong);
    return std::vector<T>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  }
}

// Concatenated taps [tokens, K*H] of `ids` computed by our target.
inline at::Tensor taps(const models::TargetModel& target, const at::Tensor& tokens,
                       const std::vector<int64_t>& lengths, const std::vector<int64_t>& ids) {
  auto batch = models::PackedBatch::from_lengths(lengths, tokens.device());
  auto out = target.forward(tokens, batch, {ids, models::Logits::kNone});
  return at::cat(out.taps, 1);
}

struct DflashCase {
  std::filesystem::path dir;
  std::shared_ptr<io::SafetensorsFile> ref;
  std::unique_ptr<models::TargetModel> target;
  std::unique_ptr<models::Drafter> drafter;
  train::StepInput input;
  std::vector<int64_t> lengths;
  std::vector<std::vector<int64_t>> anchors;

  at::Tensor tensor(const std::string& name) const { return ref->tensor(name); }

  // Target and drafter (fp32) on `device`; the reference stays on the CPU.
  explicit DflashCase(const std::string& name, at::Device device = at::kCPU) {
    dir = fixture("dflash/" + name);
    ref = io::SafetensorsFile::open(dir / "reference.safetensors");
    target = std::make_unique<models::TargetModel>(
        models::TargetModel::load(dir / "target", device, at::kFloat));
    drafter = std::make_unique<models::Drafter>(
        models::Drafter::load(dir / "drafter_init", target->config(), device));
    lengths = to_vector<int64_t>(tensor("lengths"));
    auto tokens = to_vector<int64_t>(tensor("tokens"));
    auto masks = to_vector<uint8_t>(tensor("loss_mask"));
    auto flat_anchors = to_vector<int64_t>(tensor("anchors"));
    auto counts = to_vector<int64_t>(tensor("anchor_counts"));
    size_t start = 0, astart = 0;
    for (size_t s = 0; s < lengths.size(); ++s) {
      const size_t n = static_cast<size_t>(lengths[s]);
      input.tokens.emplace_back(tokens.begin() + start, tokens.begin() + start + n);
      input.loss_masks.emplace_back(masks.begin() + start, masks.begin() + start + n);
      anchors.emplace_back(flat_anchors.begin() + astart,
                           flat_anchors.begin() + astart + counts[s]);
      start += n;
      astart += counts[s];
    }
    input.features =
        taps(*target, tensor("tokens").to(device), lengths, drafter->config().target_layer_ids);
  }

  void zero_grads() const {
    for (auto p : drafter->parameters()) p.mutable_grad() = at::Tensor();
  }
};

}  // namespace dflash::testing
