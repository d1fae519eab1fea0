// The speculative step's bookkeeping kernels (kernels/speculative_step.h) and the rotary
// tables kernel (kernels/rotary.h) against their ATen references: exactly, since they only
// index, compare and compute each table entry with the reference's fp32 operations. The CPU
// cases pin the references themselves to hand-worked values; GPU cases skip without a GPU.
#include "kernels/speculative_step.h"

#include <gtest/gtest.h>

#include "common/error.h"
#include "kernels/rotary.h"

namespace dflash {
namespace {

const at::TensorOptions kLong = at::TensorOptions().dtype(at::kLong);
const at::TensorOptions kInt = at::TensorOptions().dtype(at::kInt);

at::Tensor longs(std::vector<int64_t> v) { return at::tensor(v, kLong); }

kernels::BlockPlacement placement(int64_t n, int64_t bs, bool per_token, at::Device device) {
  auto d = [&](at::TensorOptions o) { return o.device(device); };
  return {at::full({n * bs}, -1, d(kLong)), at::full({n * bs}, -1, d(kLong)),
          at::full({n}, -1, d(kInt)), per_token ? at::full({n * bs}, -1, d(kInt)) : at::Tensor(),
          per_token ? at::full({n * bs}, -1, d(kInt)) : at::Tensor()};
}

TEST(SpeculativeStep, PlaceBlocksOnCpu) {
  const int64_t bs = 3;
  auto starts = longs({5, 0});
  auto offsets = longs({0, 1, 2, 0, 1, 2});
  auto base_rows = longs({0, 0, 0, 100, 100, 100});
  auto out = placement(2, bs, /*per_token=*/true, at::kCPU);
  auto tokens = at::zeros({6}, kLong);
  kernels::place_blocks(starts, offsets, base_rows, out, longs({7, 9}), tokens);
  EXPECT_TRUE(out.positions.equal(longs({5, 6, 7, 0, 1, 2})));
  EXPECT_TRUE(out.rows.equal(longs({5, 6, 7, 100, 101, 102})));
  EXPECT_TRUE(out.seen.equal(at::tensor({8, 3}, kInt)));
  EXPECT_TRUE(out.token_seen.equal(at::tensor({6, 7, 8, 1, 2, 3}, kInt)));
  EXPECT_TRUE(out.block_seen.equal(at::tensor({8, 8, 8, 3, 3, 3}, kInt)));
  EXPECT_TRUE(tokens.equal(longs({7, 0, 0, 9, 0, 0})));
  // Bad shapes are named.
  EXPECT_THROW(kernels::place_blocks(starts, offsets.narrow(0, 0, 5), base_rows, out), Error);
  auto wrong = out;
  wrong.seen = at::zeros({2}, kLong);
  EXPECT_THROW(kernels::place_blocks(starts, offsets, base_rows, wrong), Error);
}

TEST(SpeculativeStep, GreedyVerdictsOnCpu) {
  // Blocks of 4: slot 0 accepts 2 drafts (the third differs), slot 1 none, slot 2 all three.
  auto tokens = longs({10, 11, 12, 13, /**/ 20, 21, 22, 23, /**/ 30, 31, 32, 33});
  auto choices = longs({11, 12, 99, 98, /**/ 97, 22, 23, 96, /**/ 31, 32, 33, 34});
  auto verdicts = kernels::greedy_verdicts(tokens, choices, 4);
  EXPECT_TRUE(verdicts.narrow(0, 0, 12).equal(tokens));
  EXPECT_TRUE(verdicts.narrow(0, 12, 3).equal(longs({2, 0, 3})));
  EXPECT_TRUE(verdicts.narrow(0, 15, 3).equal(longs({99, 97, 34})));
  // The advance: lengths grow by accepted + 1, held at the context; idle slots stay at 0.
  kernels::SlotAdvance advance{at::zeros({3}, kLong), longs({10, 4, 50}), longs({1, 0, 1}), 52};
  kernels::greedy_verdicts(tokens, choices, 4, &advance);
  EXPECT_TRUE(advance.length.equal(longs({13, 0, 52})));
  EXPECT_TRUE(advance.last.equal(longs({99, 0, 34})));
  // Room and stop tokens: slot 0 commits 11, 12, 99 (room 5 -> 2); slot 2 would commit 31, 32,
  // 33, 34 with room 2, out of room at 32; slot 1 is idle. With 12 a stop token slot 0 stops
  // there (12 not kept: room 4).
  for (bool stop_12 : {false, true}) {
    kernels::SlotAdvance walk{at::zeros({3}, kLong), longs({10, 4, 50}),
                              longs({1, 0, 1}),      99,
                              longs({5, 7, 2}),      stop_12 ? longs({12, 500}) : longs({500})};
    kernels::greedy_verdicts(tokens, choices, 4, &walk);
    EXPECT_TRUE(walk.active.equal(longs({stop_12 ? 0 : 1, 0, 0})));
    EXPECT_TRUE(walk.room.equal(longs({stop_12 ? 4 : 2, 7, 0})));
    EXPECT_TRUE(walk.length.equal(longs({stop_12 ? 0 : 13, 0, 0})));
  }
  EXPECT_THROW(kernels::greedy_verdicts(tokens, choices, 5), Error);
  EXPECT_THROW(kernels::greedy_verdicts(tokens, choices.to(at::kInt), 4), Error);
}

TEST(SpeculativeStepGpu, PlaceBlocksMatchesTheReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 37, bs = 16, capacity = 300;
  auto starts = at::randint(0, 280, {n}, kLong);
  auto offsets = at::arange(bs, kLong).repeat({n});
  auto base_rows = (at::arange(n, kLong) * capacity).repeat_interleave(bs);
  auto last = at::randint(0, 1000, {n}, kLong);
  for (bool per_token : {false, true}) {
    for (bool with_last : {false, true}) {
      auto cpu = placement(n, bs, per_token, at::kCPU);
      auto gpu = placement(n, bs, per_token, at::kCUDA);
      auto cpu_tokens = at::full({n * bs}, 5, kLong), gpu_tokens = cpu_tokens.cuda();
      kernels::place_blocks(starts, offsets, base_rows, cpu, with_last ? last : at::Tensor(),
                            with_last ? cpu_tokens : at::Tensor());
      kernels::place_blocks(starts.cuda(), offsets.cuda(), base_rows.cuda(), gpu,
                            with_last ? last.cuda() : at::Tensor(),
                            with_last ? gpu_tokens : at::Tensor());
      EXPECT_TRUE(gpu.positions.cpu().equal(cpu.positions));
      EXPECT_TRUE(gpu.rows.cpu().equal(cpu.rows));
      EXPECT_TRUE(gpu.seen.cpu().equal(cpu.seen));
      if (per_token) {
        EXPECT_TRUE(gpu.token_seen.cpu().equal(cpu.token_seen));
        EXPECT_TRUE(gpu.block_seen.cpu().equal(cpu.block_seen));
      }
      EXPECT_TRUE(gpu_tokens.cpu().equal(cpu_tokens));
    }
  }
}

TEST(SpeculativeStepGpu, GreedyVerdictsMatchTheReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (int64_t bs : {2, 16}) {
    for (int64_t n : {1, 300}) {  // 300 slots: more than the kernel's threads
      // Each block agrees with its choices for a random prefix, then at random.
      auto tokens = at::randint(0, 4, {n, bs}, kLong);
      auto choices = at::randint(0, 4, {n, bs}, kLong);
      auto agree = at::randint(0, bs, {n, 1}, kLong);
      auto mask = at::arange(bs - 1, kLong).unsqueeze(0).lt(agree);
      tokens.narrow(1, 1, bs - 1)
          .copy_(at::where(mask, choices.narrow(1, 0, bs - 1), tokens.narrow(1, 1, bs - 1)));
      tokens = tokens.view(-1);
      choices = choices.view(-1);
      const auto expected = kernels::greedy_verdicts(tokens, choices, bs);
      EXPECT_TRUE(kernels::greedy_verdicts(tokens.cuda(), choices.cuda(), bs).cpu().equal(expected))
          << "B " << bs << ", n " << n;
      auto length = at::randint(0, 100, {n}, kLong);
      auto active = at::randint(0, 2, {n}, kLong);
      kernels::SlotAdvance cpu{at::zeros({n}, kLong), length.clone(), active, 90};
      kernels::SlotAdvance gpu{at::zeros({n}, kLong.device(at::kCUDA)), length.cuda(),
                               active.cuda(), 90};
      kernels::greedy_verdicts(tokens, choices, bs, &cpu);
      kernels::greedy_verdicts(tokens.cuda(), choices.cuda(), bs, &gpu);
      EXPECT_TRUE(gpu.length.cpu().equal(cpu.length));
      EXPECT_TRUE(gpu.last.cpu().equal(cpu.last));
      // With room (0..5 tokens) and stop tokens 1 and 3.
      auto room = at::randint(0, 6, {n}, kLong);
      cpu.room = room.clone();
      cpu.stops = longs({1, 3});
      gpu.room = room.cuda();
      gpu.stops = cpu.stops.cuda();
      kernels::greedy_verdicts(tokens, choices, bs, &cpu);
      kernels::greedy_verdicts(tokens.cuda(), choices.cuda(), bs, &gpu);
      EXPECT_TRUE(gpu.room.cpu().equal(cpu.room));
      EXPECT_TRUE(gpu.active.cpu().equal(cpu.active));
      EXPECT_TRUE(gpu.length.cpu().equal(cpu.length));
    }
  }
}

TEST(SpeculativeStepGpu, RotaryTablesEqualTheAtenReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  // Qwen3's base (theta 1e6, D 128) at positions up to 40k, where fp32 products are large.
  auto inv_freq =
      (1.0 / at::pow(1e6, at::arange(0, 128, 2, at::kFloat) / 128.0)).to(at::kFloat).cuda();
  for (auto index : {at::kLong, at::kInt}) {
    auto positions = at::randint(0, 40000, {333}, at::TensorOptions().dtype(index)).cuda();
    for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      for (double scaling : {1.0, 1.2079}) {
        auto [cos, sin] = kernels::rotary_tables(positions, inv_freq, scaling, dtype);
        auto [ref_cos, ref_sin] =
            kernels::rotary_tables_reference(positions, inv_freq, scaling, dtype);
        EXPECT_TRUE(cos.equal(ref_cos)) << c10::toString(dtype) << " scaling " << scaling;
        EXPECT_TRUE(sin.equal(ref_sin)) << c10::toString(dtype) << " scaling " << scaling;
      }
    }
  }
}

}  // namespace
}  // namespace dflash
