"""What the CLI tests share: running a command with the test environment."""
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time


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


def run_case(cases, setup, prefix):
    """The main of a script of cases (`SCRIPT DFLASH_BINARY CASE`): runs cases[CASE] with
    setup(dflash binary, a fresh temporary directory)."""
    dflash = pathlib.Path(sys.argv[1]).resolve()
    case = sys.argv[2]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"dflash_{prefix}_{case}_") as tmp:
        cases[case](setup(dflash, pathlib.Path(tmp)))
    print(f"ok: {case} in {time.monotonic() - t0:.1f} s")


def write_chats(path, count=8):
    """A tiny chat JSONL (OpenAI messages) of `count` arithmetic questions and answers."""
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: how many is {i} + {i}?"},
                          {"role": "assistant", "content": f"It is {2 * i}. " * 6}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
