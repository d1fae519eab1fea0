#include "models/target_head.h"

#include <fmt/ranges.h>

#include "common/error.h"
#include "io/safetensors.h"
#include "models/target.h"

namespace dflash::models {

TargetHead whole_target_head(const TargetModel& target) {
  if (target.tensor_parallel() == nullptr) return TargetHead::of(target);
  TargetHead h;
  h.embedding = target.gather_vocab(target.embedding(), 0);
  h.lm_head = target.config().tie_word_embeddings ? h.embedding
                                                  : target.gather_vocab(target.lm_head_weight(), 0);
  return h;
}

TargetHead load_target_head(const std::filesystem::path& dir, at::Device device,
                            at::ScalarType dtype) {
  const ModelConfig c = load_model_config(dir / "config.json");
  auto ckpt = io::Checkpoint::open(dir);
  const std::string embed = "model.embed_tokens.weight", head = "lm_head.weight";
  std::vector<std::string> names = {embed};
  if (!c.tie_word_embeddings) names.push_back(head);
  for (const auto& name : names) {
    if (!ckpt.contains(name)) fail("{}: tensor {} is missing", dir.string(), name);
    const std::vector<int64_t> shape = {c.vocab_size, c.hidden_size};
    if (ckpt.info(name).shape != shape) {
      fail("{}: tensor {} has shape [{}], config.json implies [{}]", dir.string(), name,
           fmt::join(ckpt.info(name).shape, ", "), fmt::join(shape, ", "));
    }
  }
  auto w = ckpt.load(names, device, dtype);
  TargetHead h;
  h.embedding = w.at(embed);
  h.lm_head = c.tie_word_embeddings ? h.embedding : w.at(head);
  return h;
}

}  // namespace dflash::models
