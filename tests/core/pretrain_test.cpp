// `dflash pretrain` and the tokenizer that models made here ship with: the trainable target's
// loss and every gradient against transformers (Qwen3, and Qwen3.5's hybrid through the
// differentiable Gated DeltaNet references), bf16 compute landing gradients on fp32 masters,
// the loss falling over a few CPU steps on GSM8K, the written directory loading in transformers
// (AutoModelForCausalLM, AutoTokenizer) with the same logits, ids and chat rendering, and the
// built-in tokenizer at any vocabulary size agreeing with HF tokenizers.
#include "train/pretrain.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <numeric>

#include "common/file.h"
#include "common/json_file.h"
#include "data/chat.h"
#include "io/safetensors.h"
#include "models/target.h"
#include "test_util.h"
#include "tokenizer/builtin.h"

namespace dflash {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using train::LmSample;
using train::LossOn;

fs::path gsm8k(const std::string& split) {
  for (const fs::path& dir : {fs::path("/work/shared/data/gsm8k"),
                              fs::path(DFLASH_SOURCE_DIR) / ".." / "shared" / "data" / "gsm8k"}) {
    if (fs::exists(dir / (split + ".jsonl"))) return dir / (split + ".jsonl");
  }
  return {};
}

// GSM8K lives beside the repository (../shared/data), which CI has; the GPU machine does not.
#define REQUIRE_GSM8K() \
  if (gsm8k("train").empty()) GTEST_SKIP() << "GSM8K not found (../shared/data/gsm8k)"

// gpt-oss' harmony chat template, beside GSM8K (../shared/data/chat_templates).
fs::path harmony_template() {
  return gsm8k("train").parent_path().parent_path() / "chat_templates" /
         "openai-gpt-oss-120b.jinja";
}

// Runs tests/python/pretrain_check.py on `request` and returns its result.
json python_check(const json& request, const fs::path& work) {
  const char* python = std::getenv("DFLASH_PYTHON");
  EXPECT_NE(python, nullptr) << "DFLASH_PYTHON is not set (ctest sets it)";
  if (python == nullptr) return {};
  write_file_atomic(work / "request.json", request.dump());
  const std::string cmd =
      fmt::format("cd '{}/tests/python' && '{}' pretrain_check.py '{}' '{}'", DFLASH_SOURCE_DIR,
                  python, (work / "request.json").string(), (work / "result.json").string());
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  return read_json_file(work / "result.json");
}

std::vector<std::string> gsm8k_texts(size_t n) {
  std::vector<std::string> texts;
  std::istringstream lines(read_file(gsm8k("test")));
  std::string line;
  while (texts.size() < n && std::getline(lines, line)) {
    auto j = json::parse(line);
    texts.push_back(j["question"].get<std::string>() + "\n" + j["answer"].get<std::string>());
  }
  return texts;
}

// The fixture's packed sequences as samples.
std::vector<LmSample> fixture_samples(const io::SafetensorsFile& ref) {
  auto tokens = ref.tensor("tokens"), mask = ref.tensor("mask"), lens = ref.tensor("lengths");
  std::vector<LmSample> samples;
  int64_t start = 0;
  for (int64_t i = 0; i < lens.numel(); ++i) {
    const int64_t n = lens[i].item<int64_t>();
    LmSample s;
    for (int64_t t = start; t < start + n; ++t) {
      s.ids.push_back(static_cast<int32_t>(tokens[t].item<int64_t>()));
      s.mask.push_back(mask[t].item<uint8_t>());
    }
    samples.push_back(std::move(s));
    start += n;
  }
  return samples;
}

// Loss and every gradient of `model` (its weights requiring grad, run through `compute`) on the
// fixture's batch against transformers', within `tol`.
void expect_matches_transformers(const io::SafetensorsFile& ref, const std::string& loss_on,
                                 const models::TargetModel& model,
                                 const models::TargetModel& compute, double tol) {
  const auto batch =
      train::make_lm_batch(fixture_samples(ref), {0, 1, 2},
                           loss_on == "all" ? LossOn::kAll : LossOn::kAssistant, model.device());
  EXPECT_TRUE(batch.targets.cpu().equal(ref.tensor(loss_on + "/targets")));
  auto loss = train::lm_loss_sum(compute, batch);
  const double want = ref.tensor(loss_on + "/loss_sum").item<double>();
  EXPECT_NEAR(loss.item<double>(), want, tol * std::abs(want));
  loss.backward();
  auto grad = [&](const std::string& hf_name) { return ref.tensor(loss_on + "/grad/" + hf_name); };
  const auto& c = model.config();
  EXPECT_CLOSE(model.embedding().grad(), grad("model.embed_tokens.weight"), tol);
  EXPECT_CLOSE(model.final_norm().grad(), grad("model.norm.weight"), tol);
  if (!c.tie_word_embeddings) {
    EXPECT_CLOSE(model.lm_head_weight().grad(), grad("lm_head.weight"), tol);
  }
  for (int64_t i = 0; i < c.num_layers; ++i) {
    SCOPED_TRACE(fmt::format("layer {}", i));
    const auto& l = model.layers()[i];
    const std::string p = c.layer_prefix(i);
    EXPECT_CLOSE(l.input_norm.grad(), grad(p + "input_layernorm.weight"), tol);
    EXPECT_CLOSE(l.post_attention_norm.grad(), grad(p + "post_attention_layernorm.weight"), tol);
    if (c.is_linear_layer(i)) {
      const std::string a = p + "linear_attn.";
      EXPECT_CLOSE(l.linear.w_in.grad(),
                   at::cat({grad(a + "in_proj_qkv.weight"), grad(a + "in_proj_z.weight"),
                            grad(a + "in_proj_b.weight"), grad(a + "in_proj_a.weight")}),
                   tol);
      EXPECT_CLOSE(l.linear.conv.grad(), grad(a + "conv1d.weight").squeeze(1), tol);
      // transformers runs the delta rule in fp32 even in a float64 model, and the decay's two
      // parameters sum every token's and channel's contribution with cancellation: their
      // reference gradients carry fp32 error (measured 1.0e-4 to 2.2e-4 relative).
      const double decay_tol = std::max(tol, 1e-3);
      EXPECT_CLOSE(l.linear.a_log.grad(), grad(a + "A_log"), decay_tol);
      EXPECT_CLOSE(l.linear.dt_bias.grad(), grad(a + "dt_bias"), decay_tol);
      EXPECT_CLOSE(l.linear.norm.grad(), grad(a + "norm.weight"), tol);
      EXPECT_CLOSE(l.linear.w_out.grad(), grad(a + "out_proj.weight"), tol);
    } else {
      EXPECT_CLOSE(
          l.w_qkv.grad(),
          at::cat({grad(p + "self_attn.q_proj.weight"), grad(p + "self_attn.k_proj.weight"),
                   grad(p + "self_attn.v_proj.weight")}),
          tol);
      EXPECT_CLOSE(l.q_norm.grad(), grad(p + "self_attn.q_norm.weight"), tol);
      EXPECT_CLOSE(l.k_norm.grad(), grad(p + "self_attn.k_norm.weight"), tol);
      EXPECT_CLOSE(l.w_o.grad(), grad(p + "self_attn.o_proj.weight"), tol);
    }
    EXPECT_CLOSE(l.w_gate_up.grad(),
                 at::cat({grad(p + "mlp.gate_proj.weight"), grad(p + "mlp.up_proj.weight")}), tol);
    EXPECT_CLOSE(l.w_down.grad(), grad(p + "mlp.down_proj.weight"), tol);
  }
}

// The trainable forward against transformers: summed next-token cross entropy over packed
// sequences (targets from the assistant mask, or all) and the gradient of every weight.
class PretrainGradient : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(PretrainGradient, LossAndGradientsMatchTransformers) {
  const auto& [name, loss_on] = GetParam();
  const auto dir = testing::fixture("pretrain/" + name);
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto model = models::TargetModel::load(dir, at::kCPU, at::kFloat);
  for (auto& p : model.parameters()) p.set_requires_grad(true);
  // The frozen path records nothing even when the weights require grad.
  const auto batch = train::make_lm_batch(fixture_samples(*ref), {0}, LossOn::kAll, at::kCPU);
  EXPECT_FALSE(
      model.forward(batch.tokens, batch.packed, {{}, models::Logits::kAll}).logits.requires_grad());
  expect_matches_transformers(*ref, loss_on, model, model, 1e-4);
}

// On CUDA (skipped without a GPU) as pretrain runs there: a bf16 cast of fp32 masters computes,
// through varlen flash attention and its backward; gradients land on the masters within bf16
// rounding of transformers'.
TEST(PretrainGpu, Bf16GradientsMatchTransformers) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const char* name : {"qwen3_tied", "qwen3_untied", "qwen3_5"}) {
    SCOPED_TRACE(name);
    const auto dir = testing::fixture(std::string("pretrain/") + name);
    auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
    auto master = models::TargetModel::load(dir, at::kCUDA, at::kFloat);
    for (auto& p : master.parameters()) p.set_requires_grad(true);
    expect_matches_transformers(*ref, "assistant", master, master.cast(at::kBFloat16), 3e-2);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, PretrainGradient,
    ::testing::Combine(::testing::Values("qwen3_tied", "qwen3_untied", "qwen3_5"),
                       ::testing::Values("assistant", "all")),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::get<1>(info.param); });

