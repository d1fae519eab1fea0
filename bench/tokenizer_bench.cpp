// Tokenizer and prepare throughput. Usage:
//   tokenizer_bench encode TOKENIZER_DIR TEXTS.jsonl REPEAT THREADS...
//     encodes the "text" field of every line REPEAT times, once per thread count, and prints
//     MB/s (the same measurement tokenizer_bench_hf.py makes for HF tokenizers).
//   tokenizer_bench prepare TOKENIZER_DIR OUT_DIR THREADS INPUT.jsonl...
//     runs prepare_dataset and prints samples/s, MB/s and peak RSS.
// Built and run by bench/run_tokenizer_bench.sh.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/prepare.h"
#include "tokenizer/tokenizer.h"

namespace {

double peak_rss_mb() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss / 1024.0;
}

int encode_bench(int argc, char** argv) {
  auto tok = dflash::tok::Tokenizer::load(argv[2]);
  std::vector<std::string> texts;
  std::ifstream in(argv[3]);
  for (std::string line; std::getline(in, line);) {
    texts.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
  }
  int repeat = std::stoi(argv[4]);
  std::vector<std::string_view> views;
  size_t bytes = 0;
  for (int r = 0; r < repeat; ++r) {
    for (const auto& t : texts) {
      views.push_back(t);
      bytes += t.size();
    }
  }
  tok.encode_batch(std::span(views).subspan(0, std::min<size_t>(views.size(), 2000)), false, 1);
  for (int a = 5; a < argc; ++a) {
    int threads = std::stoi(argv[a]);
    auto t0 = std::chrono::steady_clock::now();
    auto out = tok.encode_batch(views, false, threads);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    size_t tokens = 0;
    for (const auto& o : out) tokens += o.size();
    std::printf("dflash threads=%d: %.2f MB in %.3f s = %.2f MB/s, %.2f M tokens/s\n", threads,
                bytes / 1e6, s, bytes / 1e6 / s, tokens / 1e6 / s);
  }
  return 0;
}

int prepare_bench(int argc, char** argv) {
  dflash::data::PrepareOptions opt;
  opt.tokenizer_dir = argv[2];
  opt.out_dir = argv[3];
  opt.threads = std::stoi(argv[4]);
  opt.overwrite = true;
  if (const char* st = std::getenv("SHARD_TOKENS")) opt.shard_tokens = std::stoull(st);
  for (int a = 5; a < argc; ++a) opt.inputs.emplace_back(argv[a]);
  auto s = dflash::data::prepare_dataset(
      opt, [](const std::string& m) { std::fprintf(stderr, "%s\n", m.c_str()); }, nullptr);
  std::printf(
      "prepare threads=%d: %llu samples, %.1f MB input, %.3f s = %.0f samples/s, %.2f MB/s, "
      "peak RSS %.0f MB\n",
      opt.threads, static_cast<unsigned long long>(s.samples), s.input_bytes / 1e6, s.seconds,
      s.samples / s.seconds, s.input_bytes / 1e6 / s.seconds, peak_rss_mb());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "encode" && argc >= 6) return encode_bench(argc, argv);
  if (mode == "prepare" && argc >= 6) return prepare_bench(argc, argv);
  std::fprintf(stderr, "usage: see the comment at the top of bench/tokenizer_bench.cpp\n");
  return 2;
}
