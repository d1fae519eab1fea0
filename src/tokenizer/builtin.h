// tokenizer: the project's own tokenizer, embedded at build time from examples/gsm8k
// (tokenizer.json, tokenizer_config.json; examples/gsm8k/make_tokenizer.py made them): a
// Qwen3-style byte-level BPE trained on GSM8K train, the Qwen3 chat tokens and template, and
// DFlash's <|MASK|>. Models this program creates (`dflash pretrain`, `dflash random-model`)
// ship it, cut or padded to their vocabulary, so every command works on them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

namespace dflash::tok {

// Ids the embedded tokenizer has as trained (BPE entries and added tokens).
int64_t builtin_vocab_size();

// The embedded tokenizer.json with exactly `vocab_size` ids (at least 256 byte symbols plus the
// added tokens). Smaller: the first merges only (BPE entry 256 + i is merge i, so any prefix of
// the merges is a tokenizer). Larger: unused "<|pad_ID|>" entries that no text encodes to. The
// added tokens stay together with <|MASK|> last, at id min(vocab_size - 1, 151669): the id
// `dflash train` takes for the mask token by default (Qwen3's).
std::string builtin_tokenizer_json(int64_t vocab_size);

// Writes tokenizer.json (sized as above) and tokenizer_config.json (Qwen3 chat template,
// <|im_end|> as EOS) into `dir`, atomically each.
void write_builtin_tokenizer(const std::filesystem::path& dir, int64_t vocab_size);

}  // namespace dflash::tok