// Mixed precision as pretrain runs it on the GPU, here on the CPU: a bf16 cast of fp32 master
// weights computes, and the gradients land on the masters in fp32, close to the fp32 ones.
TEST(Pretrain, Bf16CastSendsGradientsToFp32Masters) {
  const auto dir = testing::fixture("pretrain/qwen3_untied");
  auto ref = io::SafetensorsFile::open(dir / "reference.safetensors");
  auto tokens = ref->tensor("tokens");
  std::vector<LmSample> samples = {{{}, {}}};
  for (int64_t t = 0; t < tokens.numel(); ++t) {
    samples[0].ids.push_back(static_cast<int32_t>(tokens[t].item<int64_t>()));
    samples[0].mask.push_back(1);
  }
  const auto batch = train::make_lm_batch(samples, {0}, LossOn::kAll, at::kCPU);
  auto master = models::TargetModel::load(dir, at::kCPU, at::kFloat);
  auto params = master.parameters();
  for (auto& p : params) p.set_requires_grad(true);
  train::lm_loss_sum(master, batch).backward();
  std::vector<at::Tensor> fp32_grads;
  for (auto& p : params) {
    fp32_grads.push_back(p.grad().clone());
    p.mutable_grad().zero_();
  }
  auto bf16 = master.cast(at::kBFloat16);
  EXPECT_EQ(bf16.dtype(), at::kBFloat16);
  train::lm_loss_sum(bf16, batch).backward();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(params[i].grad().scalar_type(), at::kFloat);
    EXPECT_CLOSE(params[i].grad(), fp32_grads[i], 5e-2);
  }
  // The fp32 cast is the model itself: no copy on the CPU path.
  EXPECT_TRUE(master.cast(at::kFloat).embedding().is_same(master.embedding()));
}

