// Tensor-parallel targets (models/target.h, --target-tp) against one rank, in fp32: T threads,
// each a Gloo rank of its own group over a TCPStore on 127.0.0.1, load their slices of a tiny
// transformers-written Qwen3, Llama and Qwen3 MoE model (tests/python/fixtures_tp.py; a
// vocabulary that no T divides; and the FP8 block-quantised Qwen3 of fixtures_fp8.py) and must
// return the taps of every layer and the logits of the
// whole model, within 1e-5, the Qwen3 MoE also split by experts (--target-ep); with more ranks
// than KV heads (fixtures_models' 2 over 4 ranks) each KV head is replicated on the ranks whose
// query heads read it; splits the heads do not allow are refused, naming the config field and
// T; the hybrids (Qwen3.5 dense and MoE, Qwen3-Next: Gated DeltaNet split by heads, gated
// attention, the shared expert) over 2 ranks, their 2 linear key heads refused over 4; gpt-oss
// (biases, sinks, sliding windows shorter than the sequences; fixtures_tp.py's 12 heads over 2
// and 3 ranks in MXFP4 and in bf16, fixtures_gpt_oss' 2 KV heads replicated over 4), its MXFP4
// experts refused where T does not divide their 32-value groups, and by experts; exact in fp64
// but for rounding; random weights drawn on T ranks are the slices of one rank's. Decoding on a
// split target (forward_cached on each rank's own cache, Generator, SpeculativeDecoder) equals
// one rank's.
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>

#include "common/error.h"
#include "decode_test_util.h"
#include "dist/comm.h"
#include "dist/launch.h"
#include "eval/speculative.h"
#include "fp8_blocks_util.h"
#include "io/safetensors.h"
#include "models/drafter.h"
#include "models/gpt_oss.h"
#include "models/target.h"
#include "test_util.h"

