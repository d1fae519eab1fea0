"""Loads model and tokenizer directories written by `dflash` the way users would (transformers'
AutoModelForCausalLM and AutoTokenizer, HF `tokenizers`) and writes what they compute, for the
C++ tests to compare with ours.

usage: pretrain_check.py REQUEST.json RESULT.json

REQUEST: {"model_dir": DIR or null, "tokens": [...], "lengths": [...],   # logits per sequence
          "logits_out": PATH.safetensors,
          "tokenizer_dirs": [DIR...], "texts": [...],                    # ids per dir and text
          "chats": [[{"role", "content"}...]...]}                        # apply_chat_template
RESULT: {"ids": {DIR: [[...]...]}, "vocab_size": {DIR: n}, "mask_id": {DIR: id},
         "chat_texts": [...], "chat_ids": [[...]...]}
"""
import json
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer


def main():
    request = json.load(open(sys.argv[1], encoding="utf-8"))
    result = {"ids": {}, "vocab_size": {}, "mask_id": {}}
    for d in request.get("tokenizer_dirs", []):
        tok = Tokenizer.from_file(f"{d}/tokenizer.json")
        result["ids"][d] = [e.ids for e in tok.encode_batch(request["texts"],
                                                            add_special_tokens=False)]
        result["vocab_size"][d] = tok.get_vocab_size()
        result["mask_id"][d] = tok.token_to_id("<|MASK|>")
    if request.get("model_dir"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        d = request["model_dir"]
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        tokens = torch.tensor(request["tokens"], dtype=torch.int64)
        logits, start = [], 0
        with torch.no_grad():
            for n in request["lengths"]:
                logits.append(model(input_ids=tokens[start:start + n].unsqueeze(0)).logits[0])
                start += n
        save_file({"logits": torch.cat(logits).contiguous()}, request["logits_out"])
        hf = AutoTokenizer.from_pretrained(d)
        chats = request.get("chats", [])
        result["chat_texts"] = [hf.apply_chat_template(c, tokenize=False) for c in chats]
        result["chat_ids"] = [list(hf.apply_chat_template(c, tokenize=True, return_dict=True)
                                   ["input_ids"]) for c in chats]
    json.dump(result, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)


if __name__ == "__main__":
    main()
