#include "train/blocks.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/random.h"
#include "common/upload.h"

namespace dflash::train {

std::vector<int64_t> anchor_candidates(std::span<const uint8_t> loss_mask) {
  std::vector<int64_t> out;
  for (size_t a = 0; a + 1 < loss_mask.size(); ++a) {
    if (loss_mask[a] && loss_mask[a + 1]) out.push_back(static_cast<int64_t>(a));
  }
  return out;
}

std::vector<int64_t> sample_anchors(std::span<const uint8_t> loss_mask, int64_t max_anchors,
                                    uint64_t seed, int64_t epoch, int64_t sample_id,
                                    int64_t min_anchors) {
  auto cand = anchor_candidates(loss_mask);
  if (static_cast<int64_t>(cand.size()) < min_anchors) return {};
  const size_t m = std::min(cand.size(), static_cast<size_t>(std::max<int64_t>(max_anchors, 0)));
  uint64_t state = seed;
  splitmix64(state);
  state ^= static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ull;
  splitmix64(state);
  state ^= static_cast<uint64_t>(sample_id) * 0x8CB92BA72F3D8DD7ull;
  // Partial Fisher-Yates: the first m entries become a uniform sample without replacement.
  for (size_t i = 0; i < m; ++i) {
    const uint64_t span = cand.size() - i;
    const size_t j = i + static_cast<size_t>(uniform_below(state, span));
    std::swap(cand[i], cand[j]);
  }
  cand.resize(m);
  std::sort(cand.begin(), cand.end());
  return cand;
}

std::vector<int64_t> block_labels(const std::vector<int64_t>& tokens,
                                  const std::vector<uint8_t>& loss_mask, int64_t anchor,
                                  int64_t block_size) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<int64_t> labels(block_size, kNoLabel);
  for (int64_t k = 1; k < block_size; ++k) {
    const int64_t pos = anchor + k;  // block position k predicts the token k after the anchor
    if (pos < n && loss_mask[pos]) labels[k] = tokens[pos];
  }
  return labels;
}

double position_weight(int64_t k, double gamma) {
  return std::exp(-static_cast<double>(k - 1) / gamma);
}

BlockTargets build_blocks(const std::vector<std::vector<int64_t>>& tokens,
                          const std::vector<std::vector<uint8_t>>& loss_masks,
                          const std::vector<std::vector<int64_t>>& anchors,
                          const models::DrafterConfig& config, at::Device device) {
  if (tokens.size() != loss_masks.size() || tokens.size() != anchors.size()) {
    fail("build_blocks: {} token lists, {} loss masks, {} anchor lists", tokens.size(),
         loss_masks.size(), anchors.size());
  }
  const int64_t bs = config.block_size;
  BlockTargets t;
  t.layout.block_size = bs;
  std::vector<int64_t> anchor_ids, rows, labels, ks;
  std::vector<float> weights;
  for (size_t s = 0; s < tokens.size(); ++s) {
    const int64_t n = static_cast<int64_t>(tokens[s].size());
    if (static_cast<int64_t>(loss_masks[s].size()) != n) {
      fail("build_blocks: sequence {} has {} tokens but a loss mask of {}", s, n,
           loss_masks[s].size());
    }
    for (size_t i = 0; i < anchors[s].size(); ++i) {
      const int64_t a = anchors[s][i];
      if (a < 0 || a >= n)
        fail("build_blocks: anchor {} outside sequence {} of length {}", a, s, n);
      if (i > 0 && a <= anchors[s][i - 1])
        fail("build_blocks: anchors of sequence {} not ascending", s);
      const int64_t block = t.layout.num_blocks();
      t.layout.sequence.push_back(static_cast<int64_t>(s));
      t.layout.anchor.push_back(a);
      anchor_ids.push_back(tokens[s][a]);
      auto lab = block_labels(tokens[s], loss_masks[s], a, bs);
      for (int64_t k = 1; k < bs; ++k) {
        if (lab[k] == kNoLabel) continue;
        rows.push_back(block * (bs - 1) + k - 1);
        labels.push_back(lab[k]);
        ks.push_back(k);
        weights.push_back(static_cast<float>(position_weight(k, config.gamma)));
        t.weight_sum += weights.back();
      }
    }
  }
  t.layout.anchor_ids = upload_to(device, at::tensor(anchor_ids, at::kLong));
  t.layout.positions = upload_to(device, models::block_positions(t.layout.anchor, bs));
  t.label_rows = upload_to(device, at::tensor(rows, at::kLong));
  t.labels = upload_to(device, at::tensor(labels, at::kLong));
  t.label_k = upload_to(device, at::tensor(ks, at::kLong));
  t.weights = upload_to(device, at::tensor(weights, at::kFloat));
  t.num_labels = static_cast<int64_t>(rows.size());
  return t;
}

}  // namespace dflash::train
