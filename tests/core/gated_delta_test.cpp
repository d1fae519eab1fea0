// kernels/gated_delta_rule and kernels/causal_conv1d: the ATen references against transformers'
// Qwen3.5 functions (fixtures_gated_delta.py: packed sequences of lengths that are not multiples
// of the chunk, Hv = 2 Hk, zero and given initial states, final states, the recurrent form, the
// states after each token), and the CUDA kernels (the chunked form's two variants, tensor cores
// and SIMT, each) against the references at bf16 tolerances (GPU cases skip where there is no
// GPU).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "common/error.h"
#include "io/safetensors.h"
#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "test_util.h"

namespace dflash {
namespace {

using testing::fixture;

std::shared_ptr<io::SafetensorsFile> open_fixture(const std::string& name) {
  return io::SafetensorsFile::open(fixture("gated_delta/" + name + ".safetensors"));
}

std::vector<int64_t> lengths_of(const at::Tensor& t) {
  auto c = t.to(at::kLong).contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

at::Tensor cu_seqlens_of(const std::vector<int64_t>& lengths, at::Device device = at::kCPU) {
  std::vector<int32_t> cu{0};
  for (int64_t len : lengths) cu.push_back(cu.back() + static_cast<int32_t>(len));
  return at::tensor(cu, at::kInt).to(device);
}

at::Tensor maybe(const io::SafetensorsFile& f, const std::string& name) {
  return f.find(name) ? f.tensor(name) : at::Tensor();
}

class GatedDeltaChunk : public ::testing::TestWithParam<std::string> {};

TEST_P(GatedDeltaChunk, MatchesTransformersPerSequence) {
  auto f = open_fixture(GetParam());
  auto lengths = lengths_of(f->tensor("lengths"));
  auto init = maybe(*f, "initial_state");
  auto r = kernels::chunk_gated_delta_rule(f->tensor("q"), f->tensor("k"), f->tensor("v"),
                                           f->tensor("g"), f->tensor("beta"),
                                           cu_seqlens_of(lengths), lengths, init);
  EXPECT_CLOSE(r.out, f->tensor("out"), 1e-5);
  EXPECT_CLOSE(r.final_state, f->tensor("final_state"), 1e-5);
  // transformers' own two forms agree with each other as closely as ours do with them.
  EXPECT_CLOSE(r.out, f->tensor("recurrent_out"), 1e-4);
  EXPECT_CLOSE(r.final_state, f->tensor("recurrent_final_state"), 1e-4);
}

TEST_P(GatedDeltaChunk, RecurrentFormEqualsChunkedForm) {
  auto f = open_fixture(GetParam());
  auto lengths = lengths_of(f->tensor("lengths"));
  auto init = maybe(*f, "initial_state");
  auto q = f->tensor("q"), k = f->tensor("k"), v = f->tensor("v");
  auto g = f->tensor("g"), beta = f->tensor("beta");
  int64_t start = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE(i);
    const int64_t len = lengths[i];
    auto seq = [&](const at::Tensor& t) { return t.narrow(0, start, len).unsqueeze(0); };
    auto state = init.defined() ? init.narrow(0, i, 1).clone()
                                : at::zeros({1, v.size(1), q.size(2), v.size(2)});
    auto states = at::empty({1, len, v.size(1), q.size(2), v.size(2)});
    auto out = kernels::recurrent_gated_delta_rule(seq(q), seq(k), seq(v), seq(g), seq(beta), state,
                                                   states);
    EXPECT_CLOSE(out[0], f->tensor("recurrent_out").narrow(0, start, len), 1e-5);
    EXPECT_CLOSE(out[0], f->tensor("out").narrow(0, start, len), 1e-4);
    EXPECT_CLOSE(states[0][len - 1], f->tensor("final_state")[i], 1e-4);
    start += len;
  }
}

INSTANTIATE_TEST_SUITE_P(States, GatedDeltaChunk, ::testing::Values("chunk_zero", "chunk_initial"));

TEST(GatedDelta, PackedSequencesEqualEachAlone) {
  auto f = open_fixture("chunk_initial");
  auto lengths = lengths_of(f->tensor("lengths"));
  auto q = f->tensor("q"), k = f->tensor("k"), v = f->tensor("v");
  auto g = f->tensor("g"), beta = f->tensor("beta"), init = f->tensor("initial_state");
  auto packed =
      kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens_of(lengths), lengths, init);
  int64_t start = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE(i);
    const int64_t len = lengths[i];
    auto seq = [&](const at::Tensor& t) { return t.narrow(0, start, len); };
    auto alone = kernels::chunk_gated_delta_rule(seq(q), seq(k), seq(v), seq(g), seq(beta),
                                                 cu_seqlens_of({len}), {len},
                                                 init.narrow(0, i, 1).contiguous());
    EXPECT_CLOSE(seq(packed.out), alone.out, 1e-6);
    EXPECT_CLOSE(packed.final_state[i], alone.final_state[0], 1e-6);
    start += len;
  }
}

