// The target on CUDA (run on the GPU machine; skipped where there is no GPU): the fp32 path
// must match transformers as tightly as on the CPU, and the bf16 varlen flash-attention path
// within bf16 rounding.
#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::Logits;
using models::PackedBatch;
using models::TargetModel;

class TargetGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_P(TargetGpu, MatchesReferenceInFp32AndBf16) {
  auto dir = testing::fixture("models/" + GetParam());
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto l = ref->tensor("lengths");
  std::vector<int64_t> lengths(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
  auto batch = PackedBatch::from_lengths(lengths, at::kCUDA);
  auto tokens = ref->tensor("tokens").to(at::kCUDA);
  const int64_t last = 2;

  auto fp32 = TargetModel::load(dir, at::kCUDA, at::kFloat);
  auto out = fp32.forward(tokens, batch, {{last}, Logits::kAll});
  EXPECT_CLOSE(out.logits, ref->tensor("logits"), 1e-4);
  EXPECT_CLOSE(out.taps[0], ref->tensor("layer_2"), 1e-4);

  auto bf16 = TargetModel::load(dir, at::kCUDA, at::kBFloat16);
  auto half = bf16.forward(tokens, batch, {{last}, Logits::kAll});
  EXPECT_EQ(half.logits.scalar_type(), at::kBFloat16);
  EXPECT_CLOSE(half.logits, ref->tensor("logits"), 2e-2);
  EXPECT_CLOSE(half.taps[0], ref->tensor("layer_2"), 2e-2);
}

INSTANTIATE_TEST_SUITE_P(Models, TargetGpu,
                         ::testing::Values("qwen3_tied", "qwen3_untied_sharded", "qwen2_untied",
                                           "llama3_scaled_sharded"));

}  // namespace
}  // namespace dflash