// A few steps on GSM8K from random weights: the loss falls well below the uniform ln(V), and
// the directory written loads back (the same validation loss) and in transformers with the
// same logits, ids and chat rendering. For each --arch: Qwen3, Qwen3.5's hybrid (a Gated
// DeltaNet layer, then gated attention), and gpt-oss (a sliding layer with a window shorter
// than the chats, then a full one; 4 experts, top 2; the harmony template and tokens).
class PretrainArch : public ::testing::TestWithParam<std::string> {};

TEST_P(PretrainArch, LossFallsAndTransformersLoadsTheModel) {
  REQUIRE_GSM8K();
  const auto work = testing::fresh_temp_dir("pretrain");
  train::PretrainOptions o;
  o.arch = enum_value(train::kPretrainArchNames, GetParam()).value();
  o.full_attention_interval = 2;
  o.linear_head_dim = 16;
  o.data = {gsm8k("train").string()};
  o.eval_data = {gsm8k("test").string()};
  o.out = (work / "model").string();
  o.layers = 2;
  o.hidden = 64;
  o.heads = 4;
  o.kv_heads = 2;
  o.ffn = 128;
  o.steps = 40;
  o.batch_size = 8;
  o.lr = 1e-2;
  o.max_samples = 160;
  o.max_eval_samples = 16;
  o.device = "cpu";
  o.log_seconds = 1e9;
  const bool gpt_oss = o.arch == models::Architecture::kGptOss;
  if (gpt_oss) o.chat_template = harmony_template().string();
  const auto s = train::pretrain(o);
  const double uniform = std::log(static_cast<double>(tok::builtin_vocab_size()));
  EXPECT_LT(s.train_loss, uniform - 2.0) << "uniform " << uniform;
  EXPECT_LT(s.eval_loss, uniform - 2.0);
  EXPECT_EQ(s.steps, 40);

  const fs::path dir = o.out;
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json",
                        "tokenizer_config.json", "pretrain.json"}) {
    EXPECT_TRUE(fs::exists(dir / f)) << f;
  }
  const auto chat = data::detect_chat_config(dir);
  EXPECT_EQ(chat.format, gpt_oss ? data::ChatFormat::kTemplate : data::ChatFormat::kQwen3);
  EXPECT_EQ(chat.harmony, gpt_oss);
  const auto tokenizer = tok::Tokenizer::load(dir);
  if (gpt_oss) {
    for (const auto& t : tok::kHarmonyTokens)
      EXPECT_TRUE(tokenizer.is_special(tokenizer.token_to_id(t))) << t;
    const json config = read_json_file(dir / "config.json");
    EXPECT_EQ(config["eos_token_id"], tokenizer.token_to_id("<|return|>"));
    EXPECT_EQ(config["pad_token_id"], tokenizer.token_to_id("<|endoftext|>"));
  }
  const auto texts = gsm8k_texts(8);
  // Ours: the chat rendering and ids of three GSM8K conversations, and the model's logits.
  json chats = json::array();
  std::vector<int32_t> packed;
  std::vector<int64_t> lengths;
  std::vector<data::RenderedChat> rendered;
  std::vector<std::vector<int32_t>> chat_ids;
  for (int i = 0; i < 3; ++i) {
    const auto& text = texts[i];
    const auto cut = text.find('\n');
    data::Conversation conv{{{data::Role::kUser, text.substr(0, cut), std::nullopt},
                             {data::Role::kAssistant, text.substr(cut + 1), std::nullopt}}};
    chats.push_back({{{"role", "user"}, {"content", conv.messages[0].content}},
                     {{"role", "assistant"}, {"content", conv.messages[1].content}}});
    rendered.push_back(data::render_chat(conv, chat));
    data::TokenizedChat t;
    data::tokenize_chat(tokenizer, rendered.back(), t);
    chat_ids.push_back(t.ids);
    packed.insert(packed.end(), t.ids.begin(), t.ids.end());
    lengths.push_back(static_cast<int64_t>(t.ids.size()));
  }
  auto model = models::TargetModel::load(dir, at::kCPU, at::kFloat);
  {  // The weights written are the ones trained: the validation loss again.
    const auto evals =
        train::load_lm_samples({gsm8k("test")}, tokenizer, chat, o.max_length, o.max_eval_samples);
    std::vector<int64_t> all(evals.size());
    std::iota(all.begin(), all.end(), 0);
    const auto batch = train::make_lm_batch(evals, all, LossOn::kAssistant, at::kCPU);
    EXPECT_NEAR(train::lm_loss_sum(model, batch).item<double>() / batch.counted, s.eval_loss,
                1e-5 * s.eval_loss);
  }
  auto tokens = at::tensor(std::vector<int64_t>(packed.begin(), packed.end()), at::kLong);
  auto ours = model.forward(tokens, models::PackedBatch::from_lengths(lengths, at::kCPU),
                            {{}, models::Logits::kAll});
  const json result = python_check({{"model_dir", dir.string()},
                                    {"tokens", packed},
                                    {"lengths", lengths},
                                    {"logits_out", (work / "logits.safetensors").string()},
                                    {"tokenizer_dirs", {dir.string()}},
                                    {"texts", texts},
                                    {"chats", chats}},
                                   work);
  ASSERT_TRUE(result.contains("chat_texts"));
  EXPECT_CLOSE(ours.logits,
               io::SafetensorsFile::open(work / "logits.safetensors")->tensor("logits"), 1e-4);
  for (size_t i = 0; i < rendered.size(); ++i) {
    EXPECT_EQ(result["chat_texts"][i].get<std::string>(), rendered[i].text) << i;
    EXPECT_EQ(result["chat_ids"][i].get<std::vector<int32_t>>(), chat_ids[i]) << i;
  }
  EXPECT_EQ(model.config().arch, o.arch);
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(result["ids"][dir.string()][i].get<std::vector<int32_t>>(),
              tokenizer.encode(texts[i], false))
        << texts[i];
  }
  remove_tree(work);
}

