"""A gpt-oss target through the CLI on the CPU with tiny shapes.

Usage: gpt_oss_cli.py DFLASH_BINARY FIXTURES_DIR

`dflash info` on the MXFP4 fixture model (written by tests/python/fixtures_gpt_oss.py) counts
its weights as the config implies and states the experts' MXFP4 memory; `dflash random-model
--preset tiny-gpt-oss` writes the published MXFP4 layout; `dflash train` trains a drafter on
random data against both the fixture and the random model, the latter with tau measured at the
end (--eval-prompts); `generate` (greedy) writes its answers, and `eval` with the trained
drafter decodes past the 16-token window with speculative output equal to the target's greedy
output (eval checks every turn); `bench-target` and `bench-decode` take the preset.
"""
import json
import pathlib
import re
import sys
import tempfile

from cli_util import random_data, random_model, run, train_tiny


def check_info(dflash, model):
    text = run([dflash, "info", model, "--load", "cpu"]).stdout
    assert "architecture: gpt_oss" in text, text
    m = re.search(r"parameters:\s+(\d+) .*the target's forward (\d+)\)", text)
    assert m and m.group(1) == m.group(2), text
    assert re.search(r"mxfp4:\s+the experts' \d+ weights take .* in MXFP4 \(as stored\)", text), text
    assert "sliding-window" in text and "with sinks" in text, text


def train(dflash, target, data, out, extra=()):
    train_tiny(dflash, target, data, out, max_seq_len=64, block_size=4,
               extra=["--target-layer-ids", "0,2", "--mask-token-id", 3, *extra])
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if "loss" in s]
    assert len(losses) == 2 and all(l == l and l > 0 for l in losses), steps
    return steps


def main():
    dflash, fixtures = sys.argv[1], pathlib.Path(sys.argv[2])
    mxfp4 = fixtures / "gpt_oss" / "gpt_oss_mxfp4"
    check_info(dflash, mxfp4)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        target = random_model(dflash, work / "target", preset="tiny-gpt-oss")
        config = json.loads((target / "config.json").read_text())
        assert config["model_type"] == "gpt_oss", config
        assert config["quantization_config"]["quant_method"] == "mxfp4", config
        from safetensors import safe_open
        with safe_open(str(target / "model.safetensors"), "pt") as f:
            names = set(f.keys())
            blocks = f.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks")
            assert blocks.get_dtype() == "U8", blocks.get_dtype()
            assert blocks.get_shape() == [8, 128, 4, 16], blocks.get_shape()
        for name in ["model.layers.0.self_attn.sinks", "model.layers.0.mlp.router.bias",
                     "model.layers.3.mlp.experts.down_proj_scales",
                     "model.layers.3.self_attn.o_proj.bias"]:
            assert name in names, name
        check_info(dflash, target)

        data = work / "data"
        random_data(dflash, data, 300, length=48, prompt=8)
        prompts = work / "prompts.jsonl"
        prompts.write_text('{"question": "What is 3 plus 4?"}\n{"prompt": "Count to five."}\n')
        train(dflash, mxfp4, data, work / "train_fixture")
        steps = train(dflash, target, data, work / "train_random",
                      ["--eval-prompts", prompts, "--eval-max-new-tokens", 24])
        evals = [s for s in steps if "eval_tau" in s]
        assert len(evals) == 1 and evals[0]["eval_mismatches"] == 0, steps
        assert 1 <= evals[0]["eval_tau"] <= 4 and evals[0]["eval_verify_steps"] > 0, evals

        chats = work / "chats.jsonl"
        chats.write_text(json.dumps({"messages": [{"role": "user", "content": "3 plus 4?"},
                                                  {"role": "assistant", "content": "7"}]}) + "\n")
        out = work / "g.jsonl"
        run([dflash, "generate", "--target", target, "--data", chats, "--out", out,
             "--max-new-tokens", 24, "--device", "cpu"])
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 1 and rows[0]["finish"] in (["length"], ["stop"]), rows
        assert rows[0]["messages"][-1]["role"] == "assistant", rows
        r = run([dflash, "eval", "--target", target, "--drafter", work / "train_random",
                 "--prompts", prompts, "--max-new-tokens", 24, "--batch-size", 2,
                 "--device", "cpu", "--json"])
        report = json.loads(r.stdout)
        assert report["mismatches"] == 0, report
        for f in report["files"]:
            assert f["turns"] == 2 and f["verify_steps"] > 0 and f["divergences"] == [], f
            assert 1 <= f["tau"] <= 4, f
            # Past the 16-token window on the generated tokens alone.
            assert f["generated_tokens"] > 2 * 16, f

        text = run([dflash, "bench-target", "--preset", "tiny-gpt-oss", "--device", "cpu",
                    "--seq-len", 48, "--batches", "1,2", "--warmup", 0, "--iters", 1]).stdout
        assert "gpt-oss: experts hold" in text and "B active per token" in text, text
        text = run([dflash, "bench-decode", "--preset", "tiny-gpt-oss", "--device", "cpu",
                    "--prompt-len", 40, "--new-tokens", 4, "--batches", "1,3",
                    "--verify-tokens", 4, "--warmup", 0, "--iters", 1]).stdout
        assert "speculative, batch 1 at 40 cached tokens" in text, text
    print("gpt_oss_cli: OK")


if __name__ == "__main__":
    main()
