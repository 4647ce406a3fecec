"""The README path as a new user takes it: the two commands it starts with, and `crucible demo`
run as `make demo` runs it (its own embedded Redis, every service spawned, the real model), for
one of the demo job's four steps in micro-batches of two: every part of the demo runs (evaluate,
train, checkpoint, publish and hot-swap the version, evaluate again with it, the story) in three
quarters of the time of two steps (a step and an evaluation each sample 16 completions of up to
96 tokens: most of the time), and a third of the trainer's peak memory. A generator that served
the base weights under the version's name fails it (the answers after equal those before). That
the demo job is the example spec is tests/unit/test_examples.py's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_starts_with_the_two_commands_and_ci_runs_the_second() -> None:
    readme = (ROOT / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert first_block and readme.index("```bash") < readme.index("## Using it")
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], commands
    ci = [
        line
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    assert ci == ["make test"], ci
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: setup\n\t\$\(BIN\)/crucible demo$", makefile, re.M)


STEPS = 1  # the last step checkpoints whatever checkpoint.every says


@pytest.mark.slow
def test_make_demo_trains_hot_swaps_and_shows_what_changed(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # a laptop: the embedded Redis
    env.update(COLUMNS="200", NO_COLOR="1")
    state = tmp_path / "demo"
    fewer = ["--steps", str(STEPS), "--set", "optim.micro_batch=2"]
    demo = subprocess.Popen(
        [sys.executable, "-m", "crucible_cli", "demo", "--state-dir", str(state), *fewer],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        text, _ = demo.communicate(timeout=840)
    except subprocess.TimeoutExpired:
        demo.terminate()  # SIGTERM: the demo stops the services it started (a kill would orphan them)
        text, _ = demo.communicate(timeout=120)
        pytest.fail(f"the demo did not finish in 840 s:\n{text[-4000:]}")
    assert demo.returncode == 0, text[-4000:]
    assert "finished" in text and "reward per step" in text, text[-4000:]
    assert "the problems it trained on" in text and "MBPP/672" in text and "MBPP/678" in text, text[-4000:]
    (run_dir,) = (state / "jobs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_label" not in r] == list(range(1, STEPS + 1))
    # One adapter version per step, hot-swapped into the generator: the after-evaluation was
    # served by the last one, and its answers are not the base model's.
    events = text.count("hot-swapped into the generator")
    assert events == STEPS, text[-4000:]
    before, after = (
        json.loads((run_dir / "eval" / w / "report.json").read_text()) for w in ("before", "after")
    )
    assert before["model"] == "smollm2-135m-instruct" and after["model"] == f"{run_dir.name}-v{STEPS}"
    answers = lambda report: [s["completion"] for p in report["problems"] for s in p["samples"]]  # noqa: E731
    assert len(answers(after)) == 16 and answers(after) != answers(before)
