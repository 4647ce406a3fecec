"""The worker's side of a job over several ranks: start them with `torchrun`, wait, report.

The RQ worker that took the job keeps its place in the lifecycle (started, heartbeating, then
finished / failed / released, in `runtime.entry.execute`); the ranks run in a `torchrun` child process
group on this host, rank 0 writing to the job's channel itself. The group is a `standby.Standby`:
one kept waiting for the job (`keep_standby`, its ranks' cold start taken) or one started for it;
a kept one that exits before any of its ranks read the job is replaced by one started for it.
When the worker is asked to stop it writes the ranks' stop file: rank 0 then checkpoints at its
next step boundary and the job goes back to the queue. A rank that dies makes `torchrun` stop the
others (`--max-restarts 0`) and exit non-zero: the job fails, naming the rank and its error; a
retry resumes from the checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from crucible_shared.distributed import too_many_ranks
from crucible_shared.jobs import TrainJob

from crucible_trainer.distributed.rank import ranks_dir
from crucible_trainer.distributed.standby import Standby, group_env
from crucible_trainer.runtime.cancel import Interrupted
from crucible_trainer.runtime.channel import JobChannel
from crucible_trainer.runtime.jobrun import JobRun
from crucible_trainer.settings import Settings

POLL_S = 0.5
log = logging.getLogger(__name__)


class RankFailed(RuntimeError):
    """A rank of the job died or raised: the job failed (`crucible retry` resumes it)."""


class DistributedLaunch(JobRun):
    """The worker's runner of a train job over several ranks (`runners.runner_for`): the job run
    itself (`TrainRun`, as `leader.LeaderRun`) is rank 0's."""

    async def run(self) -> dict[str, Any]:
        return await run_distributed_job(self.spec, self.job_id, self.settings, self.channel)


def available_ranks(settings: Settings) -> int:
    """Ranks this worker may launch for one job: the setting, else its GPU count (1 without)."""
    if settings.max_ranks is not None:
        return settings.max_ranks
    import torch

    return max(1, torch.cuda.device_count())


def standby_size(settings: Settings) -> int:
    """Ranks this worker keeps waiting for its next job (`Settings.standby_ranks`), 0 for none:
    all it can launch, when that is two or more."""
    ranks = available_ranks(settings)
    if ranks < 2 or settings.standby_ranks is False:
        return 0
    if settings.standby_ranks is None:
        import torch

        from crucible_trainer.runtime import warm

        if not (torch.cuda.is_available() and warm.worth_it()):
            return 0
    return ranks


def rank_env(settings: Settings) -> dict[str, str]:
    """The worker's settings as the ranks read them (the environment, never a file in the run dir,
    which the gateway serves: it holds the sandbox key)."""
    env = dict(os.environ)
    for name, value in settings.model_dump().items():
        key = f"CRUCIBLE_TRAINER_{name.upper()}"
        if value is None:
            env.pop(key, None)
        else:
            env[key] = ",".join(value) if isinstance(value, list) else str(value)
    if settings.redis_url is None:  # the worker's choice, not an alias the ranks would find
        env.pop("REDIS_URL", None)
    return group_env(env)


def job_env(settings: Settings, channel: JobChannel) -> dict[str, str]:
    """What the ranks take from the job (`standby.use_job_env`): the Crucible part of `rank_env`,
    and the run's fencing token (rank 0 writes as this run, with its lease, not as a run of its own)."""
    env = {k: v for k, v in rank_env(settings).items() if k.startswith("CRUCIBLE_") or k == "REDIS_URL"}
    return env | {"CRUCIBLE_JOB_LEASE": str(channel.token or "")}


# The group kept waiting for this process's next job of its size (`keep_standby`).
_standby: Standby | None = None


def keep_standby(ranks: int) -> Standby:
    """A group of `ranks` ranks waiting for this process's next job of that size: the one waiting
    already, else a new one (in place of one of another size, or of one that exited)."""
    global _standby
    if _standby is not None and _standby.alive() and _standby.ranks == ranks:
        return _standby
    release_standby()
    _standby = Standby(ranks)
    return _standby


def release_standby() -> None:
    """Stop the waiting group, if any."""
    global _standby
    if _standby is not None:
        _standby.close()
        _standby = None


def take_standby(ranks: int) -> Standby | None:
    """The waiting group, for a job of `ranks` ranks: None if it has another size (it waits on) or
    there is none; one that exited is dropped (the job starts its own)."""
    global _standby
    if _standby is not None and not _standby.alive():
        tail = b"".join(_standby.lines()[-10:]).decode(errors="replace")
        log.warning("standby ranks exited (code %s) before their job:\n%s", _standby.proc.returncode, tail)
        release_standby()
    if _standby is None or _standby.ranks != ranks:
        return None
    taken, _standby = _standby, None
    return taken