TEST(GatedDelta, StepMatchesTransformersWithTheStateAfterEachToken) {
  auto f = open_fixture("step");
  auto state = f->tensor("state").clone();
  auto states = at::full(f->tensor("states_out").sizes(), NAN);
  auto out = kernels::recurrent_gated_delta_rule(f->tensor("q"), f->tensor("k"), f->tensor("v"),
                                                 f->tensor("g"), f->tensor("beta"), state, states);
  EXPECT_CLOSE(out, f->tensor("out"), 1e-5);
  EXPECT_CLOSE(states, f->tensor("states_out"), 1e-5);
  EXPECT_TRUE(at::equal(state, f->tensor("state"))) << "the state argument must not change";
  // Without states_out the outputs are the same.
  EXPECT_CLOSE(kernels::recurrent_gated_delta_rule(f->tensor("q"), f->tensor("k"), f->tensor("v"),
                                                   f->tensor("g"), f->tensor("beta"), state),
               f->tensor("out"), 1e-5);
}

void expect_error(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    FAIL() << "expected an error naming " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(GatedDelta, BadInputIsNamed) {
  auto q = at::randn({5, 2, 8}), v = at::randn({5, 3, 8}), g = at::zeros({5, 3});
  auto cu = cu_seqlens_of({5});
  expect_error([&] { kernels::chunk_gated_delta_rule(q, q, v, g, g, cu, {5}); },
               "value heads (3) must be a multiple of key heads (2)");
  v = at::randn({5, 4, 8}), g = at::zeros({5, 4});
  expect_error([&] { kernels::chunk_gated_delta_rule(q, q, v, g, g, cu, {4}); },
               "lengths [4] sum to 4, q has 5 tokens");
  expect_error(
      [&] {
        kernels::chunk_gated_delta_rule(q, q, v, g, g, cu, {5}, at::zeros({1, 4, 8, 7}));
      },
      "initial_state must be float32 [1, 4, 8, 8]");
  expect_error([&] { kernels::chunk_gated_delta_rule(q, q, v, g, g, cu.to(at::kLong), {5}); },
               "cu_seqlens must be int32 [2]");
}

class CausalConvPrefill : public ::testing::TestWithParam<std::string> {};

TEST_P(CausalConvPrefill, MatchesTransformersPerSequence) {
  auto f = open_fixture(GetParam());
  auto lengths = lengths_of(f->tensor("lengths"));
  auto r = kernels::causal_conv1d_silu(f->tensor("x"), f->tensor("weight"), cu_seqlens_of(lengths),
                                       lengths, maybe(*f, "initial_state"));
  EXPECT_CLOSE(r.out, f->tensor("out"), 1e-6);
  EXPECT_CLOSE(r.final_state, f->tensor("final_state"), 0.0);
}

INSTANTIATE_TEST_SUITE_P(States, CausalConvPrefill, ::testing::Values("conv_zero", "conv_initial"));

TEST(CausalConv, StepMatchesTransformersWithTheStateAfterEachToken) {
  auto f = open_fixture("conv_step");
  auto state = f->tensor("state").clone();
  auto states = at::full(f->tensor("states_out").sizes(), NAN);
  auto out = kernels::causal_conv1d_silu_step(f->tensor("x"), f->tensor("weight"), state, states);
  EXPECT_CLOSE(out, f->tensor("out"), 1e-6);
  EXPECT_CLOSE(states, f->tensor("states_out"), 0.0);
  EXPECT_TRUE(at::equal(state, f->tensor("state"))) << "the state argument must not change";
  // The step over S tokens is the prefill of those tokens from the same state.
  const int64_t n = state.size(0), steps = out.size(1);
  std::vector<int64_t> lengths(n, steps);
  auto prefill = kernels::causal_conv1d_silu(f->tensor("x").flatten(0, 1), f->tensor("weight"),
                                             cu_seqlens_of(lengths), lengths, state);
  EXPECT_CLOSE(prefill.out.view(out.sizes()), out, 1e-6);
  EXPECT_CLOSE(prefill.final_state, states.select(1, steps - 1), 0.0);
}

TEST(CausalConv, BadInputIsNamed) {
  auto x = at::randn({5, 6}), w = at::randn({6, 4});
  expect_error(
      [&] {
        kernels::causal_conv1d_silu(x, at::randn({5, 4}), cu_seqlens_of({5}), {5});
      },
      "weight must be floating [6, W]");
  expect_error(
      [&] {
        kernels::causal_conv1d_silu(x, w, cu_seqlens_of({5}), {5}, at::zeros({1, 6, 2}));
      },
      "initial_state must be floating [1, 6, 3]");
  expect_error(
      [&] {
        kernels::causal_conv1d_silu_step(x, w, at::zeros({1, 6, 3}));
      },
      "x must be floating [N, S, C]");
}

// ---- CUDA kernels against the references (same inputs, reference in fp32) ----

struct GdnGpuCase {
  std::string name;
  int64_t hk, hv;
  std::vector<int64_t> lengths;
  bool initial;
  at::ScalarType dtype;
};

void PrintTo(const GdnGpuCase& c, std::ostream* os) { *os << c.name; }

// q, k, v as column slices of one [T, 2 Hk 128 + Hv 128] tensor, as the model splits the conv
// output (rows of a stride wider than the heads); g, beta as Qwen3.5 computes them.
struct GdnInputs {
  at::Tensor q, k, v, g, beta;
};

GdnInputs gdn_inputs(int64_t tokens, int64_t hk, int64_t hv, at::ScalarType dtype,
                     at::Device device) {
  auto opts = at::TensorOptions().device(device);
  auto mixed = at::randn({tokens, (2 * hk + hv) * 128}, opts.dtype(dtype));
  auto rate = at::linspace(0.02, 3.0, hv, opts.dtype(at::kFloat));
  return {mixed.narrow(1, 0, hk * 128).view({tokens, hk, 128}),
          mixed.narrow(1, hk * 128, hk * 128).view({tokens, hk, 128}),
          mixed.narrow(1, 2 * hk * 128, hv * 128).view({tokens, hv, 128}),
          -rate * at::softplus(at::randn({tokens, hv}, opts.dtype(at::kFloat))),
          at::sigmoid(at::randn({tokens, hv}, opts.dtype(at::kFloat)))};
}

int64_t total_of(const std::vector<int64_t>& lengths) {
  int64_t t = 0;
  for (int64_t len : lengths) t += len;
  return t;
}

// Both CUDA variants of the chunked form run every GPU case.
constexpr kernels::ChunkKernel kChunkKernels[] = {kernels::ChunkKernel::kTensorCore,
                                                  kernels::ChunkKernel::kSimt};

std::string kernel_name(kernels::ChunkKernel kernel) {
  return kernel == kernels::ChunkKernel::kTensorCore ? "tc" : "simt";
}

class GatedDeltaGpu
    : public ::testing::TestWithParam<std::tuple<GdnGpuCase, kernels::ChunkKernel>> {};

TEST_P(GatedDeltaGpu, ChunkMatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const auto [c, kernel] = GetParam();
  at::manual_seed(35);
  const int64_t n = static_cast<int64_t>(c.lengths.size());
  auto in = gdn_inputs(total_of(c.lengths), c.hk, c.hv, c.dtype, at::kCUDA);
  at::Tensor init;
  if (c.initial) init = at::randn({n, c.hv, 128, 128}, at::device(at::kCUDA)) * 0.3;
  auto got =
      kernels::chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta,
                                      cu_seqlens_of(c.lengths, at::kCUDA), c.lengths, init, kernel);
  // The reference on the GPU too (fp32 ATen; cuBLAS without TF32 by default).
  auto want = kernels::chunk_gated_delta_rule_reference(
      in.q, in.k, in.v, in.g, in.beta, cu_seqlens_of(c.lengths, at::kCUDA), c.lengths, init);
  ASSERT_EQ(got.out.scalar_type(), c.dtype);
  // Outputs: one rounding to the dtype apart; states: fp32 sums in another order.
  EXPECT_CLOSE(got.out.to(at::kFloat), want.out.to(at::kFloat),
               c.dtype == at::kFloat ? 1e-4 : 8e-3);
  EXPECT_CLOSE(got.final_state, want.final_state, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GatedDeltaGpu,
    ::testing::Combine(
        ::testing::Values(
            GdnGpuCase{"ragged_bf16", 2, 6, {1, 63, 64, 65, 0, 200, 130}, false, at::kBFloat16},
            GdnGpuCase{
                "ragged_initial_bf16", 2, 6, {1, 63, 64, 65, 0, 200, 130}, true, at::kBFloat16},
            GdnGpuCase{"ragged_initial_fp32", 2, 4, {3, 129, 64}, true, at::kFloat},
            GdnGpuCase{"ragged_fp16", 1, 2, {100, 7}, true, at::kHalf},
            // Five value heads per key head: the tensor-core prepare's passes of two heads and a
            // last one of one.
            GdnGpuCase{"group5_fp32", 1, 5, {300}, true, at::kFloat},
            GdnGpuCase{"qwen35_27b_2x1024", 16, 48, {1024, 1024}, false, at::kBFloat16}),
        ::testing::ValuesIn(kChunkKernels)),
    [](const ::testing::TestParamInfo<GatedDeltaGpu::ParamType>& info) {
      return std::get<0>(info.param).name + "_" + kernel_name(std::get<1>(info.param));
    });

// q, k, v rows that start off the 16-byte grid (a view at an odd column of a row of odd width):
// the tensor-core kernels copy rows 16 bytes at a time and take an aligned copy of these.
TEST(GatedDeltaGpu, ChunkTakesMisalignedRows) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(39);
  const int64_t tokens = 150, hk = 1, hv = 2, width = (2 * hk + hv) * 128 + 1;
  const std::vector<int64_t> lengths{70, 80};
  auto mixed = at::randn({tokens, width}, at::device(at::kCUDA).dtype(at::kBFloat16));
  auto q = mixed.narrow(1, 1, hk * 128).view({tokens, hk, 128});
  auto k = mixed.narrow(1, 1 + hk * 128, hk * 128).view({tokens, hk, 128});
  auto v = mixed.narrow(1, 1 + 2 * hk * 128, hv * 128).view({tokens, hv, 128});
  auto g = -at::softplus(at::randn({tokens, hv}, at::device(at::kCUDA)));
  auto beta = at::sigmoid(at::randn({tokens, hv}, at::device(at::kCUDA)));
  auto cu = cu_seqlens_of(lengths, at::kCUDA);
  auto want = kernels::chunk_gated_delta_rule_reference(q, k, v, g, beta, cu, lengths);
  for (auto kernel : kChunkKernels) {
    SCOPED_TRACE(kernel_name(kernel));
    auto got = kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu, lengths, {}, kernel);
    EXPECT_CLOSE(got.out.to(at::kFloat), want.out.to(at::kFloat), 8e-3);
    EXPECT_CLOSE(got.final_state, want.final_state, 1e-4);
  }
}

