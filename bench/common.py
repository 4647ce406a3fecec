"""What the benchmarks share: a free port, percentiles, the name of the card they ran on, the
offline training recipes, the learning recipes (recipes/learning.yaml), a job spec from a file plus
`--set` overrides, the services a job needs (a sandbox and generators, spawned), and running a job
in-process through the worker's own entry point (`crucible_trainer.runtime.entry.execute`, what `crucible
train --local` runs), timed, with its per-step metrics.

Benchmarks import it as `bench.common` (the repository root on `sys.path`, as each script puts it)
or as `common` when run as `python bench/<script>.py` beside it.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "learning.yaml"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank.

    >>> percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5), percentile([5.0, 1.0, 3.0], 0.99)
    (3.0, 5.0)
    """
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def card() -> str:
    """The first visible GPU's name, else `cpu` (also without torch installed)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


# The offline training recipes (`bench/offline_figures.py`; `bench/grpo_race.py --sft-first` trains
# its SFT stage with the first).
TRAIN = {
    # SFT on the distinct passing candidates (shortest first), a few epochs: the set is small.
    "sft": {
        "train": {"name": "sft", "epochs": 3, "max_length": 1024},
        "optim": {"lr": 1e-4, "micro_batch": 8, "warmup_steps": 5},
    },
    # DPO on pass/fail pairs, the base model as reference.
    "dpo": {
        "train": {"name": "dpo", "beta": 0.1, "epochs": 2, "max_length": 1024},
        "optim": {"lr": 5e-5, "micro_batch": 8, "warmup_steps": 5},
    },
}


def recipes(path: Path = RECIPES) -> dict[str, dict[str, Any]]:
    """The named recipes of `path`, each resolved: its job spec file (`spec`, from the repository
    root), every `set` override from the recipe it builds on (`from`) down to its own, `about`,
    `sft_first` and `humaneval` (inherited unless it says otherwise)."""
    import yaml

    table = yaml.safe_load(path.read_text())

    def resolve(name: str, seen: tuple[str, ...] = ()) -> dict[str, Any]:
        if name in seen or name not in table:
            raise SystemExit(
                f"{path}: recipe {name!r} " + ("builds on itself" if name in seen else "is not defined")
            )
        entry = table[name]
        unknown = set(entry) - {"about", "spec", "from", "set", "sft_first", "humaneval"}
        if unknown or ("spec" in entry) == ("from" in entry):
            raise SystemExit(f"{path}: recipe {name!r} needs one of spec/from, and no {sorted(unknown)}")
        out = resolve(entry["from"], (*seen, name)) if "from" in entry else {"set": []}
        out.update({k: v for k, v in entry.items() if k not in ("from", "set")})
        out["set"] = [*out["set"], *entry.get("set", [])]
        return out

    return {name: resolve(name) for name in table}


def load_job(source: Path | dict[str, Any], overrides: list[str] | None = None) -> Any:
    """The job spec in `source` (a YAML or JSON file, or the spec itself) with `--set` overrides
    applied in order, validated by the spec models (`crucible_cli.specs`: the same overrides as
    every `crucible` command); exits with the bad fields named."""
    import typer
    import yaml
    from crucible_cli.specs import apply_overrides, validation_lines
    from crucible_shared.jobs import JobSpec
    from pydantic import TypeAdapter, ValidationError

    try:
        raw = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
        raw = apply_overrides(raw, overrides)
        return TypeAdapter(JobSpec).validate_python(raw)
    except typer.BadParameter as exc:
        raise SystemExit(f"--set {exc.message}") from None
    except ValidationError as exc:
        lines = validation_lines(exc, overrides)
        where = "the job" if isinstance(source, dict) else source
        raise SystemExit(f"{where}: invalid job spec:\n" + "\n".join(f"  {line}" for line in lines)) from None


def spawn_generator(
    work: Path,
    model: str,
    rows: int | str,
    *,
    max_loras: int = 4,
    env: dict[str, str] | None = None,
    log: str = "generator.log",
    timeout: float = 600,
) -> Any:
    """A Crucible generator for a benchmark's job: `rows` at once, quiet, loading the adapters the
    job publishes under `work`; `env` adds settings (e.g. CUDA_VISIBLE_DEVICES)."""
    from crucible_cli.spawn import start

    settings = {
        "CRUCIBLE_GENERATOR_MODEL": model,
        "CRUCIBLE_GENERATOR_MAX_BATCH_SIZE": str(rows),
        "CRUCIBLE_GENERATOR_MAX_LORAS": str(max_loras),
        "CRUCIBLE_GENERATOR_LOG_LEVEL": "warning",
        "CRUCIBLE_GENERATOR_ADAPTER_ROOTS": str(work),
        **(env or {}),
    }
    return start("crucible_generator", settings, "CRUCIBLE_GENERATOR_PORT", log=work / log, timeout=timeout)


def on_device(device: str | None) -> dict[str, str]:
    """The environment that puts a spawned service on `device` (a CUDA_VISIBLE_DEVICES value)."""
    return {"CUDA_VISIBLE_DEVICES": device} if device else {}


@contextmanager
def services(
    work: Path,
    model: str,
    rows: int | str = 128,
    *,
    generator_url: str | None = None,
    device: str | None = None,
    max_loras: int = 4,
    **settings: Any,
) -> Iterator[Any]:
    """A sandbox and a generator of `model` (or the one at `generator_url`) spawned for the jobs of
    a benchmark, stopped at the end; yields the trainer's `Settings` pointing at them, with the
    adapters and run dirs under `work` (and any other `settings`)."""
    from crucible_cli.spawn import start
    from crucible_trainer.settings import Settings

    sandbox = start("crucible_sandbox", {}, "CRUCIBLE_SANDBOX_PORT", log=work / "sandbox.log", timeout=300)
    generator = None
    try:
        if not generator_url:
            generator = spawn_generator(work, model, rows, max_loras=max_loras, env=on_device(device))
        yield Settings(
            generator_urls=[generator_url or generator.url],
            sandbox_url=sandbox.url,
            adapter_dir=work / "adapters",
            runs_dir=work / "jobs",
            **settings,
        )
    finally:
        if generator is not None:
            generator.stop()
        sandbox.stop()


def run_job(spec: Any, job_id: str, settings: Any) -> dict[str, Any]:
    """A parsed job (train, eval or pipeline) through the worker's own entry point, in this process;
    its summary plus `wall_s`. Raises when the job does not finish."""
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.runtime.entry import execute

    started = time.perf_counter()
    summary = execute(spec, job_id, settings, LocalChannel(job_id))
    if summary.get("status") != "finished":
        raise RuntimeError(f"{job_id}: {summary.get('status')}")
    summary["wall_s"] = time.perf_counter() - started
    print(f"{job_id}: {summary['wall_s']:.1f} s", flush=True)
    return summary


def run_pipeline(spec: dict[str, Any], job_id: str, settings: Any) -> dict[str, Any]:
    """A pipeline job given as a dict (`run_job`), its stages printed."""
    from crucible_shared.jobs import PipelineJob

    summary = run_job(PipelineJob.model_validate(spec), job_id, settings)
    print(f"{job_id}: stages " + json.dumps(summary["stages"]), flush=True)
    return summary


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A training job's per-step metrics rows (its `metrics.jsonl`, evaluations left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for line in lines if "eval_label" not in (row := json.loads(line))]


def step_medians(rows: list[dict]) -> dict:
    """Median seconds per step over steps 2+ (step 1 pays start-up costs), over all of them and over
    those that updated the policy (a step whose groups all had equal rewards trains nothing and is
    faster), and how many updated.

    >>> rows = [{"time/step_s": 9.0, "update/sequences": 8.0}, {"time/step_s": 1.0, "update/sequences": 0.0},
    ...         {"time/step_s": 3.0, "update/sequences": 16.0}, {"time/step_s": 2.0, "update/sequences": 8.0}]
    >>> step_medians(rows)
    {'median_step_s': 2.0, 'median_updated_step_s': 2.5, 'updated_steps': 3}
    """
    import statistics

    later = rows[1:] or rows
    updated = [r for r in later if r.get("update/sequences", 0.0) > 0]
    return {
        "median_step_s": statistics.median(r["time/step_s"] for r in later),
        "median_updated_step_s": statistics.median(r["time/step_s"] for r in updated) if updated else None,
        "updated_steps": sum(1 for r in rows if r.get("update/sequences", 0.0) > 0),
    }
