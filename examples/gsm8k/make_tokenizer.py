"""Generates the GSM8K example's tokenizer (tokenizer.json, tokenizer_config.json beside this file).

Run once; its output is committed, and `dflash` embeds it (`dflash pretrain` uses it as is,
`dflash random-model` cuts or pads it to the model's vocabulary). A byte-level BPE configured
like Qwen3's (NFC, Qwen's pre-tokenizer split, ByteLevel), trained with HF `tokenizers` on the
GSM8K *train* questions and answers only, 2042 BPE entries (the 256 byte symbols, then one entry
per merge in merge order, which is what lets a prefix of the merges make a smaller tokenizer)
followed by the Qwen3 chat tokens and DFlash's mask token, 2048 ids in all. The chat template
is Qwen3's official one, so `dflash` and transformers render chats identically.

usage: .venv/bin/python examples/gsm8k/make_tokenizer.py [--data /work/shared/data/gsm8k]
"""
import argparse
import json
import pathlib
import sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests" / "python"))
from fixtures_tokenizer import QWEN_PATTERN, QWEN3_TEMPLATE  # noqa: E402  (Qwen3's, verbatim)

VOCAB = 2048
# (text, special): Qwen3 marks <think> and </think> as added but not special; <|MASK|> is the
# token DFlash drafters fill their blocks with, last so that it is `dflash train`'s default.
ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
         ("<think>", False), ("</think>", False), ("<|MASK|>", True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=pathlib.Path, default=pathlib.Path("/work/shared/data/gsm8k"))
    ap.add_argument("--out", type=pathlib.Path, default=HERE)
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.data / "train.jsonl", encoding="utf-8")]
    texts = [r["question"] for r in rows] + [r["answer"] for r in rows]
    texts += ["user\n", "assistant\n", "system\n"]  # the chat template's role headers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(ADDED), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    for text, special in ADDED:
        tok.add_tokens([AddedToken(text, normalized=False, special=special)])
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()

    model = json.loads(tok.to_str())["model"]
    for i, merge in enumerate(model["merges"]):  # merge i made entry 256 + i
        assert model["vocab"]["".join(merge)] == 256 + i, merge

    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": QWEN3_TEMPLATE,
              "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "add_bos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096}
    (args.out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {args.out}/tokenizer.json ({VOCAB} ids) and tokenizer_config.json")


if __name__ == "__main__":
    main()
