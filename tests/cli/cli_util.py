"""What the CLI tests share: running a command with the test environment."""
import os
import subprocess
import sys


def run(cmd, env=None, expect="ok", timeout=600):
    """Runs cmd (each item str()-ed) with one OpenMP thread, a 5 s grace for killed ranks and
    no injected stage delay unless env sets one. expect="ok" ends the test with the command's
    output when it fails, "fail" when it succeeds; None returns the result either way."""
    e = dict(os.environ, OMP_NUM_THREADS="1", DFLASH_KILL_GRACE_S="5")
    e.pop("DFLASH_SLOW_STAGE", None)
    e.update(env or {})
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=e,
                       timeout=timeout)
    if expect is not None and (r.returncode != 0) != (expect == "fail"):
        sys.exit(f"{'succeeded' if expect == 'fail' else 'FAILED'} ({r.returncode}): "
                 f"{' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}")
    return r


def write_chats(path, count=8):
    """A tiny chat JSONL (OpenAI messages) of `count` arithmetic questions and answers."""
    import json
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: how many is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}. " * 6}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
