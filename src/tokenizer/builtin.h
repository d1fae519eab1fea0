// tokenizer: the project's own tokenizer, embedded at build time from examples/gsm8k
// (tokenizer.json, tokenizer_config.json; examples/gsm8k/make_tokenizer.py made them): a
// Qwen3-style byte-level BPE trained on GSM8K train, the Qwen3 chat tokens and template, and
// DFlash's <|MASK|>. Models this program creates (`dflash pretrain`, `dflash random-model`)
// ship it, cut or padded to their vocabulary, so every command works on them.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dflash::tok {

// Ids the embedded tokenizer has as trained (BPE entries and added tokens).
int64_t builtin_vocab_size();

// The embedded tokenizer.json with exactly `vocab_size` ids (at least 256 byte symbols plus the
// added tokens). Smaller: the first merges only (BPE entry 256 + i is merge i, so any prefix of
// the merges is a tokenizer). Larger: unused "<|pad_ID|>" entries that no text encodes to. The
// added tokens stay together with <|MASK|> last, at id min(vocab_size - 1, 151669): the id
// `dflash train` takes for the mask token by default (Qwen3's).
// `extra_tokens`: more special tokens, added before <|MASK|> (which stays last).
std::string builtin_tokenizer_json(int64_t vocab_size,
                                   const std::vector<std::string>& extra_tokens = {});

// Writes tokenizer.json (sized as above) and tokenizer_config.json (Qwen3 chat template,
// <|im_end|> as EOS) into `dir`, atomically each.
void write_builtin_tokenizer(const std::filesystem::path& dir, int64_t vocab_size);

// The special tokens of OpenAI's harmony chat format (gpt-oss) that its template writes.
inline const std::vector<std::string> kHarmonyTokens = {
    "<|start|>",     "<|end|>",    "<|message|>", "<|channel|>",
    "<|constrain|>", "<|return|>", "<|call|>"};

// The built-in tokenizer for a gpt-oss-shaped model: every BPE entry, the added tokens and
// harmony's (kHarmonyTokens, before <|MASK|>), builtin_vocab_size() + 7 ids in all; its
// tokenizer_config.json carries `chat_template` (the harmony template's text), with <|return|>
// as EOS (the end of a final answer, gpt-oss' own) and <|endoftext|> as padding.
void write_builtin_harmony_tokenizer(const std::filesystem::path& dir,
                                     const std::string& chat_template);

}  // namespace dflash::tok
