#include "data/random_dataset.h"

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "common/error.h"
#include "common/random.h"
#include "data/dataset.h"

namespace dflash::data {

RandomDatasetSummary write_random_dataset(const RandomDatasetOptions& o) {
  if (o.samples == 0) fail("random data: no samples asked for");
  if (o.vocab == 0 || o.vocab > static_cast<uint64_t>(INT32_MAX) + 1) {
    fail("random data: vocab must be in [1, 2^31], got {}", o.vocab);
  }
  if (o.length_jitter > o.length) {
    fail("random data: length jitter {} exceeds the length {}", o.length_jitter, o.length);
  }
  // Every sample, even the shortest, keeps a supervised token after its prompt.
  if (o.prompt >= o.length - o.length_jitter) {
    fail("random data: prompt {} leaves no supervised token in a sample of {} tokens", o.prompt,
         o.length - o.length_jitter);
  }
  DatasetWriter writer(o.out_dir, o.shard_tokens, o.overwrite);
  RandomDatasetSummary summary;
  uint64_t state = o.seed;
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  for (uint64_t s = 0; s < o.samples; ++s) {
    const uint64_t n = o.length - o.length_jitter + uniform_below(state, 2 * o.length_jitter + 1);
    ids.resize(n);
    for (auto& id : ids) id = static_cast<int32_t>(uniform_below(state, o.vocab));
    mask.assign(n, 1);
    std::fill_n(mask.begin(), o.prompt, uint8_t{0});
    writer.add(ids, mask);
    summary.tokens += n;
    summary.loss_tokens += n - o.prompt;
  }
  summary.shards = writer.finish({{"random",
                                   {{"samples", o.samples},
                                    {"length", o.length},
                                    {"length_jitter", o.length_jitter},
                                    {"prompt", o.prompt},
                                    {"vocab", o.vocab},
                                    {"seed", o.seed}}},
                                  {"totals",
                                   {{"samples", o.samples},
                                    {"tokens", summary.tokens},
                                    {"loss_tokens", summary.loss_tokens}}}});
  return summary;
}

}  // namespace dflash::data
