"""`dflash train --eval-prompts` on the CPU with tiny shapes: tau by real speculative decoding
during training.

Usage: train_eval.py DFLASH_BINARY [DEVICE]   (DEVICE: cpu, the default, or cuda: fp32 too, one
rank, only the comparison with `dflash eval`; training on the GPU is not bitwise repeatable)

A random tiny target with its tokenizer (seed 0: its greedy answers repeat one token, so a
drafter learns them within a few steps and tau moves from 1 to the block's limit), trained on
its own answers (`dflash generate`, `dflash prepare`). One rank, evaluated every 2 of 6 steps
on the first 4 prompts of a 5-prompt file:
  - metrics.jsonl holds each step once, and eval_tau (with the histogram, mismatches, seconds
    and speeds) on steps 2, 4 and 6 only;
  - each of them equals `dflash eval` of that step's checkpoint with the same prompts and
    options (CPU, fp32: the same counts, so the same tau);
  - the run without evaluation has the same losses, accuracies and grad norms, and the same
    final checkpoint to the byte (evaluation perturbs neither the weights nor any RNG stream).
Two ranks (Gloo), evaluated every 4 of 6 steps (so at 4 and at the end), prompts split over
the ranks: the summed counts equal `dflash eval` of those checkpoints.
A run with the LM head's input gradient in FP8 (`--head-grad fp8`) has the first step's loss of
the compute dtype and trains on; one with the layers' GEMMs in FP8 (`--drafter-gemms fp8`) a
first loss within 5% of it, and trains on. --eval-every without --eval-prompts, and --eval-prompts on a
disaggregated topology, fail with a message saying why.
"""
import json
import pathlib
import sys
import tempfile

from cli_util import random_model, run

STEPS = 6
LIMIT = 4
NEW_TOKENS = 24
# In fp32 on the GPU too: in bf16 this tiny random target's drafter committed one token on all
# 115 verify steps of every evaluation (at lr 5e-5 and at 1e-3), so the check that tau moved
# had nothing to see. The bf16 path is what the GSM8K run trains and evaluates in.
DTYPE = ["--dtype", "fp32"]


def metrics(run_dir):
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [l["step"] for l in lines]
    assert steps == list(range(1, STEPS + 1)), f"{run_dir}: steps logged {steps}"
    return lines