INSTANTIATE_TEST_SUITE_P(Archs, PretrainArch, ::testing::Values("qwen3", "qwen3_5", "gpt_oss"));

// The built-in tokenizer cut (fewer merges), as trained, and padded: every size loads in HF
// tokenizers with the same ids as ours on GSM8K and on the chat tokens, has exactly the ids
// asked for, and keeps <|MASK|> where `dflash train` looks for it.
TEST(BuiltinTokenizer, AnyVocabularyAgreesWithHfTokenizers) {
  REQUIRE_GSM8K();
  const auto work = testing::fresh_temp_dir("builtin_tokenizer");
  auto texts = gsm8k_texts(300);
  texts.push_back(
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
      "ok<|im_end|>\n<|MASK|><|endoftext|> <|pad_3000|>");
  json dirs = json::array();
  for (int64_t vocab : {262, 512, 2048, 5000}) {
    const auto dir = work / std::to_string(vocab);
    tok::write_builtin_tokenizer(dir, vocab);
    const auto t = tok::Tokenizer::load(dir);
    EXPECT_EQ(static_cast<int64_t>(t.vocab_size()), vocab);
    EXPECT_EQ(t.token_to_id("<|MASK|>"), vocab - 1);
    EXPECT_EQ(t.token_to_id("<|im_end|>"), vocab - 4);
    EXPECT_TRUE(t.is_special(vocab - 1));
    EXPECT_EQ(data::detect_chat_config(dir).format, data::ChatFormat::kQwen3);
    dirs.push_back(dir.string());
  }
  dirs.push_back((fs::path(DFLASH_SOURCE_DIR) / "examples" / "gsm8k").string());
  EXPECT_EQ(tok::builtin_vocab_size(), 2048);
  // Qwen3-8B's vocabulary: the mask at Qwen3's id, padding on both sides of the added tokens.
  {
    const auto dir = work / "qwen3";
    tok::write_builtin_tokenizer(dir, 151936);
    const auto t = tok::Tokenizer::load(dir);
    EXPECT_EQ(t.vocab_size(), 151936u);
    EXPECT_EQ(t.token_to_id("<|MASK|>"), 151669);
    EXPECT_EQ(t.id_to_token(151935), "<|pad_151935|>");
  }
  EXPECT_THROW(tok::builtin_tokenizer_json(261), Error);
  const json result = python_check({{"tokenizer_dirs", dirs}, {"texts", texts}}, work);
  for (const auto& d : dirs) {
    const auto dir = d.get<std::string>();
    const auto t = tok::Tokenizer::load(dir);
    EXPECT_EQ(result["vocab_size"][dir].get<size_t>(), t.vocab_size()) << dir;
    EXPECT_EQ(result["mask_id"][dir].get<int32_t>(), t.token_to_id("<|MASK|>")) << dir;
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(result["ids"][dir][i].get<std::vector<int32_t>>(), t.encode(texts[i], false))
          << dir << ": " << texts[i];
    }
  }
  remove_tree(work);
}

}  // namespace
}  // namespace dflash
