"""The CPU stack under Docker Compose, for real: build every image, start the stack from
compose.yaml + compose.cpu.yaml as docs/deploy.md tells users, run the demo GRPO job through the
gateway, then break things and check the stack copes. `make compose-test` runs it; it needs a
Docker engine with Compose v2.24+ and takes about half an hour on 2 cores.

Phases (each timed; figures go to runs/compose-test/summary.json):

1. build: every CPU image (and the CUDA trainer with --gpu-images; the vLLM image needs its
   vllm/vllm-openai base from a registry and is skipped when that cannot be had), image sizes;
2. up: `docker compose up -d --build --wait`, every service healthy;
3. sandbox: isolation reported by /health, hostile programs of tests/integration through
   sandbox-lb, every language of the image through `POST /run_code` (and a C++ stdio suite), what
   a run can see inside its container, and the privileged isolation modes of
   docs/deploy.md started from the same image;
4. job: the demo GRPO job over the gateway with an API key, followed over SSE; every adapter
   version seen in the generator (GET /v1/models while the job runs, and its log); the
   before/after report downloaded through the artifacts API;
5. faults: `docker compose restart trainer` mid-job, `docker compose restart redis`, a sandbox
   replica killed under load, `docker compose up --scale sandbox=3`;
6. down: `docker compose down -v` (not with --keep).

Any failure prints `docker compose ps` and the logs of the containers that are not healthy (or
of every service), then tears the stack down and exits 1.

`--languages-only URL` runs only phase 3's language checks against one sandbox container started by
hand (the API key in CRUCIBLE_SANDBOX_API_KEY), for checking an image without the whole stack.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from crucible_cli.stack_cmd import DEMO_JOB  # noqa: E402
from crucible_sandbox.judging.languages import SUM_OF_TWO as SUM  # noqa: E402
from crucible_shared.gateway_client import GatewayClient, GatewayError  # noqa: E402

from tests.integration.test_sandbox_isolation import BENIGN, HOSTILE, LIMITS  # noqa: E402

CPU_FILES = ["-f", "compose.yaml", "-f", "compose.cpu.yaml"]
CPU_IMAGES = ["gateway", "sandbox", "generator", "trainer"]
# Passed from the caller's environment to compose: base images, package sources (docs/deploy.md).
PASSTHROUGH = (
    "PYTHON_IMAGE",
    "REDIS_IMAGE",
    "SANDBOX_LB_IMAGE",
    "INIT_IMAGE",
    "PIP_INDEX_URL",
    "PIP_TRUSTED_HOST",
    "PIP_NO_INDEX",
    "PIP_CA_BUNDLE",
    "TORCH_CPU_INDEX_URL",
)
# The reduced mode (no uid of its own per run) lets a run signal its zygote: the worker answers
# sandbox_error ("retry the run"), never a verdict. The isolation tests run as root expect `error`.
# Its scratch is the container's /tmp (512 MB), which a disk-filling run may not fill within its
# wall time (the run's directory is removed afterwards either way).
REDUCED_MODE_ALLOWED = {"kill_parent": {"error", "sandbox_error"}, "disk_fill": {"error", "timeout"}}
LOCAL_BASE = {
    "INIT_IMAGE": "crucible-base/debian:bookworm",
    "PYTHON_IMAGE": "crucible-base/python:3.11-bookworm",
    "REDIS_IMAGE": "crucible-base/redis:7.0-bookworm",
    "SANDBOX_LB_IMAGE": "crucible-base/haproxy:2.6-bookworm",
}


class Failed(Exception):
    """A check failed; the message says which."""


def log(message: str) -> None:
    print(f"[compose-test {time.strftime('%H:%M:%S')}] {message}", flush=True)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Compose:
    """`docker compose` for one project, with the test's env file."""

    def __init__(self, project: str, env_file: Path) -> None:
        self.project, self.env_file = project, env_file

    def command(self, *args: str, files: list[str] = CPU_FILES) -> list[str]:
        return ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file), *files, *args]

    def run(
        self, *args: str, files: list[str] = CPU_FILES, timeout: float = 1800, quiet: bool = False
    ) -> str:
        command = self.command(*args, files=files)
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            if not quiet:
                print(result.stdout[-4000:], result.stderr[-8000:], sep="\n", file=sys.stderr)
            raise Failed(f"`{' '.join(command[6:])}` exited {result.returncode}")
        return result.stdout

    def containers(self, service: str) -> list[dict[str, Any]]:
        out = self.run("ps", "--format", "json", service)
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return sorted(rows, key=lambda r: r["Name"])

    def health(self, service: str) -> list[str]:
        return [c.get("Health") or c.get("State") for c in self.containers(service)]

    def wait_healthy(self, service: str, count: int, timeout: float = 600) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            states = self.health(service)
            if len(states) == count and all(s == "healthy" for s in states):
                return time.monotonic() - started
            time.sleep(2)
        raise Failed(
            f"{service}: not {count} healthy containers after {timeout:.0f} s: {self.health(service)}"
        )

    def logs(self, *services: str, tail: int = 200) -> str:
        result = subprocess.run(
            self.command("logs", "--no-color", "--tail", str(tail), *services),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return result.stdout + result.stderr

    def dump(self) -> None:
        """What a person debugging the failure needs: states, then the logs of broken containers."""
        print(self.run("ps", "-a", quiet=True), file=sys.stderr)
        rows = [json.loads(line) for line in self.run("ps", "-a", "--format", "json").splitlines() if line]
        broken = sorted(
            {
                r["Service"]
                for r in rows
                if (r.get("Health") or "healthy") != "healthy" or r["State"] != "running"
            }
            - {"volumes-init"}
        )
        for service in broken or sorted({r["Service"] for r in rows}):
            print(f"===== logs of {service} =====\n{self.logs(service)}", file=sys.stderr)


def docker(*args: str, timeout: float = 600) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise Failed(f"`docker {' '.join(args)}` failed: {result.stderr.strip()[-2000:]}")
    return result.stdout


def image_size_mb(image: str) -> float:
    return round(int(docker("image", "inspect", "-f", "{{.Size}}", image).strip()) / 1e6)


# -- phases ---------------------------------------------------------------------------------------


def build(compose: Compose, summary: dict, gpu_images: bool) -> None:
    images = summary.setdefault("images", {})
    for service in CPU_IMAGES:
        started = time.monotonic()
        compose.run("build", service)
        image = next(
            c["image"]
            for n, c in json.loads(compose.run("config", "--format", "json"))["services"].items()
            if n == service
        )
        images[image] = {"build_s": round(time.monotonic() - started), "size_mb": image_size_mb(image)}
        log(f"built {image} in {images[image]['build_s']} s ({images[image]['size_mb']} MB)")
    if not gpu_images:
        return
    started = time.monotonic()
    compose.run("build", "trainer", files=["-f", "compose.yaml"])
    images["crucible/trainer:0.1.0"] = {
        "build_s": round(time.monotonic() - started),
        "size_mb": image_size_mb("crucible/trainer:0.1.0"),
    }
    torch = docker(
        "run", "--rm", "crucible/trainer:0.1.0", "python", "-c", "import torch; print(torch.__version__)"
    )
    images["crucible/trainer:0.1.0"]["torch"] = torch.strip()
    check(
        "+cpu" not in torch, f"the CUDA trainer got a CPU torch ({torch.strip()}): is it in deploy/wheels/?"
    )
    log(f"built the CUDA trainer: {images['crucible/trainer:0.1.0']}")
    try:
        compose.run("build", "generator", files=["-f", "compose.yaml"], quiet=True)
        images["crucible/generator-vllm:0.1.0"] = {"size_mb": image_size_mb("crucible/generator-vllm:0.1.0")}
    except Failed:
        summary["skipped"] = ["crucible/generator-vllm: its base vllm/vllm-openai could not be pulled"]
        log("skipped the vLLM image: its base image could not be pulled")


def up(compose: Compose, summary: dict, replicas: int) -> None:
    started = time.monotonic()
    compose.run("up", "-d", "--build", "--wait", "--wait-timeout", "900")
    summary["up_s"] = round(time.monotonic() - started)
    for service, count in (("redis", 1), ("gateway", 1), ("sandbox", replicas), ("sandbox-lb", 1)):
        check(compose.health(service) == ["healthy"] * count, f"{service}: {compose.health(service)}")
    check(compose.health("generator") == ["healthy"] and compose.health("trainer") == ["healthy"], "models")
    log(f"stack healthy in {summary['up_s']} s")


def run_batch(url: str, key: str, runs: list[dict], timeout: float = 300) -> list[dict]:
    r = httpx.post(
        f"{url}/v1/runs/batch",
        json={"runs": runs},
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )
    check(r.status_code == 200, f"sandbox batch: {r.status_code} {r.text[:500]}")
    return r.json()["results"]


def program(body: str) -> dict:
    """A run whose `f()` prints what it found (as JSON) and returns it."""
    code = "import json, os, socket\ndef f():\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return {
        "code": code,
        "tests": {"kind": "asserts", "asserts": ["assert f() == 'never'"]},
        "limits": {"wall_time_s": 30, "test_time_s": 20},
        "use_cache": False,
    }