def main():
    dflash = sys.argv[1]
    device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        target = random_model(dflash, work / "target", seed=0)
        chat = work / "chat.jsonl"
        chat.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": f"What is {i} plus {i + 3}?"},
            {"role": "assistant", "content": "regenerated"}]}) + "\n" for i in range(16)))
        answers, data = work / "answers.jsonl", work / "data"
        run([dflash, "generate", "--target", target, "--data", chat, "--out", answers,
             "--max-new-tokens", 40, "--enable-thinking", "false", "--device", "cpu"])
        run([dflash, "prepare", "--tokenizer", target, "--data", answers, "--out", data])
        prompts = work / "heldout.jsonl"
        prompts.write_text("".join(json.dumps(row) + "\n" for row in [
            {"question": "What is 20 plus 23?"}, {"prompt": "What is 21 plus 24?"},
            {"turns": ["What is 22 plus 25?", "What is 23 plus 26?"]},
            {"question": "What is 24 plus 27?"}, {"question": "Beyond the limit: never asked."}]))
        train = ["train", "--target", target, "--data", data, "--steps", STEPS,
                 "--batch-size", 2, "--max-seq-len", 64, "--drafter-layers", 2,
                 "--block-size", 8, "--max-anchors", 16, "--lr", "5e-5", "--log-seconds", 0,
                 "--device", device, "--keep-last", STEPS, *DTYPE]
        evaluation = ["--eval-prompts", prompts, "--eval-limit", LIMIT,
                      "--eval-max-new-tokens", NEW_TOKENS]

        def same_as_dflash_eval(run_dir, step, line):
            # train's --eval-enable-thinking is off by default; dflash eval's is on.
            r = run([dflash, "eval", "--json", "--target", target, "--drafter",
                     run_dir / f"step-{step:08d}", "--prompts", prompts, "--limit", LIMIT,
                     "--max-new-tokens", NEW_TOKENS, "--enable-thinking", "false",
                     "--device", device, *DTYPE])
            f = json.loads(r.stdout)["files"][0]
            got = {k: line[f"eval_{k}"] for k in
                   ("tau", "committed_histogram", "verify_steps", "generated_tokens",
                    "prompts", "turns", "mismatches")}
            want = {k: f[k] for k in got}
            assert got == want, f"{run_dir} step {step}: train's eval {got} != dflash eval {want}"
            assert line["eval_seconds"] > 0 and line["eval_speculative_tokens_per_s"] > 0
            assert line["eval_target_tokens_per_s"] > 0 and line["eval_speedup"] > 0
            return f["committed_histogram"]

        # One rank, every 2 steps; and the same run without evaluation.
        with_eval, without = work / "with_eval", work / "without"
        r = run([dflash, *train, "--out", with_eval, "--checkpoint-every", 2, *evaluation,
                 "--eval-every", 2])
        assert "eval at step 2: tau" in r.stderr and "eval tau" in r.stderr, r.stderr
        a = metrics(with_eval)
        assert [l["step"] for l in a if "eval_tau" in l] == [2, 4, 6], a
        histograms = [same_as_dflash_eval(with_eval, s, a[s - 1]) for s in (2, 4, 6)]
        assert all(l["eval_prompts"] == LIMIT and l["eval_turns"] == LIMIT + 1
                   for l in a if "eval_tau" in l), a
        print("train_eval: tau " + ", ".join(f"{l['eval_tau']:.3f} at step {l['step']}"
                                             for l in a if "eval_tau" in l))
        # The drafter changed between the evaluations, and tau with it: a check that read
        # stale or other weights would fail. That needs a drafter that learned something in 6
        # steps, which depends on the random target's greedy answers, and those depend on the
        # CPU that generated them (floating-point ties): on the development machines the
        # drafter's first-token accuracy reaches 0.8 by step 6; on the H200 machine (its CPU
        # and its GPU alike) it stays 0, and so tau stays 1 at every evaluation.
        learned = any(x > 0 for l in a for x in l["accuracy"])
        if learned:
            assert len({str(h) for h in histograms}) > 1, (histograms, [
                (l["step"], l["loss"], l["accuracy"]) for l in a])
        else:
            print("train_eval: the drafter learned nothing in 6 steps on this machine's data: "
                  "tau could not move (the check of it is skipped)")
        # RUN/best: the export of the drafter at the highest tau (the first step reaching it).
        taus = [(l["eval_tau"], -l["step"]) for l in a if "eval_tau" in l]
        best_tau, best_step = max(taus)
        best = json.loads((with_eval / "best.json").read_text())
        assert best == {"step": -best_step, "tau": best_tau}, (best, taus)
        config = json.loads((with_eval / "best" / "config.json").read_text())
        assert config["dflash_config"]["mask_token"], config
        r = run([dflash, "eval", "--json", "--target", target, "--drafter", with_eval / "best",
                 "--prompts", prompts, "--limit", LIMIT, "--max-new-tokens", NEW_TOKENS,
                 "--device", device, *DTYPE])
        assert json.loads(r.stdout)["files"][0]["mismatches"] == 0, r.stdout
        assert not (with_eval / "best.tmp").exists() and not (with_eval / "best.old").exists()
        if device != "cpu":
            print("train_eval: OK")
            return
        r = run([dflash, *train, "--out", without, "--checkpoint-every", 2])
        assert "LM-head input gradient: compute (--head-grad auto)" in r.stdout, r.stdout
        b_out = r.stdout
        b = metrics(without)
        for x, y in zip(a, b):
            for key in ("loss", "accuracy", "grad_norm", "acceptance", "lr", "tokens"):
                assert x[key] == y[key], f"step {x['step']}: {key} {x[key]} != {y[key]}"
            assert not any(k.startswith("eval_") for k in y), y
        final = f"step-{STEPS:08d}/state.safetensors"
        assert (with_eval / final).read_bytes() == (without / final).read_bytes(), \
            "the final checkpoint differs with evaluation"

        # The LM head's input gradient through FP8 (on the CPU its dequantizing reference): the
        # first step's loss and accuracies are those of the compute dtype exactly (only the
        # gradient changes), its gradient norm near them, and the run trains on.
        fp8 = work / "fp8"
        run([dflash, *train, "--out", fp8, "--checkpoint-every", 2, "--head-grad", "fp8"])
        f = metrics(fp8)
        assert json.loads((fp8 / "run_config.json").read_text())["head_grad"] == "fp8"
        assert json.loads((without / "run_config.json").read_text())["head_grad"] == "compute"
        assert f[0]["loss"] == b[0]["loss"] and f[0]["accuracy"] == b[0]["accuracy"], (f[0], b[0])
        assert f[0]["grad_norm"] != b[0]["grad_norm"], "the fp8 run computed the same gradient"
        assert abs(f[0]["grad_norm"] / b[0]["grad_norm"] - 1) < 0.2, (f[0], b[0])
        assert abs(f[-1]["loss"] / b[-1]["loss"] - 1) < 0.05, (f[-1], b[-1])
        print(f"train_eval: fp8 head gradient: step 1 grad norm {f[0]['grad_norm']:.6g} against "
              f"{b[0]['grad_norm']:.6g}, last loss {f[-1]['loss']:.6g} against {b[-1]['loss']:.6g}")

        # The drafter layers' projections as FP8 GEMMs too (the dequantizing reference on the
        # CPU): the forward itself is quantized, so the first loss moves, a little; it trains on.
        gemms = work / "fp8_gemms"
        r = run([dflash, *train, "--out", gemms, "--checkpoint-every", 2, "--drafter-gemms",
                 "fp8"])
        assert "drafter layer GEMMs: fp8" in r.stdout, r.stdout
        g = metrics(gemms)
        assert json.loads((gemms / "run_config.json").read_text())["drafter_gemms"] == "fp8"
        # The default, auto, is compute on the CPU (fp8 only where the FP8 GEMM runs).
        assert json.loads((without / "run_config.json").read_text())["drafter_gemms"] == "compute"
        assert "drafter layer GEMMs" not in b_out, b_out
        assert g[0]["loss"] != b[0]["loss"], "the fp8 GEMMs computed the same forward"
        assert abs(g[0]["loss"] / b[0]["loss"] - 1) < 0.05, (g[0], b[0])
        assert abs(g[0]["grad_norm"] / b[0]["grad_norm"] - 1) < 0.2, (g[0], b[0])
        assert abs(g[-1]["loss"] / b[-1]["loss"] - 1) < 0.05, (g[-1], b[-1])
        print(f"train_eval: fp8 GEMMs: step 1 loss {g[0]['loss']:.6g} against {b[0]['loss']:.6g}, "
              f"last loss {g[-1]['loss']:.6g} against {b[-1]['loss']:.6g}")
        # Resumed with other layer GEMMs: allowed (not part of the data stream), and said.
        r = run([dflash, *train, "--out", gemms, "--resume", "--drafter-gemms", "compute"])
        assert 'note: drafter_gemms is "compute" (the run had "fp8")' in r.stdout, r.stdout
        r = run([dflash, *train, "--out", work / "bad0", "--drafter-gemms", "fp16"], expect=None)
        assert r.returncode != 0 and "drafter_gemms must be auto, compute or fp8" in r.stderr, r.stderr
        # The prefill's GEMM setting is recorded; a bad name fails before anything loads.
        assert json.loads((without / "run_config.json").read_text())["prefill_gemms"] == "tuned"
        r = run([dflash, *train, "--out", work / "bad1", "--prefill-gemms", "cublas"], expect=None)
        assert r.returncode != 0 and "prefill_gemms must be aten, tuned or fp8" in r.stderr, r.stderr
        # The target's projections in FP8 (the dequantizing reference on the CPU): the features
        # move by e4m3's rounding, so the first loss moves a little; it trains on.
        prefill8 = work / "fp8_prefill"
        r = run([dflash, *train, "--out", prefill8, "--prefill-gemms", "fp8"])
        assert "--prefill-gemms fp8: target layers 0-" in r.stdout, r.stdout
        assert "projections freed" in r.stdout, r.stdout  # no evaluation in this run
        p8 = metrics(prefill8)
        assert p8[0]["loss"] != b[0]["loss"], "the fp8 prefill computed the same features"
        assert abs(p8[0]["loss"] / b[0]["loss"] - 1) < 0.05, (p8[0], b[0])
        assert abs(p8[-1]["loss"] / b[-1]["loss"] - 1) < 0.05, (p8[-1], b[-1])
        print(f"train_eval: fp8 prefill: step 1 loss {p8[0]['loss']:.6g} against "
              f"{b[0]['loss']:.6g}, last loss {p8[-1]['loss']:.6g} against {b[-1]['loss']:.6g}")

        # Two ranks, every 4 steps (so at 4 and at the end): the prompts are split over ranks.
        two = work / "two_ranks"
        run([dflash, *train, "--out", two, "--checkpoint-every", 2, *evaluation,
             "--eval-every", 4, "--nproc-per-node", 2])
        c = metrics(two)
        assert [l["step"] for l in c if "eval_tau" in l] == [4, 6], c
        for s in (4, 6):
            same_as_dflash_eval(two, s, c[s - 1])

        r = run([dflash, *train, "--out", work / "bad1", "--eval-every", 2], expect=None)
        assert r.returncode != 0 and "--eval-every needs --eval-prompts" in r.stderr, r.stderr
        r = run([dflash, *train, "--out", work / "bad2", *evaluation, "--nproc-per-node", 2,
                 "--topology", "disaggregated", "--target-ranks", 1], expect=None)
        assert r.returncode != 0 and "needs --topology colocated" in r.stderr, r.stderr
    print("train_eval: OK")


if __name__ == "__main__":
    main()
