// train::GradSync: the gradients the backward accumulates into its flat buffer are the same as
// without it, and every gradient bucket is started during the last micro-batch's backward (the
// overlap), in order, with only the figures left for finish().
#include "train/grad_sync.h"

#include <gtest/gtest.h>

#include "dist/comm.h"
#include "drafter_test_util.h"
#include "train/step.h"

namespace dflash {
namespace {

using testing::DflashCase;

TEST(GradSync, BucketsStartDuringTheBackwardAndGradientsAreUnchanged) {
  DflashCase c("tied");
  const auto head = models::TargetHead::of(*c.target);
  train::StepOptions so;
  // Reference: plain .grad accumulation, two micro-batches (the same one twice).
  train::forward_backward(*c.drafter, head, c.input, c.anchors, 1.0, so);
  train::forward_backward(*c.drafter, head, c.input, c.anchors, 1.0, so);
  std::vector<at::Tensor> want;
  for (auto& p : c.drafter->parameters()) want.push_back(p.grad().clone());
  c.zero_grads();

  auto comm = dist::Comm::create(dist::World{}, at::kCPU);  // one rank: reductions are no-ops
  auto params = c.drafter->parameters();
  train::GradSync sync(params, *comm, 5, /*bucket_bytes=*/16 << 10);
  ASSERT_GT(sync.num_buckets(), 10u);
  for (int step = 0; step < 2; ++step) {
    sync.zero();
    train::forward_backward(*c.drafter, head, c.input, c.anchors, 1.0, so);
    sync.arm();
    train::forward_backward(*c.drafter, head, c.input, c.anchors, 1.0, so);
    sync.finish();
    EXPECT_EQ(sync.started_in_backward(), sync.num_buckets() - 1) << step;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(params[i].grad().equal(want[i])) << i;
      // Still a view into the buffer (accumulated in place, not replaced).
      const float* g = params[i].grad().data_ptr<float>();
      const float* flat = sync.grads().data_ptr<float>();
      EXPECT_TRUE(g >= flat && g + params[i].numel() <= flat + sync.grads().numel()) << i;
    }
  }
  // Not armed: nothing starts before finish().
  sync.zero();
  train::forward_backward(*c.drafter, head, c.input, c.anchors, 1.0, so);
  sync.finish();
  EXPECT_EQ(sync.started_in_backward(), 0u);
}

}  // namespace
}  // namespace dflash
