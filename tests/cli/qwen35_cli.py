"""A hybrid (Qwen3.5-shaped) target through the CLI on the CPU with tiny shapes.

Usage: qwen35_cli.py DFLASH_BINARY FIXTURE_MODEL_DIR

FIXTURE_MODEL_DIR is the released-layout tiny Qwen3.5 model transformers wrote for the parity
tests (tests/python/fixtures_qwen35.py: model.language_model.*, a vision tower and an mtp.*
tensor beside it, vocabulary 512). `dflash info` describes it; `random-model --preset
tiny-qwen3.5` writes a text-only directory transformers loads as Qwen3_5ForCausalLM with no
missing or unexpected tensor, and whose tokenizer (vocabulary 512) `prepare` uses; `train` trains
a drafter on the fixture target for two steps (prefill with hidden-state capture); on the
fixture with that tokenizer, `generate` (greedy) writes transformers' greedy `generate` text and
`eval` with the exported drafter reports speculative output == target greedy (the hybrid decode:
conv and recurrent states per slot, cropped to the accepted prefix after each verify);
`bench-target` takes the hybrid presets.
"""
import json
import pathlib
import shutil
import sys
import tempfile

from cli_util import random_model, run, train_tiny, write_chats


def check_transformers_loads(target):
    from transformers import Qwen3_5ForCausalLM
    model, info = Qwen3_5ForCausalLM.from_pretrained(target, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, bad
    config = model.config
    assert config.layer_types.count("full_attention") == 2, config.layer_types
    assert config.rope_parameters["partial_rotary_factor"] == 0.25, config.rope_parameters
    assert config.linear_num_value_heads == 4, config


def transformers_greedy(target, chats, max_new):
    """Each conversation's first assistant turn as transformers' greedy generate writes it (the
    released layout's Qwen3_5ForConditionalGeneration, fp32), ended by the chat's stop tokens."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration
    tok = AutoTokenizer.from_pretrained(target)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    out = []
    for line in chats.read_text().splitlines():
        prompt = tok.apply_chat_template(json.loads(line)["messages"][:1], tokenize=False,
                                         add_generation_prompt=True)
        ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        new = [t for t in gen[0, ids.shape[1]:].tolist() if t not in stops]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


def main():
    dflash, fixture = sys.argv[1], pathlib.Path(sys.argv[2])
    text = run([dflash, "info", fixture]).stdout
    for needle in ["architecture: qwen3_5_text", "released multimodal layout",
                   "linear attention: 3 of 5 layers", "rotary 8 of 32 dims"]:
        assert needle in text, f"{needle!r} missing from:\n{text}"
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        random_target = random_model(dflash, work / "random", preset="tiny-qwen3.5")
        config = json.loads((random_target / "config.json").read_text())
        assert config["model_type"] == "qwen3_5_text", config
        check_transformers_loads(random_target)

        chats = work / "chats.jsonl"
        write_chats(chats)
        data = work / "data"
        run([dflash, "prepare", "--tokenizer", random_target, "--data", chats, "--out", data,
             "--quiet"])
        train = work / "train"
        out = train_tiny(dflash, fixture, data, train, max_seq_len=64)
        assert "mtp.* tensors (multi-token prediction) are not loaded" in out.stderr, out.stderr
        export = work / "export"
        run([dflash, "export", train, export])
        drafter = json.loads((export / "config.json").read_text())
        assert drafter["model_type"] == "qwen3" and "linear_num_key_heads" not in drafter, drafter
        assert drafter["head_dim"] == 32 and "partial_rotary_factor" not in drafter, drafter

        prompts = work / "prompts.jsonl"
        prompts.write_text('{"question": "What is 3 plus 4?"}\n')
        # The fixture with the random model's tokenizer (the fixture has none), for the
        # commands that read one.
        target = work / "target"
        shutil.copytree(fixture, target)
        for f in random_target.iterdir():
            if f.name != "config.json" and not f.name.startswith("model"):
                shutil.copy(f, target / f.name)
        report = json.loads(run([dflash, "eval", "--drafter", export, "--target", target,
                                 "--prompts", prompts, "--max-new-tokens", 12, "--device", "cpu",
                                 "--block-size", 4, "--json"]).stdout)
        assert report["mismatches"] == 0, report
        assert [f["verify_steps"] > 0 and f["divergences"] == [] for f in report["files"]] == [
            True], report
        # Tree verification cannot follow a Gated DeltaNet state: refused before decoding.
        r = run([dflash, "eval", "--drafter", export, "--target", target, "--prompts", prompts,
                 "--device", "cpu", "--tree-budget", 8], expect="fail")
        assert "--tree-budget 8: qwen3_5" in r.stderr and "linear-attention" in r.stderr, r.stderr
        gen = work / "gen.jsonl"
        run([dflash, "generate", "--target", target, "--data", chats, "--out", gen,
             "--max-new-tokens", 12, "--batch-size", 3, "--device", "cpu"])
        got = [json.loads(l)["messages"][1]["content"] for l in gen.read_text().splitlines()]
        want = transformers_greedy(target, chats, 12)
        assert got == want, (got, want)
        assert len(set(want)) > 1 and all(want), want

        text = run([dflash, "bench-target", "--preset", "tiny-qwen3.5-moe", "--device", "cpu",
                    "--seq-len", 64, "--batches", "1,2", "--warmup", 0, "--iters", 1]).stdout
        assert "B active per token" in text, text
    print("qwen35_cli: OK")


if __name__ == "__main__":
    main()
