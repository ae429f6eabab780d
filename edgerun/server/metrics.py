"""``/metrics`` in the Prometheus text format (0.0.4).

The loop counts HTTP answers (:class:`Metrics`); the engine thread counts tokens and time
(``EngineWorker.counters``); the engine reports its expert cache, fallbacks and memory through
``engine.stats()``. A resident engine has no expert cache: its families carry
``experts="resident"`` and every counter is 0, read from the engine, not assumed here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from edgerun.server.engine_worker import DECODE, QUEUED, Histogram

if TYPE_CHECKING:
    from edgerun.server.engine_worker import EngineWorker

ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


class Metrics:
    """Counters the event loop keeps (single-threaded: no lock)."""

    def __init__(self) -> None:
        self.responses: Counter[tuple[str, int]] = Counter()
        self.connections: Counter[str] = Counter()  # closed by the daemon to make room: evicted | refused
        self.open_connections = 0

    def observe(self, path: str, status: int) -> None:
        if path.startswith("/v1/models/"):
            path = "/v1/models"
        self.responses[(path if path in ENDPOINTS else "other", status)] += 1


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self, name: str, kind: str, help_: str, samples: Iterable[tuple[dict[str, Any], float]]
    ) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            tag = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            self.lines.append(f"{name}{{{tag}}} {_number(value)}" if tag else f"{name} {_number(value)}")

    def one(self, name: str, kind: str, help_: str, value: float) -> None:
        self.family(name, kind, help_, [({}, value)])

    def histogram(self, name: str, help_: str, hist: Histogram) -> None:
        buckets, total, count = hist.snapshot()
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        for bound, n in buckets:
            le = "+Inf" if bound == float("inf") else _number(bound)
            self.lines.append(f'{name}_bucket{{le="{le}"}} {n}')
        self.lines += [f"{name}_sum {_number(total)}", f"{name}_count {count}"]


def render(
    metrics: Metrics,
    worker: EngineWorker,
    in_flight: int,
    stats: dict[str, Any] | None,
    state: str,
    info: dict[str, Any],
) -> str:
    t = _Text()
    c = worker.counters
    t.one("edgerun_ready", "gauge", "1 when the model is loaded and serving.", state == "ready")
    if info:
        labels = {k: info.get(k) or "none" for k in ("model_dir", "device", "dtype", "device_profile", "cpu")}
        t.family("edgerun_info", "gauge", "What this daemon serves.", [({**labels, "state": state}, 1)])
    t.family(
        "edgerun_http_responses_total",
        "counter",
        "HTTP answers by endpoint and status (499: the client left first).",
        [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(metrics.responses.items())],
    )
    t.one("edgerun_connections_open", "gauge", "Client connections open now.", metrics.open_connections)
    t.family(
        "edgerun_connections_closed_total",
        "counter",
        "Connections the daemon closed to stay within max_connections(_per_uid): evicted (the "
        "longest-waiting one without a request in progress) or refused (every one was answering).",
        [({"reason": r}, metrics.connections[r]) for r in ("evicted", "refused")],
    )
    t.one("edgerun_requests_total", "counter", "Generation requests the engine started.", c.requests)
    t.one("edgerun_request_failures_total", "counter", "Generation requests the engine failed.", c.failed)
    t.family(
        "edgerun_requests_cancelled_total",
        "counter",
        "Requests stopped early (client gone, timeout, shutdown), by the phase they were in: queued "
        "(never started), prefill (stopped between prompt chunks), decode.",
        [({"phase": p}, n + (worker.dropped if p == QUEUED else 0)) for p, n in c.cancelled.items()],
    )
    t.one(
        "edgerun_prompt_tokens_total",
        "counter",
        "Prompt tokens through the model (a cancelled prefill counts the chunks it ran).",
        c.prompt_tokens,
    )
    t.one("edgerun_generated_tokens_total", "counter", "Tokens generated.", c.generated_tokens)
    t.one(
        "edgerun_prefill_seconds_total",
        "counter",
        "Time from the engine taking a request to its first token, summed.",
        c.prefill_s,
    )
    t.one("edgerun_decode_seconds_total", "counter", "Time spent in decode steps.", c.decode_s)
    t.one(
        "edgerun_prefill_tokens_per_second",
        "gauge",
        "Prefill rate of the last request to reach its first token.",
        c.last_prefill_tps,
    )
    t.histogram(
        "edgerun_time_to_first_token_seconds",
        "Time from a request's arrival (its whole body read) to its first token: queue + prefill.",
        c.ttft,
    )
    t.histogram(
        "edgerun_queue_wait_seconds",
        "Time from a request's arrival to the engine taking it (waiting for a batch slot).",
        c.queue,
    )
    t.histogram(
        "edgerun_inter_token_seconds",
        "Time between two consecutive tokens of one request, as the engine emitted them.",
        c.inter_token,
    )
    t.histogram(
        "edgerun_request_prefill_seconds",
        "Time from the engine taking a request to its first token (the prompt's prefill).",
        c.prefill,
    )
    t.one(
        "edgerun_decode_tokens_per_second",
        "gauge",
        "Decode rate of the last completed request.",
        c.last_decode_tps,
    )
    t.one("edgerun_queue_depth", "gauge", "Requests waiting for the engine.", worker.depth)
    t.one("edgerun_queue_capacity", "gauge", "Requests that may wait before 429.", worker.capacity)
    running = list(worker.running)  # the engine thread's list: a copy, then counted
    t.one(
        "edgerun_requests_running",
        "gauge",
        "Requests the engine has taken (prefill or decode).",
        len(running),
    )
    t.one(
        "edgerun_batch_running",
        "gauge",
        "Requests decoding together now: the rows of the engine's next decode step.",
        sum(job.phase == DECODE for job in running),
    )
    t.one("edgerun_batch_capacity", "gauge", "Requests the engine decodes together at most.", worker.batch)
    t.one("edgerun_requests_in_flight", "gauge", "Generation requests accepted, not yet answered.", in_flight)

    stats = stats or {}
    mode = stats.get("experts", "unknown")
    layers = sorted(stats.get("layers", {}).items())
    for key, name, help_ in (
        ("hits", "edgerun_expert_cache_hits_total", "Expert lookups served from the cache, per layer."),
        ("misses", "edgerun_expert_cache_misses_total", "Expert lookups that needed a read, per layer."),
        ("evictions", "edgerun_expert_cache_evictions_total", "Experts evicted from the cache, per layer."),
        (
            "passed",
            "edgerun_expert_cache_passed_total",
            "Misses read into a spill row, used and not held (lfu-bypass: the held experts were used more), "
            "per layer; counted among the misses.",
        ),
        ("bytes_read", "edgerun_expert_bytes_read_total", "Expert bytes read from storage, per layer."),
    ):
        t.family(name, "counter", help_, [({"layer": i, "experts": mode}, s.get(key, 0)) for i, s in layers])
    t.family(
        "edgerun_expert_host_tier_total",
        "counter",
        "Expert uses the pinned host tier served (discrete GPUs), per layer: copied into a device slot "
        "(a miss of the device slots), read in place by the GPU over PCIe (every expert in the tier), "
        "or computed from it on the CPU (--cpu-experts).",
        [
            ({"layer": i, "experts": mode, "how": how}, s.get(key, 0))
            for i, s in layers
            for how, key in (("copied", "tier_copies"), ("in_place", "far_reads"), ("cpu", "cpu_pairs"))
        ],
    )
    t.family(
        "edgerun_expert_prefetch_total",
        "counter",
        "Expert reads issued before the router asked (the next layer's predicted experts, a prefill's "
        "next batch), per layer: issued, useful (served a miss) and wasted (not asked for).",
        [
            ({"layer": i, "experts": mode, "outcome": k}, s.get(f"prefetch_{k}", 0))
            for i, s in layers
            for k in ("issued", "useful", "wasted")
        ],
    )
    t.family(
        "edgerun_expert_prefetch_bytes_total",
        "counter",
        "Expert bytes prefetches read, useful and wasted, per layer.",
        [({"layer": i, "experts": mode}, s.get("prefetch_bytes", 0)) for i, s in layers],
    )
    t.family(
        "edgerun_fallbacks_total",
        "counter",
        "Fallbacks taken (eager step, CPU reference, buffered read), by kind.",
        [({"kind": k}, n) for k, n in sorted(stats.get("fallbacks", {}).items())],
    )
    t.family(
        "edgerun_expert_reads_total",
        "counter",
        "Expert blocks read from storage, by who read them (reader: native, preadv or io_uring; a read "
        "through preadv because reader auto found the native reader unable to run is also the "
        "native_reader fallback).",
        [({"reader": k}, n) for k, n in sorted(stats.get("reads", {}).items())],
    )
    disk = stats.get("disk", {})
    t.one(
        "edgerun_disk_busy_seconds_total",
        "counter",
        "Seconds with at least one expert read in flight (demand or prefetch).",
        disk.get("busy", 0.0),
    )
    t.one(
        "edgerun_disk_request_seconds_total",
        "counter",
        "Expert read requests in flight integrated over time (a piece each where blocks are read in "
        "pieces); its rate over edgerun_disk_busy_seconds_total's is the mean queue while busy.",
        disk.get("requests", 0.0),
    )
    t.family(
        "edgerun_expert_read_faults_total",
        "counter",
        "Expert blocks read again after failing their checksum (reread), and reads refused: a block "
        "failing twice (checksum), a short read or I/O error (io). A refused read fails the engine.",
        [({"kind": k}, n) for k, n in sorted(stats.get("read_faults", {}).items())],
    )
    t.one(
        "edgerun_nonfinite_logits_total",
        "counter",
        "Requests stopped because a step's logits were NaN or infinite (no token emitted from them).",
        stats.get("nonfinite_logits", 0),
    )
    t.family(
        "edgerun_sampled_tokens_total",
        "counter",
        "Sampled (not greedy) draws by where they were made: device (from the logits where they are, on "
        "a GPU, no copy to the host; in the decode step's graph where it replays) or host (the CPU "
        "sampler: a CPU engine; a verified speculative request's drafts and acceptance draws).",
        [({"where": k}, n) for k, n in sorted(stats.get("sampled_tokens", {}).items())],
    )
    t.family(
        "edgerun_decode_steps_total",
        "counter",
        "Decode steps by how they ran: graph (replayed, no host op), mixed (graph segments with eager "
        "expert-miss service between them), eager (nothing replayed).",
        [({"mode": k}, n) for k, n in sorted(stats.get("decode_steps", {}).items())],
    )
    t.family(
        "edgerun_prefill_chunks_total",
        "counter",
        "Prompt chunks by how they ran: graph (a prompt's first chunk replayed from a CUDA graph captured "
        "for its padded length), eager (the forward issued op by op: CPU, later chunks, long chunks, streamed "
        "experts).",
        [({"mode": k}, n) for k, n in sorted(stats.get("prefill_chunks", {}).items())],
    )
    t.family(
        "edgerun_graph_captures_total",
        "counter",
        "CUDA graphs captured: decode (a set per static state size), prefill (a prompt's first chunk, "
        "one per padded length and lane). serve captures them at start-up; one that grows while serving "
        "is a request that paid for a capture (a longer context than the start-up state's).",
        [({"kind": k}, n) for k, n in sorted(stats.get("graph_captures", {}).items())],
    )
    t.family(
        "edgerun_batch_steps_total",
        "counter",
        "Multi-row decode steps of the batched engine, by how many requests they decoded.",
        [({"rows": k}, n) for k, n in sorted(stats.get("batch_steps", {}).items())],
    )
    t.family(
        "edgerun_verify_window_experts_total",
        "counter",
        "Speculative verify windows (K + 1 rows) each MoE layer ran, and the distinct experts they "
        "needed (each window's union of its rows' top_k), per layer; streamed experts only.",
        [
            ({"layer": i, "experts": mode, "count": k}, s.get(key, 0))
            for i, s in layers
            for k, key in (("windows", "verify_windows"), ("experts", "window_experts"))
        ],
    )
    spec = stats.get("speculative")
    if spec is not None:
        labels = {"method": "mtp", "draft_tokens": spec["draft_tokens"]}
        t.family(
            "edgerun_speculative_tokens_total",
            "counter",
            "Speculative decoding: tokens the MTP head drafted, the drafts the verify steps accepted, "
            "and the tokens they emitted (accepted drafts + one a step).",
            [({**labels, "kind": k}, spec[k]) for k in ("drafted", "accepted", "emitted")],
        )
        for name, kind, help_, key in (
            ("edgerun_speculative_steps_total", "counter", "Speculative verify steps.", "steps"),
            (
                "edgerun_speculative_plain_requests_total",
                "counter",
                "Sampled requests that decoded plainly (speculative_sampled: plain, the default).",
                "plain_requests",
            ),
            (
                "edgerun_speculative_device_steps_total",
                "counter",
                "Of the speculative verify steps, those decided on the device (verify, accept, roll "
                "back and draft in one queued step); the rest were host-driven.",
                "device_steps",
            ),
            (
                "edgerun_speculative_acceptance_ratio",
                "gauge",
                "Accepted drafts / drafted tokens, all requests so far.",
                "acceptance",
            ),
            (
                "edgerun_speculative_tokens_per_step",
                "gauge",
                "Tokens emitted per verify step, all requests so far.",
                "tokens_per_step",
            ),
            (
                "edgerun_speculative_speedup",
                "gauge",
                "The last completed request's decode rate over plain decoding's, as the start-up probe "
                "timed a one-row step (edgerun_speculative_row_step_seconds).",
                "speedup",
            ),
            (
                "edgerun_speculative_row_step_seconds",
                "gauge",
                "A plain one-row decode step's time, probed at start-up.",
                "row_step_seconds",
            ),
        ):
            t.family(name, kind, help_, [(labels, spec[key])])
    if "resident_memory_bytes" in stats:
        t.one("edgerun_resident_memory_bytes", "gauge", "Memory held now.", stats["resident_memory_bytes"])
    if "peak_memory_bytes" in stats:
        t.one("edgerun_peak_memory_bytes", "gauge", "Peak memory so far.", stats["peak_memory_bytes"])
    return "\n".join(t.lines) + "\n"
