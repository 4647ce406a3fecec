"""Time to accuracy (docs/benchmarks.md, "Time to accuracy against TRL"): one GRPO job run by Crucible
and by TRL's `GRPOTrainer`, each saving its adapter every N steps with the wall time since its process
started (`DIR/run.json`); `eval` scores every saved adapter off the runs' clocks (`DIR/evals.json`,
the last point's greedy answers in `DIR/answers/`), `table` compares the curves. `trl` alone is also
the GRPO race's TRL baseline (`bash bench/gpu.sh trl-1p5b`). RECIPE: a recipe of
recipes/learning.yaml or a job spec file.

    python bench/tta.py crucible RECIPE [--set F=V ...] --out DIR [--every 10] [--generator-devices 3]
    python bench/tta.py trl RECIPE [--set F=V ...] --out DIR [--every 10] [--engine vllm|hf]
    python bench/tta.py eval DIR [DIR ...] [--tasks 500] [--humaneval-tasks 164]
    python bench/tta.py table DIR [DIR ...] --json tta.json --md tta.md [--learning DIR]   (one job's runs)
"""

from __future__ import annotations

import time

T0 = time.time()  # a run's clock starts with its process, before its imports

import argparse  # noqa: E402
import gzip  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402


def train_spec(args: argparse.Namespace, *more: str) -> Any:
    """`args.job`'s training job (a spec file, or a recipe resolved), `args`' overrides and `more` applied."""
    return common.load_job(*common.job_source(args.job, [*args.overrides, *more])[:2], kind="train")


def saved_steps(steps: int, every: int) -> list[int]:
    """The steps whose adapters a run keeps: every `every`-th and the last."""
    return sorted({*range(every, steps + 1, every), steps})


def eval_settings(spec: Any) -> dict[str, Any]:
    """How the evaluation scores a run of `spec`: its evaluation problems and max tokens (MBPP's
    500 test tasks at the rollout's max tokens when the job has no evaluation)."""
    if spec.eval is not None:
        data = spec.eval.data.model_dump(mode="json", exclude_defaults=True)
        return {"data": data, "max_tokens": spec.eval.max_tokens}
    return {"data": {"dataset": "mbpp", "split": "test"}, "max_tokens": spec.rollout.max_tokens}


def visible_cards() -> list[str]:
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]


class Record(dict):
    """`DIR/run.json`: the run, rewritten whenever it changes (`save`)."""

    def __init__(self, out: Path, engine: str, spec: Any, extra: dict[str, Any]) -> None:
        job = spec.model_dump(mode="json")
        super().__init__(run=out.name, engine=engine, t0=T0, job=job, **extra, command=sys.argv)
        self.path, self["points"] = out / "run.json", [{"step": 0, "wall_s": 0.0, "adapter": None}]
        self.save()

    def save(self, **changes: Any) -> None:
        self.update(changes)
        common.dump(self.path, self)

    def phase(self, kind: str, event: dict[str, Any]) -> None:
        """When the job first reported each kind of event (`status` per status, `metrics` per
        step up to the third), seconds since the run began: where its start-up goes."""
        key = f"{kind}:{event.get('status') or event.get('step') or ''}".rstrip(":")
        if kind != "metrics" or int(event.get("step") or 0) <= 3:
            self.setdefault("phases", {}).setdefault(key, round(time.time() - T0, 2))

    def point(self, step: int, wall_s: float, adapter: str) -> None:
        self["points"].append({"step": step, "wall_s": round(wall_s, 2), "adapter": adapter})
        self.save()

    def finish(self, **last: Any) -> None:
        """The run's last figures saved, and printed with its training summary (median step...)."""
        self.save(wall_s=round(time.time() - T0, 2), **last)
        rows = common.read_jsonl(self.path.parent / "metrics.jsonl")
        shown = {k: self.get(k) for k in ("run", "points", "wall_s", "train_start_s")}
        print(json.dumps(shown | {"training": training(self["engine"], rows)}))