TEST(GatedDeltaGpu, StepMatchesReferenceWithStatesOut) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(36);
  const int64_t n = 3, steps = 5, hk = 2, hv = 6;
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto in = gdn_inputs(n * steps, hk, hv, dtype, at::kCUDA);
    auto shaped = [&](const at::Tensor& t) {
      auto sizes = t.sizes().vec();
      sizes[0] = steps;
      sizes.insert(sizes.begin(), n);
      return t.reshape(sizes);
    };
    auto q = shaped(in.q), k = shaped(in.k), v = shaped(in.v), g = shaped(in.g),
         beta = shaped(in.beta);
    auto state = at::randn({n, hv, 128, 128}, at::device(at::kCUDA)) * 0.3;
    auto before = state.clone();
    auto states = at::empty({n, steps, hv, 128, 128}, state.options());
    auto want_states = at::empty_like(states);
    auto out = kernels::recurrent_gated_delta_rule(q, k, v, g, beta, state, states);
    auto want = kernels::recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, want_states);
    EXPECT_CLOSE(out.to(at::kFloat), want.to(at::kFloat), dtype == at::kFloat ? 1e-5 : 8e-3);
    EXPECT_CLOSE(states, want_states, 1e-5);
    EXPECT_TRUE(at::equal(state, before)) << "the state argument must not change";
    // The chunked kernels from the same state reach the same final state.
    std::vector<int64_t> lengths(n, steps);
    for (auto kernel : kChunkKernels) {
      SCOPED_TRACE(kernel_name(kernel));
      auto chunk = kernels::chunk_gated_delta_rule(in.q, in.k, in.v, in.g, in.beta,
                                                   cu_seqlens_of(lengths, at::kCUDA), lengths,
                                                   state, kernel);
      EXPECT_CLOSE(chunk.final_state, states.select(1, steps - 1), 1e-4);
      EXPECT_CLOSE(chunk.out.to(at::kFloat).view(out.sizes()), out.to(at::kFloat),
                   dtype == at::kFloat ? 1e-4 : 8e-3);
    }
  }
}

