"""What the benchmarks share: a job spec (a file or a recipe of recipes/learning.yaml) plus `--set`
overrides, the services it needs spawned, the job run in-process through the worker's own entry
point (what `crucible train --local` runs) and timed, and the figures read from its metrics."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "learning.yaml"


def argument_parser(
    doc: str | None, *, job: bool = False, overrides: bool = False
) -> argparse.ArgumentParser:
    """A benchmark's parser, its help the script's docstring as written (`job_arguments` added)."""
    out = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return job_arguments(out, job) if job or overrides else out


def job_arguments(parser: argparse.ArgumentParser, job: bool = True) -> argparse.ArgumentParser:
    """`parser` with `job` (a spec file or a recipe) and its `--set` overrides (`args.overrides`)."""
    if job:
        parser.add_argument("job", help="a job spec file (YAML/JSON) or a recipe of recipes/learning.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    return parser


def options(parser: argparse.ArgumentParser, **table: Any) -> argparse.ArgumentParser:
    """`parser` with an option `--name` (underscores as dashes) per entry of `table`: its default, or
    (default, help). The default's type is the option's; a list takes one or more of its items' type,
    None a string, False makes a flag and a type itself a required option."""
    for name, value in table.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(default, type):
            parser.add_argument(flag, type=default, required=True, help=text)
        elif isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=text)
        elif isinstance(default, list):
            parser.add_argument(flag, type=type(default[0]), nargs="+", default=default, help=text)
        else:
            parser.add_argument(
                flag, type=str if default is None else type(default), default=default, help=text
            )
    return parser


def commands(doc: str | None, table: dict[str, tuple[Callable[[Any], dict], dict[str, Any]]]) -> None:
    """A benchmark of sub-commands: `table` maps each name to its function and its `options` (and
    `--json`); runs the one named with the parsed arguments, prints its figures and keeps them there."""
    parser = argument_parser(doc)
    verbs = parser.add_subparsers(dest="what", required=True)
    for name, (_, table_) in table.items():
        options(verbs.add_parser(name), json=(None, "also write the figures here"), **table_)
    args = parser.parse_args()
    figures = table[args.what][0](args)
    print(json.dumps(figures, indent=1))
    if args.json:  # with the command that measured them, the CPU count and the load average
        context = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load": os.getloadavg()}
        dump(Path(args.json), context | figures)


def read_json(path: Path, default: Any = None) -> Any:
    """The JSON at `path`, or `default` when there is no such file."""
    return json.loads(path.read_text()) if path.exists() else default


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a run's JSON-lines file (a row cut short by a kill skipped), none without the file."""
    from crucible_shared import jsonl

    return jsonl.rows(path.read_text()) if path.exists() else []