class GeneratorLog(threading.Thread):
    """Every second while a run trains, each generator's gauges and counters (its `/metrics`) as one
    row of `path` with the run's clock: what its rows, queue and cache did, e.g. in the pre-filter,
    and the parts of its start (`start_*_seconds`)."""

    KEEP = ("running_sequences", "waiting_sequences", "kv_cache_usage", "generation_tokens_total",
            "prompt_tokens_total", "prefix_reused_tokens_total", "preempted_sequences_total",
            "graph_captures_total",
            "start_imports_seconds", "start_load_seconds", "start_engine_seconds")  # fmt: skip

    def __init__(self, urls: list[str], path: Path) -> None:
        super().__init__(daemon=True)
        self.urls, self.path, self.done = urls, path, threading.Event()

    def __enter__(self) -> GeneratorLog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join()

    def run(self) -> None:
        import httpx

        with httpx.Client() as client, open(self.path, "w") as f:
            while not self.done.wait(1.0):
                row: dict[str, Any] = {"wall_s": round(time.time() - T0, 2)}
                for i, url in enumerate(self.urls):
                    found = common.generator_metrics(url, client) or {}  # none from a busy one: next second
                    row |= {f"{i}/{name}": value for name, value in found.items() if name in self.KEEP}
                f.write(json.dumps(row) + "\n")
                f.flush()


def run_crucible(args: argparse.Namespace) -> None:
    full = train_spec(args)
    spec = train_spec(args, "eval=null")  # evaluated afterwards, off the run's clock
    devices = args.generator_devices.split(",") if args.generator_devices else [None]
    ranks, visible, out = spec.distributed.train_gpus, visible_cards(), args.out.resolve()
    gpus = max(ranks, len({d for d in devices if d is not None} | set(visible)))
    placement = {"trainer_cards": visible, "train_ranks": ranks, "generator_cards": devices}
    extra = {"eval": eval_settings(full), "gpus": gpus, "placement": placement}
    record = Record(out, "crucible", spec, extra)
    work, job_id = out / "work", f"tta-{out.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    common.local_events()
    try:
        ready: dict[str, float] = {}  # what the job waited for: each service's and the warm-up's end
        services = {"devices": devices, "max_ranks": ranks, "job": spec, "ready": ready}
        began = time.time() - T0
        with common.services(work, spec.model.base, args.rows, **services) as settings:
            record["train_start_s"] = round(time.time() - T0, 2)
            record["ready_s"] = {name: round(began + s, 2) for name, s in ready.items()}
            with GeneratorLog(settings.generator_urls, out / "generator.jsonl"):
                summary = common.run_job(spec, job_id, settings, record.phase)
    except BaseException:
        common.show_logs(work)
        raise
    for step in saved_steps(spec.optim.steps, args.every):
        source, target = work / "adapters" / job_id / f"v{step}", out / "adapters" / f"step-{step}"
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(source, target)
        written = max(p.stat().st_mtime for p in source.iterdir() if p.is_file())
        record.point(step, written - T0, str(target))
    shutil.copy2(work / "jobs" / job_id / "metrics.jsonl", out / "metrics.jsonl")
    kept = ("difficulty_filter", "status", "policy_load_s", "policy_wait_s", "fused_modules")
    kept += ("fused_lora_layers", "kernel_warm_up_s", "ranks_ready_s", "settings")
    ran = {k: summary.get(k) for k in kept}
    record.finish(job_wall_s=round(summary["wall_s"], 2), **ran)