namespace dflash {
namespace {

using models::ForwardRequest;
using models::ForwardResult;
using models::Logits;
using models::PackedBatch;
using models::TargetModel;
using testing::error_of;
using testing::fixture;

// f(comm) on each of `ranks` threads, each with its own Gloo group; the results by rank. A
// rank's exception is rethrown here (the first by rank) after every thread has ended.
template <class F>
auto on_ranks(int ranks, F&& f) {
  std::vector<std::invoke_result_t<F&, dist::Comm&>> results(ranks);
  const int port = dist::free_port();
  std::vector<std::exception_ptr> errors(ranks);
  // No rank tears its group down (rank 0's holds the TCPStore) while another may still be in a
  // collective of it: a CI run crashed (SIGSEGV) once in the 4-rank case without this wait.
  std::barrier finished(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<dist::Comm> comm;
      try {
        dist::World world{r, ranks, r, ranks, "127.0.0.1", port, "test"};
        dist::CommOptions options;
        options.timeout = std::chrono::seconds(60);
        comm = dist::Comm::create(world, at::kCPU, options);
        results[r] = f(*comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
      finished.arrive_and_wait();
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return results;
}

// Max |a - b| within 1e-5 x max(1, max |expected|), and the shapes equal. A split reorders fp32
// sums, whose rounding grows with the values: the fixtures' hidden states stay below 1 (an
// absolute 1e-5) but for gpt-oss', which reach 9 (where one rank itself is 2e-5 from
// transformers; TensorParallelGptOss.ExactInFp64 shows the split exact but for rounding).
void expect_within(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  EXPECT_LE((actual - expected).abs().max().item<double>(), 1e-5 * scale) << what;
}

void expect_same_outputs(const ForwardResult& actual, const ForwardResult& expected,
                         const std::string& what) {
  expect_within(actual.logits, expected.logits, what + ": logits");
  ASSERT_EQ(actual.taps.size(), expected.taps.size());
  for (size_t i = 0; i < actual.taps.size(); ++i) {
    expect_within(actual.taps[i], expected.taps[i], what + ": tap " + std::to_string(i));
  }
}

struct Case {
  std::string model;
  int ranks;
  std::string refused;  // empty: splits; else what the error names
  bool ep = false;      // the sparse layers split by experts
};

// CTest's listing names the case, not its bytes.
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << " over " << c.ranks << (c.ep ? " by experts" : "");
}

class TensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallel, EqualsOneRank) {
  const Case& c = GetParam();
  const auto dir = fixture(c.model);
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto l = ref->tensor("lengths");
  const auto batch = PackedBatch::from_lengths(
      std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel()), at::kCPU);
  const auto tokens = ref->tensor("tokens");
  auto one = TargetModel::load(dir, at::kCPU, at::kFloat);
  const int64_t layers = one.config().num_layers;
  std::vector<int64_t> taps(layers);
  for (int64_t i = 0; i < layers; ++i) taps[i] = i;
  const auto expected = one.forward(tokens, batch, {taps, Logits::kAll});
  // The fixture itself is transformers' model.
  EXPECT_CLOSE(expected.logits, ref->tensor("logits"), 1e-4);
  auto run = [&](dist::Comm& comm) {
    auto model = TargetModel::load(dir, at::kCPU, at::kFloat, &comm, c.ep);
    EXPECT_EQ(model.tp_size(), c.ranks);
    // Each rank holds its slices only: by experts, its whole experts and no other's.
    for (size_t i = 0; i < one.layers().size(); ++i) {
      const auto& mine = model.layers()[i];
      const auto& all = one.layers()[i];
      const bool linear = all.linear.w_in.defined();
      EXPECT_LT((linear ? mine.linear.w_in : mine.w_qkv).size(0),
                (linear ? all.linear.w_in : all.w_qkv).size(0))
          << "layer " << i;
    }
    EXPECT_LT(model.embedding().size(0), one.embedding().size(0));
    if (const auto* split = model.gpt_oss()) {
      for (size_t i = 0; i < split->layers().size(); ++i) {
        const auto& mine = split->layers()[i];
        const auto& all = one.gpt_oss()->layers()[i];
        EXPECT_LT(mine.w_qkv.size(0), all.w_qkv.size(0)) << "layer " << i;
        EXPECT_EQ(mine.sinks.size(0) * c.ranks, all.sinks.size(0)) << "layer " << i;
        // The CPU holds the experts dequantised; the MXFP4 blocks are split too.
        EXPECT_EQ(mine.gate_up.size(1) * c.ranks, all.gate_up.size(1)) << "layer " << i;
        EXPECT_EQ(mine.down.size(2) * c.ranks, all.down.size(2)) << "layer " << i;
        if (all.down_blocks.defined()) {
          EXPECT_EQ(mine.down_blocks.size(2) * c.ranks, all.down_blocks.size(2)) << "layer " << i;
        }
        // o's and down's biases are rank 0's alone, so the group's sum adds them once.
        EXPECT_EQ(mine.b_o.defined(), comm.rank() == 0 && all.b_o.defined()) << "layer " << i;
        if (comm.rank() > 0) {
          EXPECT_TRUE(at::equal(mine.down_bias, at::zeros_like(all.down_bias))) << "layer " << i;
        }
      }
    }
    if (c.ep) {
      const auto mine = models::expert_range(one.config().num_experts, comm.rank(), c.ranks);
      EXPECT_EQ(model.first_expert(), mine.first);
      for (size_t i = 0; i < one.layers().size(); ++i) {
        const auto& all = one.layers()[i].experts_gate_up;
        if (!all.defined()) continue;
        const auto& held = model.layers()[i].experts_gate_up;
        EXPECT_EQ(held.sizes(), all.narrow(0, mine.first, mine.count).sizes()) << "layer " << i;
        EXPECT_TRUE(at::equal(held, all.narrow(0, mine.first, mine.count))) << "layer " << i;
      }
    }
    return model.forward(tokens, batch, {taps, Logits::kAll});
  };
  if (!c.refused.empty()) {
    const std::string e = error_of([&] { on_ranks(c.ranks, run); });
    EXPECT_NE(e.find(c.refused), std::string::npos) << e;
    EXPECT_NE(e.find(fmt::format("--target-tp {}", c.ranks)), std::string::npos) << e;
    return;
  }
  const auto results = on_ranks(c.ranks, run);
  for (int r = 0; r < c.ranks; ++r) {
    expect_same_outputs(results[r], expected, fmt::format("rank {} of {}", r, c.ranks));
  }
  // Logits of each sequence's last token alone, and features without logits (the training
  // prefill, which stops after the last tapped layer).
  const auto last = on_ranks(c.ranks, [&](dist::Comm& comm) {
    auto model = TargetModel::load(dir, at::kCPU, at::kFloat, &comm, c.ep);
    auto out = model.forward(tokens, batch, {{1}, Logits::kLast});
    out.taps.push_back(model.forward(tokens, batch, {{layers - 2}, Logits::kNone}).taps[0]);
    return out;
  });
  const auto one_last = one.forward(tokens, batch, {{1}, Logits::kLast});
  expect_within(last[c.ranks - 1].logits, one_last.logits, "last-token logits");
  expect_within(last[0].taps[1], expected.taps[layers - 2], "features alone");
}

INSTANTIATE_TEST_SUITE_P(
    Targets, TensorParallel,
    ::testing::Values(
        Case{"tp/qwen3_tp", 2, ""}, Case{"tp/qwen3_tp", 3, "num_attention_heads = 8"},
        Case{"tp/qwen3_tp", 4, ""}, Case{"tp/llama_tp", 2, ""}, Case{"tp/llama_tp", 3, ""},
        Case{"tp/llama_tp", 4, ""}, Case{"tp/qwen3_moe_tp", 2, ""}, Case{"tp/qwen3_moe_tp", 3, ""},
        Case{"tp/qwen3_moe_tp", 4, ""},
        // Expert parallel: 6 experts over 2, 3 and 4 ranks (1 or 2 each).
        Case{"tp/qwen3_moe_tp", 2, "", true}, Case{"tp/qwen3_moe_tp", 3, "", true},
        Case{"tp/qwen3_moe_tp", 4, "", true},
        // An FP8 block-quantised checkpoint: each rank dequantises, then slices.
        Case{"fp8/qwen3_fp8", 2, ""},
        // 2 KV heads over 4 ranks, each on 2 (q/k/v biases too in qwen2's).
        Case{"models/qwen3_tied", 4, ""}, Case{"models/qwen2_untied", 4, ""},
        // Hybrids: 2 linear key heads (4 value heads), 2 KV heads.
        Case{"qwen35/qwen3_5_text_tied_sharded", 2, ""}, Case{"qwen35/qwen3_5_multimodal", 2, ""},
        Case{"qwen35/qwen3_5_moe_text", 2, ""}, Case{"qwen35/qwen3_5_moe_text", 2, "", true},
        Case{"qwen35/qwen3_next", 2, ""},
        Case{"qwen35/qwen3_5_text_tied_sharded", 4, "linear_num_key_heads = 2"},
        // gpt-oss: 12 query and 6 KV heads, experts 192 wide (6 MXFP4 groups) over 2 and 3;
        // 2 KV heads over 4 ranks, each on 2; no biases and a tied head; MXFP4 experts of one
        // group refused over 2; and by experts.
        Case{"tp/gpt_oss_tp_mxfp4", 2, ""}, Case{"tp/gpt_oss_tp_mxfp4", 3, ""},
        Case{"tp/gpt_oss_tp_bf16", 2, ""}, Case{"tp/gpt_oss_tp_bf16", 3, ""},
        Case{"gpt_oss/gpt_oss_bf16_sharded", 4, ""}, Case{"gpt_oss/gpt_oss_nobias_tied", 2, ""},
        Case{"gpt_oss/gpt_oss_mxfp4", 2, "intermediate_size / 32 = 32 / 32 = 1 (MXFP4 groups)"},
        Case{"tp/gpt_oss_tp_bf16", 2, "gpt_oss targets are not split by experts", true}),
    [](const ::testing::TestParamInfo<Case>& info) {
      const auto& m = info.param.model;
      return m.substr(m.find('/') + 1) + "_tp" + std::to_string(info.param.ranks) +
             (info.param.ep ? "_ep" : "");
    });

TEST(TensorParallelConfig, RefusesWhatDoesNotSplit) {
  auto c = models::preset_config("tiny-moe");
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 2));
  // tiny's 2 KV heads are replicated over 4 ranks; 3 KV heads neither split over 2 ranks nor
  // divide them.
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 4));
  auto odd = c;
  odd.num_heads = 6;
  odd.num_kv_heads = 3;
  EXPECT_NE(
      error_of([&] { models::check_tensor_parallel(odd, 2); })
          .find("--target-tp 2: config.json's num_key_value_heads = 3 neither is a multiple of "
                "2"),
      std::string::npos);
  c.num_kv_heads = 4;
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 4));
  c.moe_intermediate_size = 30;
  EXPECT_NE(error_of([&] {
              models::check_tensor_parallel(c, 4);
            }).find("moe_intermediate_size = 30 is not a multiple of 4"),
            std::string::npos);
  c = models::preset_config("tiny");
  c.num_kv_heads = 4;
  c.intermediate_size = 250;
  EXPECT_NE(error_of([&] { models::check_tensor_parallel(c, 4); }).find("intermediate_size = 250"),
            std::string::npos);
  // By experts the experts' intermediate need not split, but every rank needs an expert.
  c = models::preset_config("tiny-moe");
  c.num_kv_heads = 4;
  c.moe_intermediate_size = 30;
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 2, /*expert_parallel=*/true));
  c.num_experts = 3;
  EXPECT_NE(error_of([&] {
              models::check_tensor_parallel(c, 4, true);
            }).find("--target-tp 4 --target-ep: config.json's num_experts = 3 leaves some rank"),
            std::string::npos);
  EXPECT_NE(error_of([&] { models::check_tensor_parallel(c, 1, true); }).find("--target-tp 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              models::check_tensor_parallel(models::preset_config("tiny"), 2, true);
            }).find("no sparse (MoE) layers"),
            std::string::npos);
  EXPECT_NO_THROW(models::check_tensor_parallel(models::preset_config("tiny-qwen3.5-moe"), 2));
  EXPECT_NE(error_of([&] {
              models::check_tensor_parallel(models::preset_config("tiny-qwen3.5"), 4);
            }).find("--target-tp 4: config.json's linear_num_key_heads = 2 is not a multiple of 4"),
            std::string::npos);
  c = models::preset_config("tiny-qwen3.5-moe");
  c.shared_expert_intermediate_size = 63;
  EXPECT_NE(error_of([&] {
              models::check_tensor_parallel(c, 2);
            }).find("shared_expert_intermediate_size = 63 is not a multiple of 2"),
            std::string::npos);
  // gpt-oss: MXFP4 experts keep whole 32-value groups of down's inputs on a rank.
  c = models::preset_config("tiny-gpt-oss");  // intermediate_size 64: 2 groups
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 2));
  std::string e = error_of([&] { models::check_tensor_parallel(c, 4); });
  EXPECT_NE(e.find("--target-tp 4: config.json's intermediate_size / 32 = 64 / 32 = 2 (MXFP4 "
                   "groups) is not a multiple of 4"),
            std::string::npos)
      << e;
  e = error_of([&] { models::check_tensor_parallel(c, 2, /*expert_parallel=*/true); });
  EXPECT_NE(e.find("--target-tp 2 --target-ep: gpt_oss targets are not split by experts"),
            std::string::npos)
      << e;
  c.gpt_oss.mxfp4 = false;
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 4));
  c.intermediate_size = c.moe_intermediate_size = 66;
  e = error_of([&] { models::check_tensor_parallel(c, 4); });
  EXPECT_NE(e.find("--target-tp 4: config.json's intermediate_size = 66 is not a multiple of 4"),
            std::string::npos)
      << e;
  // gpt-oss-120b: 64 query heads, 8 KV heads, 90 MXFP4 groups: 2 ranks, not 3 nor 4.
  c = models::preset_config("gpt-oss-120b");
  EXPECT_NO_THROW(models::check_tensor_parallel(c, 2));
  EXPECT_NE(error_of([&] { models::check_tensor_parallel(c, 3); }).find("num_attention_heads = 64"),
            std::string::npos);
  EXPECT_NE(error_of([&] { models::check_tensor_parallel(c, 4); }).find("= 90 (MXFP4 groups)"),
            std::string::npos);
}

