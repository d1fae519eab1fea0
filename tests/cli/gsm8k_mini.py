"""The end-to-end GSM8K run in miniature (examples/gsm8k/run.sh --mini): a target trained by
`dflash pretrain` on GSM8K, its greedy answers, a drafter trained on them, and speculative
decoding on held-out GSM8K test questions. Asserts tau >= 1.5 and speculative output ==
target greedy output on every question (eval itself fails on a mismatch), and that train
logged tau on held-out questions during training (--eval-every).

With the qwen3 target, bench/zlab_peer_decode.py (the Python decoder `dflash eval` is compared
with on the GPU) decodes the first held-out questions too: its tau must equal eval's and its
output its own plain loop's.

With TARGET_ARCH gpt_oss (harmony chats) the exported drafter is also loaded the way z-lab's
DFlashDraftModel loads it (transformers' Qwen3Config of its config.json, Qwen3's rotary
embedding: the YaRN scaling it inherits from gpt-oss), run by the independent reference
(tests/python/dflash_reference.py) on the target as transformers' GptOssForCausalLM loads it,
fp32: speculative steps replayed in the target's greedy answers to held-out questions must
commit >= 1.5 tokens on average (a mis-read export commits ~1).

Usage: gsm8k_mini.py DFLASH_BINARY [TARGET_ARCH]   (GSM8K from ../shared/data/gsm8k, as run.sh
finds it; TARGET_ARCH qwen3 (default), qwen3_5 (the hybrid) or gpt_oss: run.sh --target)
"""
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def reference_steps(out, questions=8, anchors=4, stride=8):
    """Tokens a speculative step commits (accepted + 1) at `anchors` points of the answers to
    the first held-out questions (the answer body's first token, then every `stride`), with the
    export run by the reference as z-lab's code reads it (module docstring): the target's
    greedy continuation is the committed text, its features before the anchor the context."""
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    import dflash_reference as ref

    cfg, params = ref.load_export(out / "export")
    rotary = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(out / "export"))

    def rope_tables(positions, head_dim, theta, dtype):
        cos, sin = rotary(torch.zeros(1, dtype=dtype), positions[None])
        return cos[0], sin[0]

    ref.rope_tables = rope_tables
    params = {k: v.float() for k, v in params.items()}
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    assert type(target).__name__ == "GptOssForCausalLM", type(target)
    tok = AutoTokenizer.from_pretrained(out / "target")
    message = tok.convert_tokens_to_ids("<|message|>")
    B, taps = cfg["block_size"], cfg["dflash_config"]["target_layer_ids"]
    committed = []
    lines = (out / "heldout.jsonl").read_text().splitlines()[:questions]
    with torch.no_grad():
        for line in lines:
            chat = [{"role": "user", "content": json.loads(line)["question"]}]
            prompt = list(tok.apply_chat_template(chat, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
            # The drafter learned answer bodies (harmony's header tokens are not supervised).
            greedy = target.generate(torch.tensor([prompt]), max_new_tokens=anchors * stride + B,
                                     do_sample=False)[0].tolist()
            body = greedy.index(message, len(prompt)) + 1
            points = [a for a in range(body, body + anchors * stride, stride)
                      if a + B <= len(greedy)]
            tokens = torch.tensor(greedy)
            feats = ref.target_features(target, tokens, taps)
            hidden = ref.drafter_sequence(params, cfg, feats, tokens, points,
                                          target.model.embed_tokens.weight)
            draft = target.lm_head(hidden).argmax(-1).view(len(points), B).tolist()
            for a, row in zip(points, draft):
                accepted = 0  # row k predicts the token at a + k
                while accepted < B - 1 and row[accepted + 1] == greedy[a + accepted + 1]:
                    accepted += 1
                committed.append(accepted + 1)
    return committed


def peer_matches_eval(out, dflash, prompts=6):
    """bench/zlab_peer_decode.py (z-lab's decoding loop over transformers, the export read as
    engines read it) and `dflash eval` on the same first questions, fp32: the peer's output must
    equal its own plain loop's, and both must commit alike (tau within 0.05; measured equal)."""
    args = ["--prompts", str(out / "heldout.jsonl"), "--max-new-tokens", "160"]
    ours = subprocess.run([dflash, "eval", "--json", "--target", str(out / "target"), "--drafter",
                           str(out / "drafter" / "best"), "--limit", str(prompts),
                           "--enable-thinking", "false", "--device", "cpu", "--batch-size", "1",
                           *args], capture_output=True, text=True, check=True)
    tau = json.loads(ours.stdout)["files"][0]["tau"]
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "peer.json"
        subprocess.run([sys.executable, str(ROOT / "bench" / "zlab_peer_decode.py"), "--target",
                        str(out / "target"), "--export", str(out / "export"), "--limit",
                        str(prompts), "--device", "cpu", "--dtype", "fp32", "--json", str(report),
                        *args], check=True)
        peer = json.loads(report.read_text())
    print(f"z-lab-style peer on {prompts} questions: tau {peer['tau']:.4f} against eval's {tau:.4f}")
    if peer["answers_differing"] != 0:
        sys.exit(f"FAILED: the peer's speculative output differs on {peer['answers_differing']}")
    if abs(peer["tau"] - tau) > 0.05:
        sys.exit(f"FAILED: the peer's tau {peer['tau']:.4f} against eval's {tau:.4f}")


def main():
    arch = sys.argv[2] if len(sys.argv) > 2 else "qwen3"
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp) / "gsm8k-mini"
        r = subprocess.run(["bash", str(ROOT / "examples" / "gsm8k" / "run.sh"), "--mini",
                            "--target", arch, "--dflash", sys.argv[1], "--out", str(out)])
        if r.returncode != 0:
            sys.exit(f"FAILED: run.sh --mini exited {r.returncode}")
        summary = json.loads((out / "summary.json").read_text())
        want_type = {"qwen3": "qwen3", "qwen3_5": "qwen3_5_text", "gpt_oss": "gpt_oss"}[arch]
        if summary["target_arch"] != want_type:
            sys.exit(f"FAILED: the target is {summary['target_arch']}, not {want_type}")
        f = summary["eval"]["files"][0]
        print(f"tau {f['tau']:.3f} on {f['prompts']} held-out questions, {f['mismatches']} "
              f"mismatches, total {summary['total_seconds']:.0f} s")
        if f["mismatches"] != 0 or summary["eval"]["mismatches"] != 0:
            sys.exit("FAILED: speculative output differs from the target's greedy output")
        if f["tau"] < 1.5:
            sys.exit(f"FAILED: tau {f['tau']:.3f} < 1.5")
        # train --eval-every 50 over 150 steps (gpt_oss: every 32 over 64): tau on held-out
        # questions at each.
        want_steps = ["32", "64"] if arch == "gpt_oss" else ["100", "150", "50"]
        if sorted(summary["train_eval_tau"]) != want_steps:
            sys.exit(f"FAILED: tau during training logged at {summary['train_eval_tau']}")
        if arch == "qwen3":
            peer_matches_eval(out, sys.argv[1])
        if arch == "gpt_oss":
            # generate keeps the final channel's body: no harmony header left in an answer.
            answers = [json.loads(line)["messages"][-1]["content"]
                       for line in (out / "answers.jsonl").read_text().splitlines()]
            headed = [a for a in answers if "<|" in a or a.startswith("final")]
            if headed:
                sys.exit(f"FAILED: {len(headed)} regenerated answers keep harmony's header: "
                         f"{headed[0][:80]!r}")
            committed = reference_steps(out)
            mean = sum(committed) / len(committed)
            print(f"export through z-lab's loading path: steps commit {committed} "
                  f"(mean {mean:.2f})")
            if mean < 1.5:
                sys.exit(f"FAILED: the export, read as z-lab's code reads it, commits {mean:.2f}")


if __name__ == "__main__":
    main()