def percentile(values: list[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def latency(took_ms: list[float]) -> dict[str, float]:
    """How many calls, and their median, 99th percentile and slowest, in milliseconds."""
    p50, p99 = statistics.median(took_ms), percentile(took_ms, 0.99)
    return {"n": len(took_ms), "p50_ms": p50, "p99_ms": p99, "max_ms": max(took_ms)}


def md_table(header: list[str], rows: list[list[Any]], align: str = "") -> str:
    """A Markdown table; `align` gives each column's `---` suffix (`:` right-aligns), default left."""
    rule = "|" + "".join("---" + align[i : i + 1].strip() + "|" for i in range(len(header)))
    lines = ["| " + " | ".join(map(str, cells)) + " |" for cells in [header, *rows]]
    return "\n".join([lines[0], rule, *lines[1:]])


def dump(path: Path, data: Any) -> None:
    """`data` as indented JSON at `path` (its folder made), replaced at once: a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def alternate(arms: dict[str, Callable[[int], Any]], rounds: int) -> dict[str, list[Any]]:
    """Each arm's results over `rounds` rounds, a round calling every arm in turn with its number:
    load from elsewhere on the host then falls on all arms alike."""
    out: dict[str, list[Any]] = {name: [] for name in arms}
    for r in range(rounds):
        for name, arm in arms.items():
            out[name].append(arm(r))
    return out


def timed_ms(call: Callable[[], Any], times: int, ok: Callable[[Any], bool]) -> list[float]:
    """Milliseconds of each of `times` calls of `call` in turn; `ok(answer)` must hold for each."""
    took = []
    for _ in range(times):
        started = time.perf_counter()
        answer = call()
        took.append((time.perf_counter() - started) * 1000)
        assert ok(answer), answer
    return took


def card() -> str:
    """The first visible GPU's name, else `cpu` (also without torch installed)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def recipes(path: Path = RECIPES) -> dict[str, dict[str, Any]]:
    """The named recipes of `path`, each resolved: its `spec` file (from the repository root), every
    `set` override from the recipe it builds on (`from`) down to its own, and its other keys (inherited)."""
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


def job_source(job: str, overrides: list[str]) -> tuple[Path, list[str], dict[str, Any]]:
    """A job spec file as it is, or a recipe of recipes/learning.yaml resolved: the spec's path,
    the recipe's overrides then `overrides`, and the recipe (empty for a file)."""
    if Path(job).is_file():
        return Path(job), overrides, {}
    known = recipes()
    if job not in known:
        raise SystemExit(f"{job}: neither a spec file nor a recipe ({', '.join(known)})")
    return ROOT / known[job]["spec"], [*known[job]["set"], *overrides], known[job]


def load_job(source: Path | dict[str, Any], overrides: list[str] | None = None, kind: str = "") -> Any:
    """The job spec in `source` (a YAML or JSON file, or the spec itself) with `--set` overrides applied
    as every `crucible` command applies them (`crucible_cli.specs`); exits with the bad fields named,
    or when the job is not of `kind` (if given)."""
    import typer
    import yaml
    from crucible_cli.specs import apply_overrides, validation_lines
    from crucible_shared.jobs import JobSpec
    from pydantic import TypeAdapter, ValidationError

    try:
        raw = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
        spec = TypeAdapter(JobSpec).validate_python(apply_overrides(raw, overrides))
    except typer.BadParameter as exc:
        raise SystemExit(f"--set {exc.message}") from None
    except ValidationError as exc:
        lines = validation_lines(exc, overrides)
        where = "the job" if isinstance(source, dict) else source
        raise SystemExit(f"{where}: invalid job spec:\n" + "\n".join(f"  {line}" for line in lines)) from None
    if kind and spec.kind != kind:
        raise SystemExit(f"{source}: a {spec.kind.value} job; this benchmark runs {kind} jobs")
    return spec


def random_adapter(
    model_dir: str, path: Path, rank: int = 16, b_std: float = 0.0, dtype: str = "float32"
) -> str:
    """A seeded rank-`rank` all-linear LoRA adapter of the model in `model_dir`, saved at `path`;
    `b_std` > 0 draws its lora_B too (else zero, PEFT's default), so that it changes every layer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if b_std and "lora_B" in name:
                p.normal_(0, b_std)
    peft_model.save_pretrained(path)
    return str(path)


def sandbox(work: Path | None = None, **env: str) -> Any:
    """A sandbox server started here (isolation on, a free port, `env` added), its log under `work`."""
    from crucible_cli.spawn import start

    log = work / "sandbox.log" if work else None
    return start("crucible_sandbox", env, "CRUCIBLE_SANDBOX_PORT", log=log, timeout=300)


def spawn_generator(work: Path, model: str, rows: int | str, *, max_loras: int = 4, env: dict | None = None,
                    log: str = "generator.log", timeout: float = 600) -> Any:  # fmt: skip
    """A Crucible generator for a benchmark's job: `rows` at once, quiet, loading the adapters the
    job publishes under `work`; `env` adds settings (e.g. CUDA_VISIBLE_DEVICES)."""
    from crucible_cli.spawn import start

    level = os.environ.get("CRUCIBLE_GENERATOR_LOG_LEVEL", "warning")  # info: its graph captures
    settings = {"MODEL": model, "MAX_BATCH_SIZE": rows, "MAX_LORAS": max_loras, "LOG_LEVEL": level}
    settings = {f"CRUCIBLE_GENERATOR_{k}": str(v) for k, v in (settings | {"ADAPTER_ROOTS": work}).items()}
    env = settings | (env or {})
    return start("crucible_generator", env, "CRUCIBLE_GENERATOR_PORT", log=work / log, timeout=timeout)


def generator_metrics(url: str, client: Any = None) -> dict[str, float] | None:
    """The unlabelled counters and gauges a Crucible generator at `url` shows at `/metrics`, named
    without their `crucible_generator_` prefix ({} from a server of other metrics: vLLM), or None
    when it does not answer."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = (client or httpx).get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return {
        s.name.removeprefix("crucible_generator_"): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("crucible_generator_") and not s.labels
    }


@contextmanager
def services(work: Path, model: str, rows: int | str = 128, *, devices: list[str | None] | None = None,
             generator_url: str | None = None, max_loras: int = 4, generator_env: dict[str, str] | None = None,
             job: Any = None, ready: dict[str, float] | None = None, **settings: Any) -> Iterator[Any]:  # fmt: skip
    """A sandbox and a generator of `model` per entry of `devices` (its CUDA_VISIBLE_DEVICES; None:
    the caller's own), or the one at `generator_url`, spawned at once and stopped at the end; yields
    the trainer's `Settings` for them (adapters and run dirs under `work`). Meanwhile the cold start
    of `job` (the spec about to run) is taken as a worker takes it (`runtime.warm`; for several ranks,
    standby ranks). `ready` gets the seconds to each one being ready: which of them the job waited for."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from crucible_shared.jobs import TrainJob
    from crucible_trainer.runtime import warm
    from crucible_trainer.settings import Settings

    began, ready = time.perf_counter(), {} if ready is None else ready
    warming = standby = None
    if job is not None and warm.worth_it():
        if isinstance(job, TrainJob) and job.distributed.train_gpus > 1:
            from crucible_trainer.distributed import launch

            # The ranks' own cold start (this process's would not help them), in ranks started now.
            standby = launch.keep_standby(job.distributed.train_gpus)
        else:
            httpx.Client().close()  # what the threads below import to poll health, imported before the warm-up
            warming = warm.in_background(job)
    devices = [] if generator_url else (devices or [None])
    many = len(devices) > 1
    up: dict[str | int, Any] = {}  # the sandbox and generator i, as they come up

    def one(key: str | int) -> None:
        if key == "sandbox":
            up[key] = sandbox(work)
            ready[key] = round(time.perf_counter() - began, 2)
            return
        i = int(key)
        # Replicas sharing a CPU decode on one thread each.
        env = {"CRUCIBLE_GENERATOR_THREADS": "1"} if many else {}
        env = {"CUDA_VISIBLE_DEVICES": devices[i]} if devices[i] else env
        log = f"generator-{i}.log" if many else "generator.log"
        env |= generator_env or {}
        up[i] = spawn_generator(work, model, rows, max_loras=max_loras, env=env, log=log, timeout=900)
        ready[f"generator-{i}"] = round(time.perf_counter() - began, 2)

    keys: list[str | int] = ["sandbox", *range(len(devices))]
    try:
        with ThreadPoolExecutor(len(keys)) as pool:  # at once; any that came up are stopped below
            list(pool.map(one, keys))
        if warming is not None:
            warming.join()
            took = "failed (the job meets it)" if warming.seconds is None else f"{warming.seconds:.1f} s"
            if warming.seconds is not None:  # it started with this call: its end, and its imports' end
                ready["trainer warm-up"] = round(warming.seconds, 2)
                ready["trainer imports"] = round(warming.parts["imports_s"], 2)
            print(f"trainer warm-up beside the services: {took}", flush=True)
        urls = [generator_url] if generator_url else [up[i].url for i in range(len(devices))]
        paths = {"adapter_dir": work / "adapters", "runs_dir": work / "jobs"}
        yield Settings(generator_urls=urls, sandbox_url=up["sandbox"].url, **paths, **settings)
    finally:
        if warming is not None:
            warming.join()  # no import of it left running beside what the caller does next
        if standby is not None:
            launch.release_standby()  # unless the job took it
        for service in up.values():
            service.stop()


# Two tenants of a server (its `TENANTS` setting): a, which floods it, and b, which is timed.
TENANT_KEYS = {"a": "bench-tenant-a-0123456789", "b": "bench-tenant-b-0123456789"}


def tenants(quotas: dict[str, int]) -> str:
    """The tenants table: tenant a with `quotas`, b with the defaults."""
    a, b = ({"name": name, "keys": [key]} for name, key in TENANT_KEYS.items())
    return json.dumps({"tenants": [a | {"quotas": quotas}, b]})


def bearer(tenant: str) -> dict[str, str]:
    """The headers of a call by `tenant` (a or b)."""
    return {"Authorization": f"Bearer {TENANT_KEYS[tenant]}"}


@contextmanager
def gateway(work: Path, **env: str) -> Iterator[Any]:
    """A Redis of its own (no persistence) and a gateway on it (quiet, runs under `work`, `env` added)."""
    from crucible_cli.spawn import free_port, spawn
    from crucible_cli.stack import redis_server_binary

    port = free_port()
    flags = [*f"--port {port} --bind 127.0.0.1 --appendonly no --maxclients 10000".split(), "--save", ""]
    redis = subprocess.Popen([redis_server_binary(), *flags], stdout=subprocess.DEVNULL)
    settings = {"REDIS_URL": f"redis://127.0.0.1:{port}/0", "CRUCIBLE_GATEWAY_RUNS_DIR": str(work / "runs")}
    settings |= {"CRUCIBLE_GATEWAY_LOG_LEVEL": "warning", **env}
    try:
        with spawn("crucible_gateway", settings, "CRUCIBLE_GATEWAY_PORT", log=work / "gateway.log") as server:
            yield server
    finally:
        redis.terminate()


def local_events() -> None:
    """A job run here sends its events to a local channel, not to a Redis named in the environment."""
    for name in ("REDIS_URL", "CRUCIBLE_TRAINER_REDIS_URL"):
        os.environ.pop(name, None)


def show_logs(work: Path, lines: int = 30) -> None:
    """The end of every log under `work` (of a failed run), on stderr."""
    for log in sorted(work.rglob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"== {log.relative_to(work)}", *tail, sep="\n", file=sys.stderr)


def run_job(spec: Any, job_id: str, settings: Any, on_event: Any = None) -> dict[str, Any]:
    """A parsed job (train, eval or pipeline) through the worker's own entry point, in this process
    (its events to `on_event(kind, event)`); its summary plus `wall_s`. Raises when it does not finish."""
    from crucible_trainer.runtime.channel import LocalChannel
    from crucible_trainer.runtime.entry import execute

    started = time.perf_counter()
    summary = execute(spec, job_id, settings, LocalChannel(job_id, on_event))
    if summary.get("status") != "finished":
        raise RuntimeError(f"{job_id}: {summary.get('status')}")
    summary["wall_s"] = time.perf_counter() - started
    print(f"{job_id}: {summary['wall_s']:.1f} s", flush=True)
    return summary


def evaluation(settings: Any, label: str, model: dict[str, Any], data: dict[str, Any], max_tokens: int,
               adapter: str | None = None, **spec: Any) -> dict[str, Any]:  # fmt: skip
    """An evaluation job of `model` (its `base`, `chat`...), or of `adapter` on it, on `data`, through
    the worker's entry point: its headline figures (`greedy_pass@1`, `problems`...), `wall_s` and
    `report` (the folder of its report.json)."""
    spec |= {"kind": "eval", "model": model, "adapter": adapter, "data": data, "max_tokens": max_tokens}
    summary = run_job(load_job(spec), label, settings)
    return {**summary["eval"]["eval"], "wall_s": summary["wall_s"], "report": summary["report"]}


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """A training job's per-step metrics rows (its `metrics.jsonl`, evaluations left out)."""
    return [row for row in read_jsonl(run_dir / "metrics.jsonl") if "eval_label" not in row]


def samples_per_s(rows: list[dict]) -> float | None:
    """Samples trained per second of the loop's own time (summed `time/step_s`, evaluations out)."""
    seconds = sum(r.get("time/step_s", 0.0) for r in rows)
    return round(sum(r.get("samples", 0.0) for r in rows) / seconds, 4) if seconds > 0 else None


def later_median(rows: list[dict], key: str) -> float:
    """The median of `key` (0 where missing) over steps 2+ (step 1 pays start-up costs), or the one step."""
    return statistics.median(r.get(key, 0.0) for r in rows[1:] or rows)


def step_medians(rows: list[dict]) -> dict:
    """Median s/step over steps 2+, of all steps and of those that updated the policy (a step whose
    groups all had equal rewards trains nothing and is faster), and how many updated."""
    updated = [r["time/step_s"] for r in rows[1:] or rows if r.get("update/sequences", 0.0) > 0]
    return {
        "median_step_s": later_median(rows, "time/step_s"),
        "median_updated_step_s": statistics.median(updated) if updated else None,
        "updated_steps": sum(1 for r in rows if r.get("update/sequences", 0.0) > 0),
    }
