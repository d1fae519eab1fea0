"""A Qwen3 MoE target through the whole CLI on the CPU with tiny shapes.

Usage: moe_cli.py DFLASH_BINARY [DEVICE]   (DEVICE: cpu, the default, or cuda)

`dflash random-model --preset tiny-moe` writes a directory transformers loads as a
Qwen3MoeForCausalLM with no missing or unexpected tensor (the published per-expert layout);
`prepare` tokenizes chat data with its tokenizer, `train` trains a dense drafter on it for two
steps, `export` writes the drafter, and `eval` with the export and with the run directory
reproduces the target's greedy output (on the CPU, in fp32; on a GPU, in bf16 with the decode
step in a CUDA graph, ties may diverge); `bench-target` and `bench-drafter` take the preset.
"""
import json
import pathlib
import sys
import tempfile

from cli_util import random_model, run, train_tiny, write_chats


def check_transformers_loads(target):
    from transformers import Qwen3MoeForCausalLM
    model, info = Qwen3MoeForCausalLM.from_pretrained(target, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v}
    assert not bad, bad
    config = model.config
    assert config.num_experts == 8 and config.num_experts_per_tok == 2, config
    assert config.mlp_only_layers == [0] and config.norm_topk_prob, config


def main():
    dflash = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        target = random_model(dflash, work / "target", preset="tiny-moe")
        config = json.loads((target / "config.json").read_text())
        assert config["model_type"] == "qwen3_moe", config
        assert config["architectures"] == ["Qwen3MoeForCausalLM"], config
        check_transformers_loads(target)

        chats = work / "chats.jsonl"
        write_chats(chats)
        data = work / "data"
        run([dflash, "prepare", "--tokenizer", target, "--data", chats, "--out", data, "--quiet"])
        train = work / "train"
        train_tiny(dflash, target, data, train, device, max_seq_len=64)
        export = work / "export"
        run([dflash, "export", train, export])
        drafter = json.loads((export / "config.json").read_text())
        assert drafter["model_type"] == "qwen3" and "num_experts" not in drafter, drafter
        assert drafter["intermediate_size"] == config["intermediate_size"], drafter

        prompts = work / "prompts.jsonl"
        prompts.write_text('{"question": "What is 3 plus 4?"}\n{"prompt": "Count to five."}\n')
        for d in [export, train]:
            text = run([dflash, "eval", "--drafter", d, "--target", target, "--prompts", prompts,
                        "--max-new-tokens", 16, "--device", device]).stdout
            needles = ["tau", "committed per step"]
            if device == "cpu":
                needles.append("speculative output == target greedy output")
            for needle in needles:
                assert needle in text, f"{needle!r} missing from:\n{text}"

        text = run([dflash, "bench-target", "--preset", "tiny-moe", "--device", device,
                    "--seq-len", 64, "--batches", "1,2", "--warmup", 1, "--iters", 1]).stdout
        assert "B active per token" in text, text
        run([dflash, "bench-drafter", "--preset", "tiny-moe", "--device", device, "--seq-len", 64,
             "--anchors", 4, "--layers", 2, "--warmup", 1, "--iters", 1])
    print("moe_cli: OK")


if __name__ == "__main__":
    main()
