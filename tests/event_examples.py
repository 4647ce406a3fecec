"""One example of every job event type (`crucible_shared.events`) and a phrase its CLI line must
hold, for the tests that send each through the emitters, the gateway's stream and the CLI."""

from __future__ import annotations

from typing import Any

# (type, fields, a phrase of the CLI's line; None: the progress bar shows it, no line)
EXAMPLES: list[tuple[str, dict[str, Any], str | None]] = [
    ("status", {"status": "starting"}, "status     starting"),
    ("status", {"status": "failed", "error": "boom"}, "failed: boom"),
    (
        "status",
        {"status": "finished", "summary": {"job_id": "j", "run_dir": "runs/j", "steps": 3}},
        "finished",
    ),
    ("notice", {"message": "no comparison: run the `baseline` stage"}, "no comparison"),
    (
        "settings",
        {
            "device": "cpu",
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "micro_batch": 16,
            "gradient_checkpointing": False,
        },
        "micro-batch 16",
    ),
    (
        "settings",
        {
            "device": "cuda:0",
            "dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "micro_batch": 32,
            "gradient_checkpointing": "auto",
        },
        "gradient checkpointing per micro-batch",
    ),
    ("metrics", {"step": 2, "metrics": {"reward_mean": 0.5, "pass_rate": 0.25}}, None),
    ("eval_started", {"label": "before", "model": "base", "tasks": 4, "data": "mbpp/test"}, "on 4 tasks"),
    (
        "eval_finished",
        {
            "label": "after",
            "report": "runs/x/eval/after",
            "dataset": "mbpp",
            "greedy_pass@1": 0.5,
            "pass@2": 0.75,
            "problems": 4,
            "problems_passed": 2,
            "mean_generated_tokens": 80.0,
        },
        "pass@1 50.0% · pass@2 75.0% (sampled) on 4 MBPP tasks",
    ),
    (  # an evaluation whose greedy answers include hard-coded ones says how many
        "eval_finished",
        {
            "label": "after",
            "report": "r",
            "dataset": "mbpp",
            "greedy_pass@1": 0.5,
            "problems": 4,
            "hard_coded_answers": 3,
        },
        "on 4 MBPP tasks, 3 ignore their input",
    ),
    ("adapter_published", {"step": 1, "name": "job-v1", "load_s": 0.5}, "in 0.50 s (job-v1)"),
    ("difficulty_filter", {"kept": 3, "of": 8}, "kept 3 of 8"),
    ("resumed", {"step": 4, "checkpoint": "runs/x/checkpoints/step-000004"}, "checkpoint of step 4"),
    ("checkpoint", {"step": 10, "path": "runs/x/trainer/checkpoint-10"}, "step 10 saved"),
    (
        "stale_policy",
        {"version": 3, "name": "job-v3", "diff": 0.2, "tolerance": 0.05},
        "0.200 per token for version 3",
    ),
    (
        "sample",
        {
            "step": 1,
            "problem_id": "MBPP/601",
            "phase": "c1",
            "reward": 1.0,
            "status": "passed",
            "message": "",
            "completion": "def f():\n    return 1",
        },
        "step 1 MBPP/601 (c1): reward 1.00, passed",
    ),
    (
        "stage",
        {"stage": "round-1/build", "status": "finished", "seconds": 0.2, "nbest": 12, "pairs": 30},
        "round-1/build finished in 0.2 s: nbest 12, pairs 30",
    ),
    ("stage_progress", {"stage": "round-1/annotate", "done": 5, "total": 10}, None),
    ("requeued", {"reason": "the worker was lost", "attempt": 2}, "the worker was lost; attempt 2"),
    ("requeued", {"reason": "the worker stopped"}, "the worker stopped (no attempt used)"),
]
# `raw` is the gateway's reading of a stream entry that is not JSON; no emitter writes it.
EMITTED_TYPES = {kind for kind, _, _ in EXAMPLES}