// TargetModel::random on 2 ranks keeps the slices of the weights one rank draws (dense and
// sparse layers, the sparse ones by experts too; the hybrids' Gated DeltaNet, gated attention
// and shared expert); on 4, tiny's 2 KV heads replicated (not the hybrids: 2 key heads).
TEST(TensorParallelRandom, SlicesOfOneRanksWeights) {
  for (const char* preset : {"tiny", "tiny-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    const auto config = models::preset_config(preset);
    const auto batch = PackedBatch::from_lengths({7, 5}, at::kCPU);
    const auto tokens = at::randint(config.vocab_size, {12}, at::kLong);
    const ForwardRequest request{{0, 3}, Logits::kAll};
    auto one = TargetModel::random(config, at::kCPU, at::kFloat, 7);
    const auto expected = one.forward(tokens, batch, request);
    for (const bool ep : {false, true}) {
      if (ep && config.num_experts == 0) continue;
      for (const int ranks : {2, 4}) {
        if (config.linear.num_key_heads % ranks != 0) continue;
        const auto results = on_ranks(ranks, [&](dist::Comm& comm) {
          return TargetModel::random(config, at::kCPU, at::kFloat, 7, &comm, ep)
              .forward(tokens, batch, request);
        });
        for (int r = 0; r < ranks; ++r) {
          expect_same_outputs(results[r], expected,
                              fmt::format("{} over {}{}", preset, ranks, ep ? " by experts" : ""));
        }
      }
    }
  }
}

// An FP8 block checkpoint kept in blocks on 2 ranks (q/k/v by heads, gate/up by rows, o and
// down by input columns, the scales sliced with them) runs its fp8 prefill as one rank's
// dequantised model; an FFN of 384 leaves each rank 192 rows of gate/up, not whole blocks:
// those are dequantised at load instead.
TEST(TensorParallelFp8Blocks, EqualsOneRankDequantised) {
  for (const int64_t ffn : {512, 384}) {
    auto c = testing::block_config();
    c.num_kv_heads = 2;
    c.intermediate_size = ffn;
    const auto dir = testing::write_block_checkpoint(c, fmt::format("tp_fp8_blocks_{}", ffn));
    const auto batch = PackedBatch::from_lengths({7, 5}, at::kCPU);
    const auto tokens = at::randint(c.vocab_size, {12}, at::kLong);
    ForwardRequest request{{0, 1, 2}, Logits::kAll};
    const auto expected =
        TargetModel::load(dir, at::kCPU, at::kFloat).forward(tokens, batch, request);
    request.gemms = models::PrefillGemms::kFp8;
    const auto results = on_ranks(2, [&](dist::Comm& comm) {
      auto model = TargetModel::load(dir, at::kCPU, at::kFloat, &comm, false, true);
      const auto& l = model.layers()[0];
      EXPECT_EQ(l.qkv_blocks.data.size(0), 3 * 128);
      EXPECT_EQ(l.o_blocks.data.size(1), 128);
      EXPECT_EQ(l.gate_up_blocks.defined(), ffn == 512);
      if (ffn != 512) return ForwardResult{};
      EXPECT_EQ(l.down_blocks.scale_inv.size(1), 2);
      return model.forward(tokens, batch, request);
    });
    if (ffn != 512) continue;
    for (int r = 0; r < 2; ++r)
      expect_same_outputs(results[r], expected, fmt::format("rank {}", r));
  }
}

// gpt-oss' random weights on T ranks are the slices of one rank's: MXFP4 experts over 2 ranks
// (refused over 4: their 2 groups of 32 inputs do not split), bf16 experts over 2 and 4 (its 2
// KV heads replicated), sequences longer than the 16-token window.
TEST(TensorParallelRandom, GptOssSlicesOfOneRanksWeights) {
  for (const bool mxfp4 : {true, false}) {
    auto config = models::preset_config("tiny-gpt-oss");
    config.gpt_oss.mxfp4 = mxfp4;
    const auto batch = PackedBatch::from_lengths({23, 9}, at::kCPU);
    const auto tokens = at::randint(config.vocab_size, {32}, at::kLong);
    const ForwardRequest request{{0, 3, 6}, Logits::kAll};
    auto one = TargetModel::random(config, at::kCPU, at::kFloat, 7);
    const auto expected = one.forward(tokens, batch, request);
    for (const int ranks : {2, 4}) {
      auto run = [&](dist::Comm& comm) {
        return TargetModel::random(config, at::kCPU, at::kFloat, 7, &comm)
            .forward(tokens, batch, request);
      };
      if (mxfp4 && ranks == 4) {
        const std::string e = error_of([&] { on_ranks(ranks, run); });
        EXPECT_NE(e.find("--target-tp 4: config.json's intermediate_size / 32"), std::string::npos)
            << e;
        continue;
      }
      const auto results = on_ranks(ranks, run);
      for (int r = 0; r < ranks; ++r) {
        expect_same_outputs(
            results[r], expected,
            fmt::format("gpt-oss ({}) rank {} of {}", mxfp4 ? "MXFP4" : "bf16", r, ranks));
      }
    }
  }
}

// The gpt-oss splits are exact but for rounding: in fp64 every split equals one rank within 1e-12
// (with autograd on, so that the router-weighted sum runs in ATen in fp64, not in
// kernels::moe_combine's fp32 reference). bf16-layout fixtures: fp64 MXFP4 dequantisation is not
// built.
TEST(TensorParallelGptOss, ExactInFp64) {
  const std::pair<const char*, int> cases[] = {{"tp/gpt_oss_tp_bf16", 2},
                                               {"tp/gpt_oss_tp_bf16", 3},
                                               {"gpt_oss/gpt_oss_bf16_sharded", 4},
                                               {"gpt_oss/gpt_oss_nobias_tied", 2}};
  for (const auto& [model, ranks] : cases) {
    const auto dir = fixture(model);
    auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
    auto l = ref->tensor("lengths");
    const auto batch = PackedBatch::from_lengths(
        std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel()), at::kCPU);
    const auto tokens = ref->tensor("tokens");
    ForwardRequest request{{0, 1, 2, 3}, Logits::kAll};
    request.grad = true;
    const auto expected =
        TargetModel::load(dir, at::kCPU, at::kDouble).forward(tokens, batch, request);
    const auto results = on_ranks(ranks, [&](dist::Comm& comm) {
      return TargetModel::load(dir, at::kCPU, at::kDouble, &comm).forward(tokens, batch, request);
    });
    for (int r = 0; r < ranks; ++r) {
      const std::string what = fmt::format("{} rank {} of {}", model, r, ranks);
      EXPECT_LE((results[r].logits - expected.logits).abs().max().item<double>(), 1e-12) << what;
      for (size_t i = 0; i < expected.taps.size(); ++i) {
        EXPECT_LE((results[r].taps[i] - expected.taps[i]).abs().max().item<double>(), 1e-12)
            << what << ": tap " << i;
      }
    }
  }
}