def found(result: dict) -> Any:
    """What `program` printed."""
    check(result["status"] == "failed", f"probe did not run: {result['status']} {result.get('message')}")
    return json.loads(result["stdout"].strip().splitlines()[-1])


PROBES = {
    "identity": program(
        "s = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "out = {'uid': os.getuid(), 'cap_eff': s['CapEff'].strip(), 'no_new_privs': s['NoNewPrivs'].strip(),\n"
        "       'seccomp': s['Seccomp'].strip(), 'cwd': os.getcwd(),\n"
        "       'tmp_free_mb': os.statvfs('/tmp').f_bavail * os.statvfs('/tmp').f_frsize // 2**20}\n"
        "print(json.dumps(out)); return out"
    ),
    "server_environment": program(
        "hits = []\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n        try:\n"
        "            if b'CRUCIBLE_SANDBOX_API_KEYS' in open(f'/proc/{p}/environ', 'rb').read():\n"
        "                hits.append(int(p))\n        except OSError:\n            pass\n"
        "print(json.dumps(hits)); return hits"
    ),
    "write_root": program(
        "try:\n    open('/opt/venv/x', 'w')\n    out = 'written'\nexcept OSError as e:\n    out = e.strerror\n"
        "print(json.dumps(out)); return out"
    ),
    "exec_from_tmp": program(
        "p = os.path.join(os.environ['TMPDIR'], 'x')\nopen(p, 'w').write('#!/bin/sh\\nexit 0\\n')\n"
        "os.chmod(p, 0o755)\nimport subprocess\ntry:\n    subprocess.run([p])\n    out = 'executed'\n"
        "except OSError as e:\n    out = e.strerror\nprint(json.dumps(out)); return out"
    ),
    # Name look-ups in threads: on an internal network an outside name may get no answer at all.
    "names": program(
        "import threading\nout = {}\ndef look(name):\n    try:\n        socket.getaddrinfo(name, 80)\n"
        "        out[name] = 'resolved'\n    except OSError:\n        out[name] = 'unresolved'\n"
        "names = ('redis', 'gateway', 'trainer', 'pypi.org')\n"
        "threads = [threading.Thread(target=look, args=(n,), daemon=True) for n in names]\n"
        "for t in threads:\n    t.start()\nfor t in threads:\n    t.join(8)\n"
        "out = {n: out.get(n, 'no answer') for n in names}\nprint(json.dumps(out)); return out"
    ),
}


# Reward hacks of tests/integration/test_sandbox_isolation.py: none may pass.
REWARD_HACKS = {
    "sys.exit": "import sys\nsys.exit(0)\ndef add(a, b): return 0\n",
    "os._exit-in-test": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "eq-always-true": "def add(a, b):\n    class Yes:\n        def __eq__(self, other): return True\n    return Yes()\n",
    "print-pass": "print('PASS')\nprint('all tests passed')\ndef add(a, b): return 0\n",
    "patch-builtins": "import builtins\nbuiltins.AssertionError = type('Nope', (Exception,), {})\ndef add(a, b): return 0\n",
}


def reward_hacks(url: str, key: str) -> dict[str, str]:
    tests = {"kind": "asserts", "asserts": ["assert add(2, 2) == 4", "assert add(1, 1) == 2"]}
    runs = [{"code": code, "tests": tests, "use_cache": False} for code in REWARD_HACKS.values()]
    results = run_batch(url, key, runs)
    for name, result in zip(REWARD_HACKS, results, strict=True):
        check(result["status"] != "passed" and result["passed"] == 0, f"reward hack {name} passed: {result}")
    return {name: r["status"] for name, r in zip(REWARD_HACKS, results, strict=True)}


def probe_all(url: str, key: str) -> dict[str, Any]:
    results = run_batch(url, key, list(PROBES.values()))
    return {name: found(r) for name, r in zip(PROBES, results, strict=True)}


def languages(url: str, key: str) -> dict[str, Any]:
    """Every language of the image listed by /health and run once through `POST /run_code`; a C++
    program judged by stdin/stdout cases through `/v1/runs`. Returns each one's status and seconds."""
    # One program per language of the image (SUM: each reads two numbers and prints their sum)
    # through SandboxFusion's `POST /run_code`, so a toolchain that is present but cannot compile or
    # run inside a run's isolation (a path outside its root, a refused system call) fails here
    # rather than in a training job.
    listed = httpx.get(f"{url}/health", timeout=10).json()["languages"]
    check(set(SUM) <= set(listed), f"/health lists {listed}, not every language of {sorted(SUM)}")
    headers = {"Authorization": f"Bearer {key}"}
    out: dict[str, Any] = {}
    for lang, code in SUM.items():
        body = {"language": lang, "code": code, "stdin": "20 22", "compile_timeout": 60, "run_timeout": 20}
        started = time.monotonic()
        r = httpx.post(f"{url}/run_code", json=body, headers=headers, timeout=300)
        check(r.status_code == 200, f"/run_code {lang}: {r.status_code} {r.text[:500]}")
        answer = r.json()
        stdout = (answer.get("run_result") or {}).get("stdout", "")
        check(
            answer["status"] == "Success" and stdout.strip() == "42",
            f"/run_code {lang}: {json.dumps(answer)[:1500]}",
        )
        out[lang] = {"status": answer["status"], "s": round(time.monotonic() - started, 2)}
    stdio = {
        "language": "cpp",
        "code": SUM["cpp"],
        "tests": {
            "kind": "stdio",
            "cases": [{"input": "1 2", "output": "3"}, {"input": "-5 5", "output": "0"}],
        },
        "limits": {"compile_time_s": 60},
        "use_cache": False,
    }
    result = run_batch(url, key, [stdio])[0]
    check(result["status"] == "passed" and result["passed"] == 2, f"/v1/runs cpp stdio: {result}")
    out["cpp_stdio"] = {"status": result["status"], "passed": result["passed"]}
    return out


def hostile_verdicts(results: list[dict]) -> tuple[dict[str, str], list[str]]:
    """Each hostile program's status, and what is wrong: a hostile program not contained the way
    its entry allows (any containment of a fork bomb), or a benign run beside one that did not pass.
    `results` alternate hostile and benign runs, in `HOSTILE`'s order."""
    statuses, problems = {}, []
    for i, (name, (_, _, allowed)) in enumerate(HOSTILE.items()):
        hostile, benign = results[2 * i], results[2 * i + 1]
        statuses[name] = hostile["status"]
        if hostile["status"] not in REDUCED_MODE_ALLOWED.get(name, allowed):
            problems.append(f"hostile {name}: {hostile['status']} {hostile.get('message')}")
        if benign["status"] != "passed":
            problems.append(f"benign run beside {name}: {benign}")
    return statuses, problems


def sandbox(compose: Compose, summary: dict, env: dict[str, str]) -> None:
    url, key = f"http://127.0.0.1:{env['SANDBOX_HOST_PORT']}", env["CRUCIBLE_TRAINER_SANDBOX_API_KEY"]
    health = httpx.get(f"{url}/health", timeout=10).json()
    isolation = health["isolation"]
    summary["sandbox_isolation"] = isolation
    check(isolation["mode"] == "reduced", f"an unprivileged container runs the reduced mode: {isolation}")
    hostile = [{"code": c, "tests": t, "limits": LIMITS, "use_cache": False} for c, t, _ in HOSTILE.values()]
    runs = [run for i, h in enumerate(hostile) for run in (h, BENIGN[i % len(BENIGN)])]
    statuses, problems = hostile_verdicts(run_batch(url, key, runs))
    check(not problems, "; ".join(problems))
    summary["sandbox_hostile"] = statuses
    summary["sandbox_reward_hacks"] = reward_hacks(url, key)
    summary["sandbox_languages"] = languages(url, key)
    log(f"sandbox languages: {summary['sandbox_languages']}")
    compose.wait_healthy("sandbox", int(env["SANDBOX_REPLICAS"]), timeout=120)
    seen = probe_all(url, key)
    summary["sandbox_inside_container"] = seen
    identity = seen["identity"]
    check(identity["uid"] == 10002 and int(identity["cap_eff"], 16) == 0, f"unprivileged: {identity}")
    check(
        identity["no_new_privs"] == "1" and identity["seccomp"] == "2", f"no_new_privs, seccomp: {identity}"
    )
    check(seen["write_root"] == "Read-only file system", f"root filesystem: {seen['write_root']}")
    check(identity["tmp_free_mb"] > 400, f"what hostile runs wrote to /tmp was not removed: {identity}")
    check(seen["exec_from_tmp"] == "Permission denied", f"noexec /tmp: {seen['exec_from_tmp']}")
    check("resolved" not in seen["names"].values(), f"only sandbox-lb is reachable: {seen['names']}")
    log(f"sandbox: reduced mode, {len(HOSTILE)} hostile programs contained; inside: {seen}")
    summary["sandbox_modes"] = privileged_modes(env)


# The privileges docs/deploy.md gives for the stronger isolation modes.
MODES = {
    "uid": ["SETUID", "SETGID", "KILL", "CHOWN", "FOWNER", "DAC_OVERRIDE"],
    # SYS_CHROOT: Docker's seccomp refuses pivot_root, so the zygote enters its root with chroot.
    "full": ["SYS_ADMIN", "SYS_CHROOT", "SETUID", "SETGID", "KILL", "CHOWN", "FOWNER", "DAC_OVERRIDE"],
}


def privileged_modes(env: dict[str, str]) -> dict[str, Any]:
    """The sandbox image as root with the capabilities of each mode, under Docker's default seccomp."""
    image = f"crucible/sandbox:{env.get('CRUCIBLE_TAG', '0.1.0')}"
    key = env["CRUCIBLE_TRAINER_SANDBOX_API_KEY"]
    out = {}
    for mode, caps in MODES.items():
        port = free_port()
        name = f"crucible-compose-test-sandbox-{mode}"
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
        docker(
            "run", "-d", "--name", name, "--user", "0:0", "--read-only", "--cap-drop", "ALL",
            *[a for c in caps for a in ("--cap-add", c)],
            "--security-opt", "no-new-privileges:true", "--pids-limit", "512",
            "--tmpfs", "/tmp:size=512m,mode=1777,noexec,nosuid,nodev",
            "-e", f"CRUCIBLE_SANDBOX_API_KEYS={key}", "-e", "CRUCIBLE_SANDBOX_WORKERS=2",
            "-p", f"127.0.0.1:{port}:8002", image,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    isolation = httpx.get(f"{url}/health", timeout=5).json()["isolation"]
                    break
                except (httpx.HTTPError, ValueError):
                    check(time.monotonic() < deadline, f"{mode}: no /health: {docker('logs', name)[-2000:]}")
                    time.sleep(1)
            seen = probe_all(url, key)
            out[mode] = {"health": isolation, "inside": seen}
            check(isolation["uid_switch"] and seen["identity"]["uid"] != 0, f"{mode}: runs switch uid")
            check(seen["server_environment"] == [], f"{mode}: the server's environment is hidden from runs")
            if mode == "full":
                check(
                    isolation["mode"] == "full", f"full mode under the default seccomp profile: {isolation}"
                )
            log(f"sandbox as root with {caps}: mode {isolation['mode']}")
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    return out


class AdapterWatch(threading.Thread):
    """Polls the generator's model list while a job runs: the trainer unloads adapters at the end."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.seen, self.stopped = url, set(), threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stopped.is_set():
                try:
                    self.seen |= {m["id"] for m in http.get(f"{self.url}/v1/models").json()["data"]}
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                self.stopped.wait(0.5)


def follow(client: GatewayClient, job_id: str, on_event: Any = None) -> list[tuple[str, dict]]:
    """(event, data) of a job's SSE stream until it ends, reconnecting after the last id if cut."""
    events, last = [], None
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        try:
            for event_id, event, data in client.events(job_id, last_event_id=last, timeout=900):
                last = event_id or last
                events.append((event, data))
                if on_event:
                    on_event(event, data)
                if event == "end":
                    return events
        except GatewayError as exc:  # the gateway or Redis restarting under us
            if 0 < exc.status < 500:
                raise
            log(f"event stream cut ({exc}); reconnecting")
            time.sleep(2)
    raise Failed(f"{job_id}: no end event within an hour")


def job(compose: Compose, summary: dict, env: dict[str, str], out_dir: Path) -> str:
    gateway = f"http://127.0.0.1:{env['GATEWAY_HOST_PORT']}"
    key = env["CRUCIBLE_GATEWAY_API_KEYS"].split(",")[0]
    r = httpx.post(f"{gateway}/v1/jobs", json=DEMO_JOB, timeout=30)
    check(r.status_code == 401, f"a job without a key must be refused, got {r.status_code}")
    watch = AdapterWatch(f"http://127.0.0.1:{env['GENERATOR_HOST_PORT']}")
    watch.start()
    started = time.monotonic()
    with GatewayClient(gateway, api_key=key, timeout=60) as client:
        created = client.submit(DEMO_JOB)
        log(f"submitted {created.id}")
        events = follow(client, created.id, lambda e, d: log(f"  {e} {_brief(d)}"))
        watch.stopped.set()
        record = client.job(created.id)
        check(record.status.value == "finished", f"{created.id}: {record.status.value} {record.error}")
        published = [d["name"] for e, d in events if e == "adapter_published"]
        check(len(published) == DEMO_JOB["optim"]["steps"], f"one adapter version per step: {published}")
        generator_log = compose.logs("generator", tail=2000)
        for name in published:
            check(
                name in watch.seen,
                f"{name} never listed by the generator's /v1/models ({sorted(watch.seen)})",
            )
            check(f"loaded LoRA adapter {name}" in generator_log, f"{name} not in the generator's log")
        artifacts = {a.path: a.size for a in client.artifacts(created.id).artifacts}
        report = {}
        for path in ("eval/before/report.json", "eval/after/report.json", "eval/before_after/comparison.md"):
            check(path in artifacts, f"artifact {path} missing: {sorted(artifacts)}")
            body = client.download(created.id, path)
            check(len(body) == artifacts[path], f"{path}: {len(body)} bytes, listed {artifacts[path]}")
            (out_dir / path.replace("/", "_")).write_bytes(body)
            if path.endswith(".json"):
                report[path.split("/")[1]] = json.loads(body)
    duration = round(time.monotonic() - started)
    evals = {e["label"]: e for _, e in ((ev, d) for ev, d in events if ev == "eval_finished")}
    summary["job"] = {
        "id": created.id,
        "status": record.status.value,
        "duration_s": duration,
        "adapters_hot_swapped": published,
        "pass@1": {
            label: {k: evals[label].get(k) for k in ("greedy_pass@1", "pass@1")}
            for label in ("before", "after")
        },
        "reports": sorted(report),
    }
    log(f"job {created.id} finished in {duration} s; adapters {published} seen in the generator")
    return created.id


def _brief(data: dict) -> str:
    keep = ("status", "step", "name", "label", "greedy_pass@1", "pass@1", "attempt", "reason", "error")
    return json.dumps({k: data[k] for k in keep if k in data})


def restart_trainer(compose: Compose, summary: dict, env: dict[str, str]) -> None:
    """`docker compose restart trainer` mid-job: the job resumes (or fails visibly and retries)."""
    gateway = f"http://127.0.0.1:{env['GATEWAY_HOST_PORT']}"
    key = env["CRUCIBLE_GATEWAY_API_KEYS"].split(",")[0]
    spec = {**DEMO_JOB, "name": "restart-trainer", "optim": {**DEMO_JOB["optim"], "steps": 3}, "eval": None}
    with GatewayClient(gateway, api_key=key, timeout=60) as client:
        created = client.submit(spec)
        restarted = threading.Event()
        started = time.monotonic()

        def on_event(event: str, data: dict) -> None:
            log(f"  {event} {_brief(data)}")
            if event == "metrics" and data.get("step") == 1 and not restarted.is_set():
                restarted.set()
                threading.Thread(target=lambda: _restart(compose), daemon=True).start()

        follow(client, created.id, on_event)
        record = client.job(created.id)
        events = follow(client, created.id)  # the job's history, as a new client replays it
    names = [e for e, _ in events]
    outcome = {
        "status": record.status.value,
        "attempts": record.attempts,
        "error": record.error,
        "events": [e for e in names if e in ("requeued", "resumed", "status")],
        "duration_s": round(time.monotonic() - started),
    }
    summary.setdefault("faults", {})["restart_trainer"] = outcome
    check(restarted.is_set(), "the trainer was never restarted (no step-1 metrics)")
    check(record.status.value == "finished", f"after a trainer restart: {outcome}")
    steps = sorted({d["step"] for e, d in events if e == "metrics"})
    check(steps == [1, 2, 3], f"every step ran exactly once as the run's history shows: {steps}")
    log(f"trainer restart mid-job: {outcome}")


def _restart(compose: Compose) -> None:
    log("docker compose restart trainer")
    started = time.monotonic()
    compose.run("restart", "trainer")
    log(f"trainer restarted in {time.monotonic() - started:.0f} s")


def restart_redis(compose: Compose, summary: dict, env: dict[str, str], job_id: str) -> None:
    """Jobs and their events survive a Redis restart (append-only file on a volume)."""
    gateway = f"http://127.0.0.1:{env['GATEWAY_HOST_PORT']}"
    key = env["CRUCIBLE_GATEWAY_API_KEYS"].split(",")[0]
    with GatewayClient(gateway, api_key=key, timeout=60) as client:
        before_jobs = {j.id: j.status.value for j in client.jobs(limit=100).jobs}
        before_events = [e for e, _ in follow(client, job_id)]
    started = time.monotonic()
    compose.run("restart", "redis")
    compose.wait_healthy("redis", 1, timeout=120)
    for service in ("gateway", "trainer"):
        compose.wait_healthy(service, 1, timeout=300)
    with GatewayClient(gateway, api_key=key, timeout=60) as client:
        after_jobs = {j.id: j.status.value for j in client.jobs(limit=100).jobs}
        after_events = [e for e, _ in follow(client, job_id)]
    outcome = {
        "jobs": len(after_jobs),
        "events_of_demo_job": len(after_events),
        "recovered_s": round(time.monotonic() - started),
    }
    summary.setdefault("faults", {})["restart_redis"] = outcome
    check(after_jobs == before_jobs, f"jobs changed across a Redis restart: {before_jobs} -> {after_jobs}")
    check(after_events == before_events, "the demo job's events changed across a Redis restart")
    log(f"redis restart: {outcome}")


HOSTNAME = {
    "code": "import socket\ndef f():\n    return socket.gethostname()\n",
    "tests": {"kind": "asserts", "asserts": ["assert f() == ''"]},
    "use_cache": False,
}


def hostname_of(result: dict) -> str:
    return result["tests"][0]["actual"].strip("'")


def kill_sandbox(compose: Compose, summary: dict, env: dict[str, str]) -> None:
    """One replica killed while requests flow through sandbox-lb: the balancer routes around it."""
    url, key = f"http://127.0.0.1:{env['SANDBOX_HOST_PORT']}", env["CRUCIBLE_TRAINER_SANDBOX_API_KEY"]
    victim = compose.containers("sandbox")[0]["Name"]
    errors, answered, stop = [], [], threading.Event()

    def load() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
            while not stop.is_set():
                try:
                    r = http.post(f"{url}/v1/runs", json=HOSTNAME)
                    if r.status_code == 200 and r.json()["status"] == "failed":
                        answered.append(hostname_of(r.json()))
                    else:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                time.sleep(0.05)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    time.sleep(3)
    # A crash, as the engine sees one: its restart policy brings the replica back. (`docker kill`
    # counts as stopping it by hand, after which `unless-stopped` leaves it down.)
    pid = int(docker("inspect", "-f", "{{.State.Pid}}", victim).strip())
    log(f"SIGKILL to {victim} (pid {pid} on the host)")
    os.kill(pid, signal.SIGKILL)
    time.sleep(15)
    stop.set()
    thread.join()
    outcome = {"requests": len(answered) + len(errors), "errors": len(errors), "first_errors": errors[:3]}
    summary.setdefault("faults", {})["kill_sandbox_replica"] = outcome
    check(len(answered) > 50, f"too few requests answered: {outcome}")
    check(len(errors) <= 2, f"sandbox-lb did not route around the killed replica: {outcome}")
    outcome["back_healthy_s"] = round(
        compose.wait_healthy("sandbox", int(env["SANDBOX_REPLICAS"]), timeout=180)
    )
    log(f"sandbox replica killed: {outcome}; the engine restarted it (restart policy)")


def scale_sandbox(compose: Compose, summary: dict, env: dict[str, str]) -> None:
    """`docker compose up --scale sandbox=3`: sandbox-lb finds the new replica and uses it."""
    url, key = f"http://127.0.0.1:{env['SANDBOX_HOST_PORT']}", env["CRUCIBLE_TRAINER_SANDBOX_API_KEY"]
    started = time.monotonic()
    compose.run("up", "-d", "--scale", "sandbox=3", "--wait", "--wait-timeout", "300")
    compose.wait_healthy("sandbox", 3, timeout=180)
    hosts: set[str] = set()
    deadline = time.monotonic() + 60
    while len(hosts) < 3 and time.monotonic() < deadline:
        results = run_batch(url, key, [HOSTNAME] * 2)
        hosts |= {hostname_of(r) for r in results}
        for _ in range(6):
            r = httpx.post(
                f"{url}/v1/runs", json=HOSTNAME, headers={"Authorization": f"Bearer {key}"}, timeout=30
            )
            hosts.add(hostname_of(r.json()))
    outcome = {"replicas_answering": len(hosts), "seconds": round(time.monotonic() - started)}
    summary.setdefault("faults", {})["scale_sandbox_to_3"] = outcome
    check(len(hosts) == 3, f"sandbox-lb reached {len(hosts)} of 3 replicas: {sorted(hosts)}")
    log(f"scaled to 3 sandbox replicas: {outcome}")


# -- driver ---------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, str]:
    env = {
        "CRUCIBLE_GATEWAY_API_KEYS": secrets.token_hex(24),
        "CRUCIBLE_TRAINER_SANDBOX_API_KEY": secrets.token_hex(24),
        "GATEWAY_HOST_PORT": str(free_port()),
        "GENERATOR_HOST_PORT": str(free_port()),
        "SANDBOX_HOST_PORT": str(free_port()),
        # Two cores: two replicas of two slots each, a third added by the scaling check.
        "SANDBOX_REPLICAS": "2",
        "SANDBOX_WORKERS": "2",
        "CRUCIBLE_DATASETS_DIR": str(Path(tempfile.gettempdir()) / "crucible-compose-test-datasets"),
    }
    if args.local_base:
        missing = [i for i in LOCAL_BASE.values() if subprocess.run(
            ["docker", "image", "inspect", i], capture_output=True).returncode != 0]  # fmt: skip
        if missing:
            log(f"building local base images ({', '.join(missing)})")
            started = time.monotonic()
            subprocess.run(["bash", str(ROOT / "deploy/base-images.sh")], check=True)
            args.base_images_s = round(time.monotonic() - started)
        env.update(LOCAL_BASE)
    env.update({k: os.environ[k] for k in PASSTHROUGH if os.environ.get(k)})
    return env


def languages_only(url: str) -> int:
    """`--languages-only URL`: the language checks against one sandbox, without compose."""
    key = os.environ.get("CRUCIBLE_SANDBOX_API_KEY", "")
    if not key:
        print("--languages-only needs the sandbox's API key in CRUCIBLE_SANDBOX_API_KEY", file=sys.stderr)
        return 2
    try:
        health = httpx.get(f"{url}/health", timeout=10).json()
        result = {"isolation": health["isolation"], "languages": languages(url, key)}
    except (Failed, httpx.HTTPError) as exc:
        print(f"\nlanguages FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    log(f"every language passed ({health['isolation']['mode']} mode)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--local-base", action="store_true", help="base images from deploy/base-images.sh")
    parser.add_argument("--gpu-images", action="store_true", help="also build the CUDA trainer (and vLLM)")
    parser.add_argument("--no-build", action="store_true", help="use the images already built")
    parser.add_argument("--no-faults", action="store_true", help="skip the restart and scaling checks")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    parser.add_argument("--project", default="crucible-compose-test", help="compose project name")
    parser.add_argument(
        "--languages-only",
        metavar="URL",
        help="only run each language through the sandbox at URL (a container of the image, started "
        "by hand), with the API key in CRUCIBLE_SANDBOX_API_KEY",
    )
    args = parser.parse_args()
    if args.languages_only:
        return languages_only(args.languages_only.rstrip("/"))
    if shutil.which("docker") is None:
        print("compose-test needs Docker (docs/deploy.md, 'Testing the deployment')", file=sys.stderr)
        return 2
    out_dir = ROOT / "runs" / "compose-test"
    out_dir.mkdir(parents=True, exist_ok=True)
    args.base_images_s = None
    env = environment(args)
    Path(env["CRUCIBLE_DATASETS_DIR"]).mkdir(exist_ok=True)
    env_file = out_dir / "compose.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    compose = Compose(args.project, env_file)
    summary: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "engine": docker("version", "-f", "{{.Server.Version}}").strip(),
        "compose": subprocess.run(
            ["docker", "compose", "version", "--short"], capture_output=True, text=True, check=True
        ).stdout.strip(),
        "cores": os.cpu_count(),
        "base_images": {k: env[k] for k in LOCAL_BASE if k in env},
    }
    if args.base_images_s is not None:
        summary["base_images_s"] = args.base_images_s
    started = time.monotonic()
    ok = False
    try:
        if not args.no_build:
            build(compose, summary, args.gpu_images)
        up(compose, summary, int(env["SANDBOX_REPLICAS"]))
        sandbox(compose, summary, env)
        demo = job(compose, summary, env, out_dir)
        if not args.no_faults:
            restart_trainer(compose, summary, env)
            restart_redis(compose, summary, env, demo)
            kill_sandbox(compose, summary, env)
            scale_sandbox(compose, summary, env)
        ok = True
    except (Failed, subprocess.TimeoutExpired, httpx.HTTPError) as exc:
        print(f"\ncompose-test FAILED: {exc}\n", file=sys.stderr)
        compose.dump()
    finally:
        summary["total_s"] = round(time.monotonic() - started)
        summary["result"] = "passed" if ok else "failed"
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if not args.keep:
            log("docker compose down -v")
            subprocess.run(compose.command("down", "-v", "--remove-orphans"), cwd=ROOT, capture_output=True)
    print(json.dumps(summary, indent=2))
    log(f"{summary['result']} in {summary['total_s']} s; summary in {out_dir / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