async def run_distributed_job(
    spec: TrainJob, job_id: str, settings: Settings, channel: JobChannel
) -> dict[str, Any]:
    """Run `spec` over `spec.distributed.train_gpus` ranks; the summary rank 0 returned."""
    asked, available = spec.distributed.train_gpus, available_ranks(settings)
    if asked > available:
        raise ValueError(too_many_ranks(asked, available))
    folder = ranks_dir(Path(settings.runs_dir) / job_id)
    if folder.exists():  # an earlier attempt's outcome must not pass for this one's
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    env = job_env(settings, channel)
    kept = take_standby(asked)
    group = kept or Standby(asked, (job_id, spec_path, env))
    # Without Redis (`crucible train --local`) rank 0 prints its events: shown as the job's.
    events = channel if not settings.redis_url else None
    with open(folder / "torchrun.log", "wb") as sink:
        try:
            if group.waiting:
                group.hand_over(job_id, spec_path, env)
            await supervise(group, folder, sink, events, channel)
            asked_to_end = channel.stop_requested() or channel.cancel_requested()
            if (
                group is kept
                and group.proc.returncode != 0
                and not job_taken(folder, asked)
                and not asked_to_end
            ):
                # The kept group died after it was taken and before any rank read the job (killed
                # while it waited): nothing of the job ran, so it runs on ranks started for it, as
                # it would have without a group kept waiting.
                note = f"standby ranks exited (code {group.proc.returncode}) before taking the job: starting ranks for it"
                log.warning("%s: %s", job_id, note)
                sink.write(f"{note}\n".encode())
                group.close()
                group = Standby(asked, (job_id, spec_path, env))
                await supervise(group, folder, sink, events, channel)
        finally:
            group.close()  # with the ranks, if the worker itself is going away
    code = group.proc.returncode
    result = folder / "result.json"
    if code != 0 or not result.exists():
        raise RankFailed(describe_failure(folder, asked, code))
    outcome = json.loads(result.read_text())
    if outcome["status"] == "interrupted":
        raise Interrupted(outcome["step"])
    return outcome["summary"]


async def supervise(
    group: Standby, folder: Path, sink: Any, events: JobChannel | None, channel: JobChannel
) -> None:
    """Until `group` exits: its output to `sink` (rank 0's events to `events`), the job file removed
    once read, and the worker's stop and cancel requests passed on as files in the ranks' `folder`."""
    while group.alive():
        relay(group.lines(), sink, events)
        group.drop_job_file(folder)
        if channel.stop_requested():
            (folder / "stop").touch()
        if channel.cancel_requested():
            (folder / "cancel").touch()
        await asyncio.sleep(POLL_S)
    # Off the event loop, and bounded: a child that outlived its rank may hold the pipe.
    await asyncio.to_thread(group.reader.join, 30)
    relay(group.lines(), sink, events)


def job_taken(folder: Path, ranks: int) -> bool:
    """Whether any rank read the job (each writes its pid file in the ranks' `folder` right after)
    or its outcome was written."""
    return (folder / "result.json").exists() or any((folder / f"rank-{r}.pid").exists() for r in range(ranks))


def relay(lines: Iterable[bytes], sink: Any, channel: JobChannel | None) -> None:
    """Copy torchrun's output to its log file `sink`; pass rank 0's event lines on to `channel`."""
    for line in lines:
        sink.write(line)
        sink.flush()
        # Another thread's progress bar on stderr (redrawn after a `\r`, no newline yet) can share
        # the event's line: the event is what follows the bar's last redraw.
        line = line.rsplit(b"\r", 1)[-1]
        if channel is not None and line.startswith(b"{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict) or not isinstance(record.get("type"), str):
                continue
            kind = record.pop("type")
            record.pop("time", None)
            try:
                channel.emit(kind, **record)
            except Exception as exc:  # showing an event must never fail the job
                log.warning("could not relay rank 0's %s event: %r", kind, exc)


def describe_failure(folder: Path, ranks: int, code: int | None) -> str:
    """Which rank failed and why. A rank killed by a signal writes nothing, the ranks that were
    talking to it fail too ("connection closed") and torchrun stops the rest with SIGTERM: a rank
    killed by another signal is the cause, else torchrun's root cause, else the first rank that
    wrote an error."""
    log = folder / "torchrun.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    failures = torchrun_failures(text)
    root = torchrun_failures(text[text.find("Root Cause") :]) if "Root Cause" in text else {}
    written = [r for r in range(ranks) if (folder / f"rank-{r}.error").exists()]
    killed = [r for r, (exit_code, _) in failures.items() if exit_code < 0 and exit_code != -15]
    candidates = [*killed, *root, *written, *failures]
    rank = candidates[0] if candidates else None
    if rank is not None and rank in written and rank not in killed:
        detail = (folder / f"rank-{rank}.error").read_text().splitlines()[0]
    elif rank is not None and rank in failures:
        exit_code, lines = failures[rank]
        detail = "; ".join([f"exit code {exit_code}", *lines])
    else:
        detail = f"torchrun exited with {code}"
    who = f"rank {rank} of {ranks}" if rank is not None else f"a rank of {ranks}"
    return f"{who} failed: {detail} (log: {log})"


def torchrun_failures(text: str) -> dict[int, tuple[int, list[str]]]:
    """The failed ranks torchrun's summary lists: rank -> (exit code, its traceback line)."""
    out: dict[int, tuple[int, list[str]]] = {}
    for rank, exit_code, rest in re.findall(
        r"^[ \t]*rank[ \t]*:[ \t]*(\d+).*?exitcode[ \t]*:[ \t]*(-?\d+)(.*?)(?=\n\[\d+\]:|\n-{5,}|\n={5,}|\Z)",
        text,
        re.S | re.M,
    ):
        lines = [ln.strip() for ln in rest.splitlines() if ln.strip().startswith("traceback")]
        out.setdefault(int(rank), (int(exit_code), lines))
    return out
