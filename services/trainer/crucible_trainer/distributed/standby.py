"""Standby ranks: a `torchrun` group started before its job, so that each rank's cold start (the
imports of torch, transformers, PEFT and the trainer, and its CUDA context: 16-22 s on an H200)
is over by the time the job comes, as the worker's own warm-up (`runtime.warm`) is for one rank.

Every job of several ranks runs through a `Standby` (`launch.run_distributed_job`): one the
worker kept waiting (`launch.keep_standby`), else one started for the job with `--job-id/--spec`,
as ranks always were.
The ranks start with `--standby DIR`, a private folder (0700: the job file holds the sandbox key);
each takes its cold start (`cold_start`), then polls DIR/job.json, which the launcher writes in
one piece: the job's id, its spec's path and the job's environment (the worker's settings and its
lease, `launch.job_env`), and removes once every rank has read it. A rank swaps its own CRUCIBLE_* and REDIS_URL for the job's, keeping
torchrun's (RANK, MASTER_ADDR...), and runs the job as a rank launched for it does (`rank.main`).
A waiting rank whose worker is gone (killed outright) exits rather than hold its card.

The group's output is read by a thread from its start and queued; the launcher writes it, the
lines from before the job first, to the job's `ranks/torchrun.log`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import MutableMapping
from pathlib import Path

from crucible_trainer.runtime.atomic import output_file

POLL_S = 0.1  # how often a waiting rank looks for its job
JOB_FILE = "job.json"


def torchrun_command(ranks: int, *rank_args: str) -> list[str]:
    """`torchrun` starting `ranks` ranks of `crucible_trainer.distributed.rank` with `rank_args`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        "-m",
        "crucible_trainer.distributed.rank",
        *rank_args,
    ]


def group_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with what every rank needs whatever the job: one OpenMP thread per rank and the NVLink
    multicast guards (docs/deploy.md), unless `env` says otherwise."""
    env.setdefault("OMP_NUM_THREADS", "1")
    for guard in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        env.setdefault(guard, "0" if guard == "NCCL_NVLS_ENABLE" else "1")
    return env


class Standby:
    """A `torchrun` group of `ranks` ranks: waiting in `self.dir` for the job `hand_over` gives it, or,
    given `job` (its id, spec path and environment), started for that job as ranks were before any
    waited: no folder, no job file, the job's settings in their environment from the start."""

    def __init__(self, ranks: int, job: tuple[str, Path, dict[str, str]] | None = None) -> None:
        self.ranks = ranks
        env = dict(os.environ)
        self.dir: Path | None = None
        if job is None:
            self.dir = Path(tempfile.mkdtemp(prefix="crucible-ranks-"))  # mode 0700
            args: tuple[str, ...] = ("--standby", str(self.dir), "--owner", str(os.getpid()))
        else:
            args = ("--job-id", job[0], "--spec", str(job[1]))
            use_job_env(env, job[2])
        try:
            self.proc = subprocess.Popen(
                torchrun_command(ranks, *args),
                env=group_env(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one
            )
        except BaseException:
            self.close()
            raise
        self.waiting = job is None  # until `hand_over`
        self.job_file_kept = False  # from `hand_over` until every rank has read it
        self.output: queue.Queue[bytes] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="standby-ranks-output", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                self.output.put(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Whether every waiting rank has taken its cold start."""
        return self.dir is not None and all((self.dir / f"ready-{r}").exists() for r in range(self.ranks))

    def hand_over(self, job_id: str, spec: Path, env: dict[str, str]) -> None:
        """Give the waiting ranks their job: written whole (a rank never reads half of it)."""
        assert self.dir is not None and self.waiting, "a group started for its job takes no other"
        with output_file(self.dir / JOB_FILE) as tmp:
            tmp.write_text(json.dumps({"job_id": job_id, "spec": str(spec), "env": env}))
        self.waiting, self.job_file_kept = False, True

    def drop_job_file(self, ranks_folder: Path) -> None:
        """Remove the job file (it holds the sandbox key) once every rank has read it: each writes
        its pid file in the job's `ranks_folder` right after. Looks no more once it is gone."""
        if self.dir is None or not self.job_file_kept:
            return
        if all((ranks_folder / f"rank-{r}.pid").exists() for r in range(self.ranks)):
            (self.dir / JOB_FILE).unlink(missing_ok=True)
            self.job_file_kept = False

    def lines(self) -> list[bytes]:
        """The output lines read since the last call (all of them once the group has exited and
        `self.reader` is joined)."""
        out = []
        while not self.output.empty():
            out.append(self.output.get_nowait())
        return out

    def close(self) -> None:
        """Stop the group if it still runs (with the ranks' whole process group) and remove its folder."""
        proc = getattr(self, "proc", None)  # none when it could not start
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


# -- a rank's side ------------------------------------------------------------------------------


def await_job(folder: Path, owner: int | None) -> tuple[str, Path, float]:
    """Take the cold start, then wait for the job in `folder`: its id, its spec's path, and how long
    this rank had been ready when it came (s). The job's environment is this process's from then on."""
    cold_start()
    ready = time.time()
    (folder / f"ready-{os.environ.get('RANK', '0')}").touch()
    job_file = folder / JOB_FILE
    while not job_file.exists():
        if owner is not None and not _alive(owner):
            raise SystemExit(0)  # the worker is gone: no job will come
        time.sleep(POLL_S)
    job = json.loads(job_file.read_text())
    use_job_env(os.environ, job["env"])
    return job["job_id"], Path(job["spec"]), max(0.0, job_file.stat().st_mtime - ready)


def use_job_env(env: MutableMapping[str, str], job: dict[str, str]) -> None:
    """Replace `env`'s Crucible settings (CRUCIBLE_*, REDIS_URL) with the job's; the rest (torchrun's
    RANK, WORLD_SIZE, MASTER_ADDR..., CUDA_VISIBLE_DEVICES) stays."""
    for key in [k for k in env if k.startswith("CRUCIBLE_") or k == "REDIS_URL"]:
        del env[key]
    env.update(job)


def cold_start() -> None:
    """What a rank does before any job: the job's imports (`warm.warm_up`) and torch.distributed,
    and its card's CUDA context. A failure only prints: the job meets it again and reports it."""
    try:
        import torch
        import torch.distributed

        from crucible_trainer.distributed import leader, parallel, ranks  # noqa: F401
        from crucible_trainer.runtime import warm

        warm.warm_up(None)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.ones(1, device="cuda").add_(1)
    except Exception as exc:
        print(f"standby rank: cold start stopped: {exc!r}", file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: taken as alive
        pass
    return True