// The passes of a decode on `model`'s own cache (TargetModel::make_cache) of 2 slots: a prefill
// of 7 and 5 tokens, 3 decode steps, a verify block of 3 on both slots kept for a crop (a
// hybrid's per-token linear states), slot 0 cropped back 2 tokens and slot 1 committing the
// block, then one more step; every pass's logits concatenated, the taps of layers 0 and last of
// every pass in order. The same 26 tokens on every rank.
ForwardResult cached_passes(const TargetModel& model, const at::Tensor& tokens) {
  auto cache = model.make_cache(2, 32);
  cache.keep_block_states(3);
  const std::vector<int64_t> taps = {0, model.config().num_layers - 1};
  ForwardResult all;
  std::vector<at::Tensor> logits;
  int64_t used = 0;
  auto pass = [&](const std::vector<int64_t>& counts, bool keep) {
    const auto batch = models::AppendBatch::make(cache, {0, 1}, counts);
    ForwardRequest request{taps, Logits::kAll};
    request.keep_block_states = keep;
    auto out = model.forward_cached(tokens.narrow(0, used, batch.total), batch, cache, request);
    used += batch.total;
    logits.push_back(out.logits);
    for (auto& t : out.taps) all.taps.push_back(t);
  };
  pass({7, 5}, false);
  for (int i = 0; i < 3; ++i) pass({1, 1}, false);
  pass({3, 3}, true);
  cache.crop(0, cache.length(0) - 2);
  cache.crop(1, cache.length(1));
  pass({1, 1}, false);
  EXPECT_EQ(used, tokens.size(0));
  all.logits = at::cat(logits);
  return all;
}