TEST(CausalConvGpu, PrefillMatchesReference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(37);
  const int64_t c = 640;
  // Sequence starts inside 32-token tiles (each channel walked alone) and at a tile's start
  // (the vector walk's window from the initial state); x a column slice of a wider row, as the
  // model hands it over, 16-byte aligned (the vector kernel) or not (one thread a channel).
  for (const std::vector<int64_t>& lengths :
       {std::vector<int64_t>{1, 2, 3, 70, 0, 130, 5}, std::vector<int64_t>{32, 45, 64}}) {
    const int64_t tokens = total_of(lengths), n = static_cast<int64_t>(lengths.size());
    for (int64_t column : {32, 1}) {
      for (auto dtype : {at::kBFloat16, at::kFloat}) {
        for (bool initial : {false, true}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + (initial ? " initial" : " zero") +
                       " column " + std::to_string(column) + ", " + std::to_string(n) +
                       " sequences");
          auto opts = at::device(at::kCUDA).dtype(dtype);
          auto x = at::randn({tokens, c + 64}, opts).narrow(1, column, c);
          auto weight = at::randn({c, 4}, opts) * 0.5;
          at::Tensor init;
          if (initial) init = at::randn({n, c, 3}, opts);
          auto cu = cu_seqlens_of(lengths, at::kCUDA);
          auto got = kernels::causal_conv1d_silu(x, weight, cu, lengths, init);
          auto want = kernels::causal_conv1d_silu_reference(x, weight, cu, lengths, init);
          EXPECT_CLOSE(got.out.to(at::kFloat), want.out.to(at::kFloat),
                       dtype == at::kFloat ? 1e-6 : 8e-3);
          EXPECT_CLOSE(got.final_state.to(at::kFloat), want.final_state.to(at::kFloat), 0.0);
        }
      }
    }
  }
}

TEST(CausalConvGpu, StepMatchesReferenceWithStatesOut) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(38);
  const int64_t n = 3, steps = 4, c = 640;
  for (auto dtype : {at::kBFloat16, at::kFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto opts = at::device(at::kCUDA).dtype(dtype);
    auto x = at::randn({n, steps, c}, opts), weight = at::randn({c, 4}, opts) * 0.5;
    auto state = at::randn({n, c, 3}, opts), before = state.clone();
    auto states = at::empty({n, steps, c, 3}, opts), want_states = at::empty_like(states);
    auto got = kernels::causal_conv1d_silu_step(x, weight, state, states);
    auto want = kernels::causal_conv1d_silu_step_reference(x, weight, state, want_states);
    EXPECT_CLOSE(got.to(at::kFloat), want.to(at::kFloat), dtype == at::kFloat ? 1e-6 : 8e-3);
    EXPECT_CLOSE(states.to(at::kFloat), want_states.to(at::kFloat), 0.0);
    EXPECT_TRUE(at::equal(state, before)) << "the state argument must not change";
  }
}

}  // namespace
}  // namespace dflash
