"""`dflash export` and the serving commands, on the CPU with tiny shapes.

Usage: export_cli.py DFLASH_BINARY

A drafter of block size 8 trained for two steps on a random tiny target (8 layers) exports and
prints the SGLang and vLLM commands for its directory with B = 8 filled in (vLLM's
num_speculative_tokens 7, and the PR 40727 note). A drafter tapping the target's last layer
(7): `dflash train` warns at start; `dflash export` refuses it, naming the layer and the
option, and writes nothing; with --allow-last-layer-tap it exports with a warning.
"""
import json
import pathlib
import sys
import tempfile

from cli_util import random_inputs, run, train_tiny


def train(dflash, target, data, out, taps):
    return train_tiny(dflash, target, data, out, extra=["--target-layer-ids", taps])


def main():
    dflash = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        target, data = random_inputs(dflash, work)
        layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        assert layers == 8, layers

        r = train(dflash, target, data, work / "good", "1,5")
        assert "last decoder layer" not in r.stderr, r.stderr
        out = work / "good_export"
        r = run([dflash, "export", work / "good", out])
        sglang = (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm "
                  f"DFLASH --speculative-draft-model-path {out} --speculative-num-draft-tokens 8")
        vllm = (f"vllm serve {target} --speculative-config '{{\"method\": \"dflash\", "
                f"\"model\": \"{out}\", \"num_speculative_tokens\": 7}}'")
        for needle in [sglang, vllm, "PR 40727"]:
            assert needle in r.stdout, f"{needle!r} missing from:\n{r.stdout}"
        assert "last decoder layer" not in r.stderr, r.stderr

        r = train(dflash, target, data, work / "last", "1,7")
        assert "train: WARNING" in r.stderr and "last decoder layer (7" in r.stderr, r.stderr
        refused = work / "refused"
        r = run([dflash, "export", work / "last", refused], expect="fail")
        for needle in ["last decoder layer (7", "--allow-last-layer-tap", "Refused"]:
            assert needle in r.stderr, f"{needle!r} missing from:\n{r.stderr}"
        assert not (refused / "model.safetensors").exists()
        r = run([dflash, "export", work / "last", work / "allowed", "--allow-last-layer-tap"])
        assert "WARNING (--allow-last-layer-tap)" in r.stderr, r.stderr
        assert (work / "allowed" / "model.safetensors").exists()
        config = json.loads((work / "allowed" / "config.json").read_text())
        assert config["dflash_config"]["target_layer_ids"] == [1, 7], config
    print("export_cli: OK")


if __name__ == "__main__":
    main()