// forward_cached on a split target (each rank's cache holding its KV heads, replicated over 4
// ranks where 2 KV heads are fewer, and a hybrid's share of its linear-attention heads and
// states) equals one rank's within 1e-5: prefill, decode steps, a verify block, a crop; dense,
// MoE (by experts too), the Qwen3.5 hybrids, gpt-oss (sinks, a 5-position window), and
// checkpoints (q/k/v biases; Qwen3-Next).
TEST(TensorParallelDecode, CachedForwardEqualsOneRank) {
  struct Target {
    std::string name;
    std::function<TargetModel(dist::Comm*, bool)> make;
    std::vector<int> ranks;
    bool ep = false;
  };
  std::vector<Target> targets;
  for (const char* preset : {"tiny", "tiny-moe", "tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    const auto config = models::preset_config(preset);
    const bool four = config.linear.num_key_heads % 4 == 0;
    targets.push_back({preset,
                       [config](dist::Comm* comm, bool ep) {
                         return TargetModel::random(config, at::kCPU, at::kFloat, 7, comm, ep);
                       },
                       four ? std::vector<int>{2, 4} : std::vector<int>{2},
                       config.num_experts > 0});
  }
  auto gpt_oss = testing::tiny_target_config(models::Architecture::kGptOss);
  targets.push_back({"gpt-oss",
                     [gpt_oss](dist::Comm* comm, bool) {
                       return TargetModel::random(gpt_oss, at::kCPU, at::kFloat, 7, comm);
                     },
                     {2}});
  const std::pair<const char*, std::vector<int>> checkpoints[] = {
      {"tp/qwen3_tp", {2, 4}}, {"models/qwen2_untied", {2, 4}}, {"qwen35/qwen3_next", {2}}};
  for (const auto& [model, ranks] : checkpoints) {
    const auto dir = fixture(model);
    targets.push_back({model,
                       [dir](dist::Comm* comm, bool) {
                         return TargetModel::load(dir, at::kCPU, at::kFloat, comm);
                       },
                       ranks});
  }
  for (const auto& t : targets) {
    const auto one = t.make(nullptr, false);
    const auto tokens = at::randint(one.config().vocab_size, {26}, at::kLong);
    const auto expected = cached_passes(one, tokens);
    for (const bool ep : {false, true}) {
      if (ep && !t.ep) continue;
      for (const int ranks : t.ranks) {
        const auto results = on_ranks(
            ranks, [&](dist::Comm& comm) { return cached_passes(t.make(&comm, ep), tokens); });
        for (int r = 0; r < ranks; ++r) {
          expect_same_outputs(
              results[r], expected,
              fmt::format("{} rank {} of {}{}", t.name, r, ranks, ep ? " by experts" : ""));
        }
      }
    }
  }
}

// A cache of the whole model's heads does not fit a rank of a split one: refused, naming
// TargetModel::make_cache.
TEST(TensorParallelDecode, WholeModelCacheRefused) {
  const auto config = models::preset_config("tiny");
  const std::string e = error_of([&] {
    on_ranks(2, [&](dist::Comm& comm) {
      auto model = TargetModel::random(config, at::kCPU, at::kFloat, 7, &comm);
      models::KVCache cache(config, 1, 16, at::kCPU, at::kFloat);
      const auto batch = models::AppendBatch::make(cache, {0}, {4});
      return model.forward_cached(at::zeros({4}, at::kLong), batch, cache, {{0}, Logits::kLast});
    });
  });
  EXPECT_NE(e.find("1 KV heads x"), std::string::npos) << e;
  EXPECT_NE(e.find("TargetModel::make_cache"), std::string::npos) << e;
}

// Generator and SpeculativeDecoder (the DFlash drafter, random weights) on a split target, every
// rank of the group in lockstep, decode exactly one rank's greedy tokens: 4 prompts through 2
// slots (refills), on a peaked target (testing::peaked_target: no near-ties for a reordered sum
// to flip); over 4 ranks with tiny's 2 KV heads replicated; a hybrid and gpt-oss (MXFP4
// experts) over 2.
TEST(TensorParallelDecode, GreedyEqualsOneRank) {
  for (const char* preset : {"tiny", "tiny-moe", "tiny-qwen3.5", "tiny-gpt-oss"}) {
    const auto config = models::preset_config(preset);
    auto splits = [&](int ranks) {
      return error_of([&] { models::check_tensor_parallel(config, ranks); }) == "no error";
    };
    auto peaked = [&](dist::Comm* comm) {
      auto model = TargetModel::random(config, at::kCPU, at::kFloat, 7, comm);
      model.final_norm().mul_(30.0);
      return model;
    };
    const auto prompts = testing::random_prompts(config.vocab_size, {5, 9, 3, 7}, 11);
    eval::GenerationOptions g;
    g.max_new_tokens = 12;
    g.slots = 2;
    g.context = 32;
    eval::SpeculativeOptions s;
    s.max_new_tokens = g.max_new_tokens;
    s.slots = g.slots;
    s.context = g.context;
    models::DrafterOptions o;
    o.num_layers = 1;
    o.block_size = 4;
    o.mask_token_id = config.vocab_size - 1;
    const auto drafter =
        models::Drafter::random(models::make_drafter_config(config, o), at::kCPU, 9);
    auto decode = [&](const TargetModel& model) {
      std::vector<std::vector<int64_t>> out;
      for (auto& c : eval::Generator(model, g).generate(prompts)) out.push_back(c.tokens);
      eval::DFlashDraftSource source(drafter, model);
      for (auto& c : eval::SpeculativeDecoder(model, source, s).generate(prompts)) {
        out.push_back(c.tokens);
      }
      return out;
    };
    const auto want = decode(peaked(nullptr));
    // The speculative decoder's output is the target's greedy output.
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(want[i], want[prompts.size() + i]);
    for (const int ranks : {2, 4}) {
      if (!splits(ranks)) continue;
      const auto results = on_ranks(ranks, [&](dist::Comm& comm) { return decode(peaked(&comm)); });
      for (int r = 0; r < ranks; ++r) {
        EXPECT_EQ(results[r], want) << preset << " rank " << r << " of " << ranks;
      }
    }
  }
}

}  // namespace
}  // namespace dflash
