"""Prometheus metrics of the generator, in a registry of their own (one per server instance)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger(__name__)

# The server's start, by part (`Metrics.started`): what a job that spawns its generator waits for.
START_PARTS = {
    "imports": "from the process's start to loading the model: the interpreter, settings, torch, the app",
    "load": "loading the model's weights and tokenizer onto the device",
    "engine": "the cache plan, the engine's memory and its start (graphs captured at start included)",
}


class Metrics:
    """Request, token, batch and adapter metrics, rendered at `GET /metrics`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "crucible_generator_requests",
            "HTTP requests by route and status.",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "crucible_generator_request_seconds",
            "End-to-end latency of generation requests.",
            ["route"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "crucible_generator_prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generation_tokens = Counter(
            "crucible_generator_generation_tokens", "Tokens generated.", registry=r
        )
        self.batch_size = Histogram(
            "crucible_generator_batch_size",
            "Sequences decoded together, at every decode step.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=r,
        )
        self.waiting = Gauge(
            "crucible_generator_waiting_sequences", "Sequences queued for a batch.", registry=r
        )
        self.joined = Counter(
            "crucible_generator_joined_sequences",
            "Sequences admitted into a continuous batch that was already decoding.",
            registry=r,
        )
        self.admissions = Counter(
            "crucible_generator_admissions",
            "Admissions into the continuous batch: one prefill of the sequences starting or joining.",
            registry=r,
        )
        self.admission_seconds = Counter(
            "crucible_generator_admission_seconds",
            "Wall time of those admissions (prefill, first tokens): rows already running do not decode meanwhile.",
            registry=r,
        )
        self.prefix_reused_tokens = Counter(
            "crucible_generator_prefix_reused_tokens",
            "Prompt tokens not prefilled again: an identical prompt was prefilled in the same admission.",
            registry=r,
        )
        self.graph_captures = Counter(
            "crucible_generator_graph_captures",
            "Decode steps captured as CUDA graphs (once per window; none in steady state).",
            registry=r,
        )
        self.preempted = Counter(
            "crucible_generator_preempted_sequences",
            "Sequences that gave back their cache blocks mid-decode (the cache ran out) and were "
            "queued again, to be prefilled with their tokens so far.",
            registry=r,
        )
        self.cache_usage = Gauge(
            "crucible_generator_kv_cache_usage",
            "Share of the fast path's key/value cache blocks held by sequences (0 to 1).",
            registry=r,
        )
        self.running = Gauge("crucible_generator_running_sequences", "Sequences being decoded.", registry=r)
        self.adapters = Gauge(
            "crucible_generator_lora_adapters", "LoRA adapters by state.", ["state"], registry=r
        )
        self.adapter_evictions = Counter(
            "crucible_generator_lora_evictions_total",
            "Idle LoRA adapters unloaded to make room for another at max_loras.",
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            "crucible_generator_lora_load_seconds",
            "Time to load a LoRA adapter.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )

        self.start_seconds = {
            part: Gauge(f"crucible_generator_start_{part}_seconds", f"Start: {what}.", registry=r)
            for part, what in START_PARTS.items()
        }

    def started(self, **seconds: float | None) -> None:
        """Record (and log) the seconds of each part of the server's start (`START_PARTS`); a part
        not known (None: the process's age off Linux) is left at 0."""
        for part, value in seconds.items():
            self.start_seconds[part].set(value or 0.0)
        log.info("started: %s", ", ".join(f"{p} {v:.1f} s" for p, v in seconds.items() if v is not None))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def process_age_s(pid: int | str = "self") -> float | None:
    """Seconds since process `pid` (default: this one) started, from Linux's /proc; None where
    that is not known."""
    try:
        # Field 22 of /proc/PID/stat, the start in clock ticks after boot; fields counted after the
        # command's closing parenthesis, which may itself hold spaces.
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