def trl_config(spec: Any, out: Path, engine: str, vllm_memory: float, cuda: bool) -> dict[str, Any]:
    """`GRPOConfig`'s arguments for the job `spec` (those it has a counterpart for)."""
    method, optim, rollout = spec.method, spec.optim, spec.rollout
    if method.name != "grpo":
        raise SystemExit(f"method {method.name!r}: this race compares GRPO jobs")
    batch = optim.problems_per_step * method.group_size
    micro = optim.micro_batch if optim.micro_batch != "auto" else 8
    if batch % micro:
        raise SystemExit(f"optim.micro_batch {micro} must divide the step's {batch} completions")
    config: dict[str, Any] = {
        "output_dir": str(out / "trl"),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": batch // micro,  # one generation of the whole step per update
        "num_generations": method.group_size,
        "max_completion_length": rollout.max_tokens,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "learning_rate": optim.lr,
        "lr_scheduler_type": "constant_with_warmup" if optim.warmup_steps else "constant",
        "warmup_steps": optim.warmup_steps,
        "weight_decay": optim.weight_decay,
        "max_grad_norm": optim.max_grad_norm or 0.0,
        "max_steps": optim.steps,
        "beta": method.kl_beta,
        "epsilon": method.clip_eps,
        "num_iterations": method.num_iterations,
        "loss_type": {"token": "dapo", "sequence": "grpo", "dr_grpo": "dr_grpo"}[method.loss],
        "scale_rewards": method.scale,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "seed": spec.seed,
        # Crucible's `auto` turns it on only when the micro-batch does not fit (not at 1.5B on an H200)
        "gradient_checkpointing": spec.model.gradient_checkpointing is True,
        "bf16": cuda,
        "use_cpu": not cuda,
    }
    if engine == "vllm":
        max_len = int(os.environ.get("CRUCIBLE_GENERATOR_MAX_MODEL_LEN", "2048"))
        config |= {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": vllm_memory}
        config["vllm_max_model_length"] = max_len
    return config


def bf16_copy(model_dir: str) -> str:
    """`model_dir` as a bfloat16 checkpoint: itself when it is one, else a copy beside it (made once):
    TRL's colocated vLLM would serve a float32 checkpoint (Crucible's dense cache) in float16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    if str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", "")).endswith("bfloat16"):
        return model_dir
    target = Path(model_dir).with_name(Path(model_dir).name + "-bf16")
    if not (target / "config.json").is_file():
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another run (on the other card) made it first: theirs is the same copy
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def sandbox_reward(problems: list[Any], spec: Any, url: str) -> tuple[Any, dict[str, int]]:
    """A TRL reward function that scores as Crucible's rollouts do (`answer_to_code`, the sandbox at
    `url`, the job's limits and `reward.kind`), each completion's task named by the `task_index`
    column; and its counters (a sandbox error, which Crucible drops, scores 0: TRL needs a number)."""
    import asyncio

    from crucible_shared.sandbox_client import SandboxClient
    from crucible_trainer import tasks
    from crucible_trainer.rl.rewards import reward as reward_of

    limits, chat, penalty = spec.reward.limits(), spec.model.chat, spec.reward.length_penalty
    faults = {"scored": 0, "sandbox_errors": 0}

    async def judge(requests: list[Any]) -> list[Any]:
        async with SandboxClient(url) as client:
            return await client.run_batch(requests)

    def reward(completions: list[Any], task_index: list[int], **kw: Any) -> list[float]:
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        lengths = [len(ids) for ids in kw.get("completion_ids") or [[]] * len(texts)]
        found = [problems[i] for i in task_index]
        codes = [tasks.answer_to_code(t, x, chat=chat) for t, x in zip(found, texts, strict=True)]
        requests = [t.run_request(code, limits) for t, code in zip(found, codes, strict=True)]
        scores = []
        for result, length in zip(asyncio.run(judge(requests)), lengths, strict=True):
            value = reward_of(result, spec.reward.kind, generated_tokens=length, length_penalty=penalty)
            faults["scored"] += 1
            faults["sandbox_errors"] += value is None
            scores.append(0.0 if value is None else value)
        return scores

    return reward, faults


def run_trl(args: argparse.Namespace) -> None:
    import crucible_models
    import torch
    from crucible_cli.spawn import free_port
    from crucible_trainer import tasks
    from crucible_trainer.rl.context import PromptBook
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    global T0
    spec, cuda, out = train_spec(args), torch.cuda.is_available(), args.out.resolve()
    engine = args.engine or ("vllm" if cuda else "hf")
    config = trl_config(spec, out, engine, 0.3, cuda)  # vLLM's share of the card: the race's
    model_dir, prepared = crucible_models.resolve_model_path(spec.model.base), time.time()
    model_dir = bf16_copy(model_dir) if cuda else model_dir
    prepared = time.time() - prepared
    T0 += prepared  # preparing the copy is not the run's time (Crucible's generator casts as it loads)
    mode = spec.method.filter.mode
    unfiltered = {"method.filter": f"{mode}: TRL trains on the job's problems unfiltered"}
    placement = {"trainer_cards": visible_cards(), "engine": engine}
    extra = {"eval": eval_settings(spec), "gpus": 1, "placement": placement}
    extra |= {"trl_config": config, "model_dir": model_dir, "bf16_copy_s": round(prepared, 1)}
    not_matched = unfiltered if mode != "none" else {}
    if spec.reward.length_penalty and spec.method.scale != "none":  # rl/advantages.group_advantages
        not_matched["reward.length_penalty"] = "TRL divides the penalised rewards by their own spread"
    record = Record(out, "trl", spec, extra | {"not_matched": not_matched})
    if engine == "vllm":  # colocate mode runs vLLM in this process through torch.distributed: a world of one
        world = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        for key, value in (world | {"MASTER_PORT": str(free_port())}).items():
            os.environ.setdefault(key, value)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    problems = tasks.load_tasks(spec.data)
    prompts = PromptBook(problems, spec.model.chat, tokenizer)  # what Crucible's generator is sent
    data = Dataset.from_list([{"prompt": prompts.first(i), "task_index": i} for i in range(len(problems))])
    if engine == "vllm":  # room for the longest prompt and its answer (vLLM refuses a longer request)
        longest = max(len(tokenizer(p).input_ids) for p in data["prompt"])
        needed = longest + spec.rollout.max_tokens
        config["vllm_max_model_length"] = max(config["vllm_max_model_length"], needed)
        record["trl_config"] = config
    (out / "work").mkdir(parents=True, exist_ok=True)
    server = common.sandbox(out / "work")
    reward, faults = sandbox_reward(problems, spec, server.url)
    keep = set(saved_steps(spec.optim.steps, args.every))

    class Saver(TrainerCallback):
        """The adapter at every saved step, with its wall time; the step's log row kept."""

        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step in keep:
                wall, target = time.time() - T0, out / "adapters" / f"step-{state.global_step}"
                trainer.model.save_pretrained(target)
                record.point(state.global_step, wall, str(target))

        def on_log(self, targs: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs:
                row = {"step": state.global_step, "wall_s": round(time.time() - T0, 2), **logs}
                with (out / "metrics.jsonl").open("a") as f:
                    f.write(json.dumps(row, default=str) + "\n")

    (out / "metrics.jsonl").unlink(missing_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    lora = {k: getattr(spec.model, k) for k in ("lora_alpha", "lora_dropout", "target_modules")}
    peft_config = LoraConfig(r=spec.model.lora_r, task_type="CAUSAL_LM", **lora)
    try:
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(**config), callbacks=[Saver()],
                              train_dataset=data, processing_class=tokenizer, peft_config=peft_config)  # fmt: skip
        record.save(train_start_s=round(time.time() - T0, 2))
        trainer.train()
    finally:
        server.stop()
    record.finish(rewards=faults, status="finished")


def run_eval(args: argparse.Namespace) -> None:
    import tempfile

    runs = [(d.resolve(), common.read_json(d / "run.json")) for d in args.runs]
    base = runs[0][1]["job"]["model"]["base"]
    if any(r["job"]["model"]["base"] != base for _, r in runs):
        raise SystemExit("the runs train different models: evaluate them separately")
    work = Path(tempfile.mkdtemp(prefix="crucible-tta-eval-"))
    # The saved adapters may be read from where the runs keep them (the trainer's and the generator's roots).
    roots = ",".join(sorted({str(d) for d, _ in runs} | {str(work)}))
    known = os.environ.get("CRUCIBLE_ADAPTER_ROOTS")
    os.environ["CRUCIBLE_ADAPTER_ROOTS"] = ",".join(filter(None, [known, roots]))
    common.local_events()
    # The base model's scores, evaluated once for all the runs beside these, keyed by what was evaluated.
    cache = runs[0][0].parent / "base-evals.json"

    def score(settings: Any, run: dict[str, Any], adapter: str | None, dataset: str, label: str,
              keep: Path | None) -> dict:  # fmt: skip
        limit = args.tasks if dataset == "mbpp" else args.humaneval_tasks
        what = json.dumps([base, dataset, limit, run["eval"]], sort_keys=True)
        if adapter is None and what in (shared := common.read_json(cache, {})):
            return shared[what]
        data = dict(run["eval"]["data"]) if dataset == "mbpp" else {"dataset": "humaneval"}
        data |= {"limit": limit} if limit is not None else {}
        model, tokens = {"base": base, "chat": run["job"]["model"]["chat"]}, run["eval"]["max_tokens"]
        found = common.evaluation(settings, label, model, data, tokens, adapter, greedy=True)
        result = {"pass@1": found.get("greedy_pass@1"), "problems": found.get("problems"),
                  "hard_coded_answers": found.get("hard_coded_answers"), "seconds": round(found["wall_s"], 1)}  # fmt: skip
        if keep is not None:
            keep_answers(Path(found["report"]) / "report.json", keep / f"{label}.jsonl.gz")
        if adapter is None:
            common.dump(cache, common.read_json(cache, {}) | {what: result})
        return result

    try:
        env = {"CRUCIBLE_GENERATOR_ADAPTER_ROOTS": roots}
        with common.services(work, base, args.rows, generator_env=env) as settings:
            # Every run's base and last point first, then the others from the latest back: a lease
            # that ends early still holds each run's result, and the curves as far as they got.
            todo = [(rank, i, p) for i, (_, run) in enumerate(runs) for rank, p in eval_order(run["points"])]
            scored: list[dict[str, Any]] = [common.read_json(out / "evals.json", {}) for out, _ in runs]
            for _, i, p in sorted(todo, key=lambda t: (t[0], t[1])):
                (out, run), evals = runs[i], scored[i]
                final = max(q["step"] for q in run["points"])
                entry = evals.setdefault(str(p["step"]), {})
                for dataset in ["mbpp", "humaneval"][: 1 + (p["step"] in (0, final))]:  # HumanEval: ends only
                    if dataset in entry:
                        continue
                    label = f"{out.name}-{p['step']}-{dataset}" if p["adapter"] else f"base-{dataset}"
                    # The last point's greedy answers are kept to be read by hand, and the base's
                    # once beside its cached scores.
                    keep = None
                    if p["step"] in (0, final):
                        keep = out / "answers" if p["adapter"] else cache.parent / "base-answers"
                    entry[dataset] = score(settings, run, p["adapter"], dataset, label, keep)
                    common.dump(out / "evals.json", evals)
                    print(f"{out.name} step {p['step']} {dataset}: {entry[dataset]}", flush=True)
    except BaseException:
        common.show_logs(work)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def eval_order(points: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """A run's points ranked for evaluation: the base (0), the last point (1), then the others from
    the latest back (2, 3, ...)."""
    ordered = sorted(points, key=lambda p: (p["step"] != 0, -p["step"]))
    return list(enumerate(ordered))


def keep_answers(report: Path, path: Path) -> None:
    """An evaluation report's greedy answers (task, whether it passed, its code) as gzipped JSON lines."""
    problems = json.loads(report.read_text())["problems"]
    rows = [{"task_id": p["task_id"], "passed": p["greedy_passed"], "code": p["greedy"]["code"]}
            for p in problems if p.get("greedy")]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


# Per-step metrics of each engine's metrics.jsonl: seconds, mean reward, mean completion tokens.
STEP_KEYS = {
    "crucible": ("time/step_s", "reward_mean", "completion_tokens_mean"),
    "trl": ("step_time", "reward", "completions/mean_length"),
}
# Crucible's step, part by part (medians over steps 2+), and the programs' tails summed over the run.
PARTS = {"median_generate_s": "time/generate_s", "median_update_s": "time/train_s"}


def training(engine: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median seconds per step over steps 2+ (the first pays start-up costs), and the mean reward
    and completion tokens of the first and last quarter of the steps."""
    seconds, reward, tokens = STEP_KEYS[engine]
    rows = [r for r in rows if seconds in r]
    if not rows:
        return {}
    quarter = max(1, len(rows) // 4)

    def mean(part: list[dict[str, Any]], key: str) -> float | None:
        found = [float(r[key]) for r in part if r.get(key) is not None]
        return round(statistics.fmean(found), 4) if found else None

    out = {"steps": len(rows), "median_step_s": round(common.later_median(rows, seconds), 3)}
    for name, key in (("reward", reward), ("tokens", tokens)):
        out |= {f"{name}_first": mean(rows[:quarter], key), f"{name}_last": mean(rows[-quarter:], key)}
    if engine == "crucible":
        out |= {k: round(common.later_median(rows, key), 3) for k, key in PARTS.items()}
        out["tail_sum_s"] = round(sum(r.get("time/execute_tail_s") or 0.0 for r in rows), 1)
    return out


def curve(run: dict[str, Any], evals: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's evaluated points: wall_s, step, pass@1 (and HumanEval where evaluated)."""
    out = []
    for p in run["points"]:
        found = evals.get(str(p["step"]), {})
        if "mbpp" in found:
            out.append({"wall_s": p["wall_s"], "step": p["step"], "pass@1": found["mbpp"]["pass@1"]})
            out[-1] |= {"humaneval": found["humaneval"]["pass@1"]} if "humaneval" in found else {}
    return out


def reach(points: list[dict[str, Any]], target: float) -> float | None:
    """Wall time of the first trained point (step > 0) at or above `target`, or None. The base
    model reaching it says only that the target is no gain: `compare` gives no ratio then."""
    return next((p["wall_s"] for p in points if p["step"] and p["pass@1"] >= target), None)


def at(points: list[dict[str, Any]], wall_s: float) -> float | None:
    """pass@1 of the latest point at or before `wall_s`."""
    before = [p for p in points if p["wall_s"] <= wall_s]
    return before[-1]["pass@1"] if before else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The time-to-accuracy comparison of the runs (`name -> {run, evals}`)."""
    curves = {name: curve(r["run"], r["evals"]) for name, r in runs.items()}

    def first(engine: str, **more: Any) -> str | None:
        found = [n for n, r in runs.items() if r["run"]["engine"] == engine and curves[n]]
        return next((n for n in found if all(runs[n]["run"][k] == v for k, v in more.items())), None)

    trl, one = first("trl"), first("crucible", gpus=1)
    out: dict[str, Any] = {"trl_run": trl, "one_gpu_run": one, "runs": {}}
    trl_final, one_final = curves[trl][-1] if trl else None, curves[one][-1] if one else None
    if trl_final:
        out.update(trl_final=trl_final["pass@1"], trl_final_wall_s=trl_final["wall_s"])
        out["trl_gained"] = trl_final["pass@1"] > curves[trl][0]["pass@1"]
    if one_final:
        out.update(one_gpu_final=one_final["pass@1"], one_gpu_final_wall_s=one_final["wall_s"])
    for name, r in runs.items():
        pts, run = curves[name], r["run"]
        row = {k: run.get(k) for k in ("engine", "gpus", "placement")} | {"points": pts}
        row |= {"wall_s": run.get("wall_s"), "train_start_s": run.get("train_start_s")}
        row["first_step_s"] = (run.get("phases") or {}).get("metrics:1")  # since the process started
        row |= {"final": pts[-1] if pts else None, "training": training(run["engine"], r.get("metrics", []))}
        if trl_final and name != trl and pts:
            # TRL's final no better than the base it started from: a time to reach it is no figure.
            t = reach(pts, trl_final["pass@1"]) if out["trl_gained"] else None
            row |= {"reach_trl_final_s": t, "reach_over_trl": ratio(t, trl_final["wall_s"])}
            row["goal_half_trl_met"] = t is not None and t <= 0.5 * trl_final["wall_s"]
            # The same number of steps, free of evaluation noise: the last saved point's time over TRL's.
            row["last_point_over_trl"] = ratio(pts[-1]["wall_s"], trl_final["wall_s"])
            equal = [(p["wall_s"], p["pass@1"], at(pts, p["wall_s"])) for p in curves[trl] if p["step"]]
            row["at_trl_points"] = [{"wall_s": w, "trl": a, "this": b} for w, a, b in equal]
            row["not_lower_at_equal_wall"] = all(b is not None and b >= a for _, a, b in equal)
        if one_final and name != one and run["engine"] == "crucible" and pts:
            t, base_t = reach(pts, one_final["pass@1"]), reach(curves[one], one_final["pass@1"])
            over = ratio(t, base_t)
            row |= {"reach_one_gpu_final_s": t, "one_gpu_reach_s": base_t, "reach_over_one_gpu": over}
            row["goal_0p6_one_gpu_met"] = over is not None and over <= 0.6
            row["last_point_over_one_gpu"] = ratio(pts[-1]["wall_s"], one_final["wall_s"])
        out["runs"][name] = row
    return out


def seed_means(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The runs of one setting (engine, cards, placement, overlap) over two or more seeds as one
    run for `compare`: at each step that all of them evaluated, their mean wall time and mean
    pass@1 (MBPP, and HumanEval where all have it). The seeds' own runs stay in the table beside it."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in [r for r in runs.values() if curve(r["run"], r["evals"])]:  # evaluated runs only
        run = r["run"]
        overlap = (run["job"].get("overlap") or {}).get("max_staleness")
        label = f"{run['engine']}, {run['gpus']} GPU" + (", overlapped" if overlap else "")
        if run["gpus"] > 1:  # DDP replicas and a generator on its own card are different settings
            label += f", {json.dumps(run.get('placement'), sort_keys=True)}"
        groups.setdefault(label, []).append(r)
    out = {}
    for label, group in [(k, g) for k, g in groups.items() if len(g) > 1]:
        evaluated = [{p["step"]: p for p in r["run"]["points"] if "mbpp" in r["evals"].get(str(p["step"]), {})}
                     for r in group]  # fmt: skip
        points, evals = [], {}
        for step in sorted(set.intersection(*(set(e) for e in evaluated))):
            wall = statistics.fmean(e[step]["wall_s"] for e in evaluated)
            points.append({"step": step, "wall_s": round(wall, 2)})
            found = [r["evals"][str(step)] for r in group]
            evals[str(step)] = {d: {"pass@1": round(statistics.fmean(f[d]["pass@1"] for f in found), 4)}
                                for d in ("mbpp", "humaneval") if all(d in f for f in found)}  # fmt: skip
        wall = statistics.fmean(r["run"].get("wall_s") or points[-1]["wall_s"] for r in group)
        run = {k: group[0]["run"].get(k) for k in ("engine", "gpus", "placement")}
        run |= {"points": points, "wall_s": round(wall, 2)}
        out[f"{label}, mean of {len(group)} seeds"] = {"run": run, "evals": evals}
    return out


def cell(value: float | None, form: str = "{:.2f}") -> str:
    """`value` formatted, `-` for none."""
    return "-" if value is None else form.format(value)


# The table's columns after each run's curve and training: its figure, heading and format.
FIGURES = [
    ("reach_trl_final_s", "to TRL's final", "{:.0f} s"),
    ("reach_over_trl", "x TRL", "{:.2f}"),
    ("reach_one_gpu_final_s", "to 1-GPU final", "{:.0f} s"),
    ("reach_over_one_gpu", "x 1 GPU", "{:.2f}"),
    ("train_start_s", "start-up (to the job)", "{:.0f} s"),
    ("first_step_s", "first step done", "{:.0f} s"),
    ("wall_s", "wall", "{:.0f} s"),
    ("last_point_over_trl", "last point x TRL", "{:.2f}"),
    ("last_point_over_one_gpu", "last point x 1 GPU", "{:.2f}"),
]


def markdown(result: dict[str, Any]) -> str:
    """The comparison as Markdown: a row per run (its curve, its training, its times against the
    targets), then each Crucible run's pass@1 at TRL's points of wall time."""
    pct, rows = "{:.1%}", []
    for name, r in result["runs"].items():
        pts, t = r["points"], r.get("training") or {}
        shown = "; ".join(f"{p['wall_s']:.0f}, {p['step']}, {cell(p['pass@1'], pct)}" for p in pts)
        human = " → ".join(cell(p["humaneval"], pct) for p in pts if "humaneval" in p) or "-"
        ends = (("reward", "{:.2f}"), ("tokens", "{:.0f}"))  # first -> last quarter
        trained = [f"{cell(t.get(k + '_first'), f)} → {cell(t.get(k + '_last'), f)}" for k, f in ends]
        figures = [cell(r.get(key), form) for key, _, form in FIGURES]
        rows.append([f"{name} ({r['engine']})", r["gpus"], shown, human, t.get("steps", "-"),
                     cell(t.get("median_step_s")), *trained, *figures])  # fmt: skip
    head = ["run", "GPUs", "points (wall s, step, MBPP pass@1)", "HumanEval base → final", "steps"]
    head += ["median s/step (2+)", "reward, first → last quarter", "tokens, first → last quarter"]
    lines = [common.md_table([*head, *(h for _, h, _ in FIGURES)], rows, " :  ::  " + ":" * len(FIGURES))]
    if result.get("trl_final") is not None:
        final = f"{cell(result['trl_final'], pct)} at {result['trl_final_wall_s']:.0f} s"
        goal = "Crucible reaches it in <= 0.5x that time, and is not lower at equal wall time."
        lines.append(f"\nTRL's final pass@1: {final}; goal: {goal}")
        if not result.get("trl_gained", True):
            lines.append(
                "TRL's final is no gain over the base model: there is no time to reach it to compare."
            )
    for name, r in result["runs"].items():
        if "not_lower_at_equal_wall" in r:
            cells = ", ".join(f"{p['wall_s']:.0f} s: {cell(p['this'], pct)} vs {cell(p['trl'], pct)}"
                              for p in r["at_trl_points"])  # fmt: skip
            verdict = "not lower" if r["not_lower_at_equal_wall"] else "LOWER"
            lines.append(f"- {name} at TRL's points ({verdict}): {cells}")
    return "\n".join(lines) + "\n"


SEED_KEYS = ("seed", "data.seed")


def learning_rows(runs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each evaluated run as a learning row (docs/results/<card>/learning/), named
    `[trl-]<recipe>[+<override>...]-seed<N>.json` (overrides besides the seeds' in the name too):
    greedy MBPP pass@1 before and after, HumanEval where evaluated."""
    rows = {}
    for name, r in runs.items():
        run, pts = r["run"], curve(r["run"], r["evals"])
        if len(pts) < 2:
            continue
        recipe, seed, command = run["command"][2], run["job"]["seed"], run["command"]
        sets = [
            v for k, v in itertools.pairwise(command) if k == "--set" and v.split("=")[0] not in SEED_KEYS
        ]
        row = {"recipe": recipe, "overrides": sets, "engine": run["engine"], "seed": seed, "run": name}
        row |= {"before": pts[0]["pass@1"], "after": pts[-1]["pass@1"], "steps": pts[-1]["step"]}
        row |= {"wall_s": pts[-1]["wall_s"], "model": run["job"]["model"]["base"]}
        row |= {"humaneval_before": pts[0].get("humaneval"), "humaneval_after": pts[-1].get("humaneval")}
        row["command"] = " ".join(["python", *command])
        prefix = "trl-" if run["engine"] == "trl" else ""
        rows[f"{prefix}{'+'.join([recipe, *sets])}-seed{seed}.json"] = row
    return rows


# Fields in which the runs of one table may differ: the seed, where the job runs and how it is
# batched, its own evaluation (the table evaluates every run alike) and its bookkeeping.
PLACEMENT = ("seed", "data.seed", "distributed.", "overlap.", "optim.micro_batch", "eval", "name", "publish.",
             "logging.", "checkpoint.", "max_attempts")  # fmt: skip


def learning_job(job: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`job`'s fields as flat `a.b` keys, without those in which one table's runs may differ."""
    out: dict[str, Any] = {}
    for key, value in job.items():
        if isinstance(value, dict):
            out |= learning_job(value, f"{prefix}{key}.")
        elif not f"{prefix}{key}".startswith(PLACEMENT):
            out[f"{prefix}{key}"] = value
    return out


def one_job(runs: dict[str, dict[str, Any]]) -> None:
    """Refuse runs of different learning jobs: their means and ratios would mix them silently."""
    (first, r), *rest = runs.items()
    job = learning_job(r["run"]["job"])
    for name, other in rest:
        theirs = learning_job(other["run"]["job"])
        differ = sorted(k for k in job.keys() | theirs.keys() if job.get(k) != theirs.get(k))
        if differ:
            k = differ[0]
            raise SystemExit(
                f"{first} and {name} train different jobs ({k}: {job.get(k)} against {theirs.get(k)}): "
                "table them apart"
            )


def run_table(args: argparse.Namespace) -> None:
    runs = {}
    for d in (d for d in args.runs if (d / "run.json").exists()):
        evals, metrics = common.read_json(d / "evals.json", {}), common.read_jsonl(d / "metrics.jsonl")
        runs[d.name] = {"run": common.read_json(d / "run.json"), "evals": evals, "metrics": metrics}
    if not runs:
        raise SystemExit("no run.json in " + ", ".join(map(str, args.runs)))
    one_job(runs)
    result, means = compare(runs), seed_means(runs)
    text = markdown(result)
    if means:
        result["over_seeds"] = compare(means)
        text += "\nOver seeds (each setting's mean curve):\n\n" + markdown(result["over_seeds"])
    common.dump(args.json, result)
    for file, row in learning_rows(runs).items() if args.learning else ():
        common.dump(args.learning / file, row)
    if args.md:
        args.md.write_text(text)
    print(text)


def main(argv: list[str] | None = None) -> None:
    parser = common.argument_parser(__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    crucible, trl, evaluate, table = (verbs.add_parser(v) for v in ("crucible", "trl", "eval", "table"))
    for p in (crucible, trl):
        common.job_arguments(p)
        common.options(p, out=Path, every=(10, "save the adapter every N steps (and the last)"))
    devices = (None, "CUDA_VISIBLE_DEVICES of each replica, comma-separated")
    common.options(crucible, generator_devices=devices, rows=(256, "rows of each generator"))
    trl.add_argument("--engine", choices=["vllm", "hf"], help="default: vllm on a GPU, hf on a CPU")
    for p in (evaluate, table):
        p.add_argument("runs", type=Path, nargs="+")
    evaluate.add_argument("--tasks", type=int, help="MBPP evaluation problems (default: the job's, all 500)")
    evaluate.add_argument("--humaneval-tasks", type=int, help="HumanEval problems (default: all 164)")
    common.options(evaluate, rows=(256, "rows of the generator"))
    common.options(table, json=Path)
    table.add_argument("--md", type=Path)
    table.add_argument("--learning", type=Path, help="also each run's learning row, in this folder")
    args = parser.parse_args(argv)
    {"crucible": run_crucible, "trl": run_trl, "eval": run_eval, "table": run_table}[args.verb](args)


if __name__ == "__main__":
    main()
