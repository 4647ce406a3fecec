"""Prometheus metrics of the generator, in a registry of their own (one per server instance)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


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

    def render(self) -> bytes:
        return generate_latest(self.registry)
