"""Prometheus text exposition of the engine's metrics (served at GET /metrics)."""

from __future__ import annotations

from collections.abc import Callable

COUNTERS = {
    "steps": "Model steps run",
    "step_tokens": "Tokens run in model steps",
    "step_sequences": "Sequences run in model steps (more than steps when steps are packed)",
    "step_seconds": "Seconds spent in model steps",
    "tokens_ingested": "Input tokens prefilled into session caches",
    "queries": "Questions answered by the model",
    "queries_cached": "Questions answered from a current flash answer",
    "sessions_created": "Sessions created",
    "flash_evaluations": "Batched flash evaluations",
    "flash_questions_evaluated": "Flash questions evaluated",
    "flash_pushed": "flash.updated events pushed",
    "flash_cancelled": "Flash evaluations cancelled by a revise",
    "parked": "Sessions parked out of the KV pool",
    "restored": "Parked sessions brought back",
    "admissions_queued": "New sessions queued for KV memory",
    "admissions_refused": "New sessions refused for KV memory",
}


EDGE_COUNTERS = {
    "backpressure_pauses": "Times reading a client paused for backpressure",
    "rate_limited": "Messages refused for a connection's message rate",
    "slow_consumers_dropped": "Connections dropped for not reading their events",
    "idle_closed": "Idle connections closed",
    "auth_refused": "Handshakes or session creations refused for a missing or unknown API key",
    "junk_closed": "Connections closed for sending too many refused or invalid frames",
    "bytes_read": "Bytes read from clients as the byte rates count them (every frame, valid or not; a compressed "
                  "frame by its decoded size)",
    "byte_throttled": "Times reading a client paused for its byte rate",
    "byte_rate_closed": "Connections closed for staying over their byte rate",
    "server_busy": "Times a connection was slowed to its fair share of the server's busy message budget",
    "connections_refused_address": "Handshakes refused: too many connections from the client's address",
    "connections_refused_key": "Handshakes refused: too many connections with the API key",
    "connections_refused_server": "Handshakes refused: the server at max_connections",
    "connections_reset": "Sockets closed unanswered past the descriptor guard (or twice an address's cap)",
    "handshakes_paced": "Websocket handshakes that waited their turn at the server's handshake rate",
    "handshakes_refused": "Websocket handshakes refused (server_busy): their turn at the handshake rate was too far",
    "loop_handovers": "Callbacks the engine's threads handed to the event loop (replies, events)",
    "loop_wakeups": "Times those hand-overs woke the event loop: one per batch (streamer.loopbridge)",
    "gc_tenured": "Full garbage collections whose survivors were frozen (streamer.heap; streamer serve only)",
    "gc_sweeps": "Sweeps of the frozen heap: one full collection of everything (streamer.heap)",
    "gc_swept_objects": "Objects the sweeps of the frozen heap reclaimed (cycles that died frozen)",
}


DURABILITY = {
    "log_records": "Records appended to session event logs",
    "log_errors": "Log writes the store failed (the change is not acknowledged)",
    "log_settled": "Failed log writes of applied changes settled later (written again)",
    "log_fenced": "Failed log writes fenced with a void record (never applied)",
    "log_voided_late": "Timed-out log writes of unapplied inputs that landed later and were voided (never applied)",
    "log_voided_refused": "Logged inputs the engine refused (context_overflow, kv_budget_exceeded), voided so replay skips them",
    "relogged": "Sessions re-claimed and re-written into a store that had lost them",
    "checkpoints": "Checkpoints written into session event logs (the window's state and K/V)",
    "checkpoint_errors": "Checkpoints that failed (the next records try again)",
    "log_compacted": "Log records dropped by compaction at checkpoints",
    "duplicates": "Inputs acknowledged as duplicates of a client_seq already seen",
    "recovered": "Sessions recovered by replaying their event logs",
    "adopted": "Sessions of dead workers adopted here with no client asking (the proxy routes them here)",
    "sessions_lost": "Sessions dropped here because another worker adopted them (this worker had lost its lease)",
    "detached_expired": "Detached sessions closed when their TTL ran out",
    "detached_evicted": "Detached sessions closed early to make room: a client or the server over its detach cap, "
                        "a key at its session quota or the engine at its session limit",
    "snapshots": "Session snapshots written",
}
# streamer.drain: sessions moved with their KV cache by a draining worker, and adopted from it
DRAIN = {
    "handoffs_exported": "Sessions a draining worker handed over with their KV cache",
    "handoff_bytes": "Bytes of session handoff blobs written by a draining worker",
    "handoff_failures": "Sessions a draining worker could not hand over (they are replayed instead)",
    "handoffs_imported": "Sessions adopted from a handoff blob, with no input read again",
    "handoff_fallbacks": "Handoff blobs not used on adoption (log moved on, blob missing or refused): replayed",
}
DURABILITY.update(DRAIN)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(metrics: dict, connections: int, edge: dict | None = None, durability: dict | None = None,
           shows: Callable[[str], bool] | None = None) -> str:
    """The metrics as Prometheus text format 0.0.4. `shows(session_id)` says which sessions get
    series of their own (labelled `session=`); None: all. Aggregates always cover every session."""
    lines: list[str] = []
    if shows is None:
        def shows(_sid: str) -> bool:
            return True

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP streamer_{name} {help_text}")
        lines.append(f"# TYPE streamer_{name} {kind}")
        for labels, value in samples:
            label = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            lines.append(f"streamer_{name}{{{label}}} {value}" if label else f"streamer_{name} {value}")

    stats, pool = metrics["stats"], metrics["pool"]
    for key, help_text in COUNTERS.items():
        metric(f"{key}_total", "counter", help_text, [({}, stats[key])])
    metric("sessions", "gauge", "Live sessions", [({}, stats["sessions"])])
    metric("sessions_parked", "gauge", "Sessions parked out of the KV pool", [({}, metrics["parked"])])
    metric("connections", "gauge", "Open websocket connections", [({}, connections)])
    for key, help_text in EDGE_COUNTERS.items():
        metric(f"{key}_total", "counter", help_text, [({}, (edge or {}).get(key, 0))])
    metric("queue_depth", "gauge", "Jobs waiting or running, by class",
           [({"class": k}, v) for k, v in sorted(metrics["queues"].items())])
    metric("pool_blocks", "gauge", "KV pool blocks", [({}, pool["blocks"])])
    metric("pool_free_blocks", "gauge", "Free KV pool blocks", [({}, pool["free_blocks"])])
    metric("pool_used_bytes", "gauge", "KV pool bytes in use", [({}, pool["used_bytes"])])
    metric("pool_budget_bytes", "gauge", "KV pool budget in bytes", [({}, pool["budget_bytes"])])
    metric("pool_shared_prefixes", "gauge", "Shared system-prompt prefixes", [({}, pool["shared_prefixes"])])
    metric("pool_compactions_total", "counter", "KV pool compactions", [({}, pool["compactions"])])
    metric("kv_bytes_per_token", "gauge", "Physical KV bytes per token", [({}, metrics["kv_bytes_per_token"])])
    metric("attention_backend", "gauge", "Attention backend in use (the label; value 1)",
           [({"backend": metrics["attention_backend"]}, 1)])
    if "weights" in metrics:
        w = metrics["weights"]
        metric("weights_info", "gauge", "Weight format of the linear layers (the labels; value 1)",
               [({"format": w["format"], "requested": w["requested"], "source": w["source"],
                  "kernels": w["kernels"]}, 1)])
        metric("linear_weight_bytes", "gauge", "Bytes of linear-layer weights a decode step reads",
               [({}, w["linear_bytes"])])
    if "threads" in metrics:  # on the native kernels: their pool's threads (kernels/governor.py)
        t = metrics["threads"]
        metric("compute_threads", "gauge", "Threads a step gets now, by kind of step (fewer while other work "
               "holds cores)", [({"steps": "decode"}, t["decode_threads"]), ({"steps": "read"}, t["read_threads"])])
        metric("compute_threads_ceiling", "gauge", "Most threads a step may get", [({}, t["ceiling"])])
        metric("cpu_foreign_cores", "gauge", "Cores busy with other work than the compute threads' (last look)",
               [({}, t["foreign_cores"])])
        metric("compute_threads_changes_total", "counter", "Times the threads a kind of step gets changed",
               [({}, t["changes"])])
    steps = stats["steps"] or 1
    metric("step_seconds_mean", "gauge", "Mean seconds per model step", [({}, stats["step_seconds"] / steps)])
    metric("step_tokens_mean", "gauge", "Mean tokens per model step", [({}, stats["step_tokens"] / steps)])
    metric("flash_staleness_versions", "gauge", "Largest number of data versions a flash answer is behind",
           [({}, metrics["flash_staleness_versions_max"])])
    if "flash_staleness_seconds_max" in metrics:
        metric("flash_staleness_seconds", "gauge", "Largest age in seconds of a flash answer that is behind its data",
               [({}, metrics["flash_staleness_seconds_max"])])
    metric("flash_stale_questions", "gauge", "Flash questions marked stale (flash.stale pushed, not yet re-evaluated)",
           [({}, metrics.get("flash_stale_marked", 0))])
    histograms = metrics.get("flash_staleness", {})
    if histograms:
        lines.append("# HELP streamer_flash_staleness_seconds_hist Seconds from accepted data to the flash answer "
                     "evaluated on it, per session")
        lines.append("# TYPE streamer_flash_staleness_seconds_hist histogram")
        for sid, (buckets, count, total) in sorted(histograms.items()):
            if not shows(sid):
                continue
            label = f'session="{_escape(sid)}"'
            for bound, n in buckets:
                lines.append(f'streamer_flash_staleness_seconds_hist_bucket{{{label},le="{bound}"}} {n}')
            lines.append(f"streamer_flash_staleness_seconds_hist_sum{{{label}}} {total}")
            lines.append(f"streamer_flash_staleness_seconds_hist_count{{{label}}} {count}")
    if durability is not None:
        metric("store_info", "gauge", "Which state store the server uses", [({"kind": durability["store"]}, 1)])
        metric("sessions_detached", "gauge", "Live sessions whose producer is disconnected", [({}, durability["detached"])])
        for key, help_text in DURABILITY.items():
            metric(f"{key}_total", "counter", help_text, [({}, durability[key])])
    sessions = {sid: v for sid, v in metrics["sessions"].items() if shows(sid)}
    metric("session_cache_tokens", "gauge", "Tokens in a session's reading cache",
           [({"session": sid}, tokens) for sid, (tokens, _) in sorted(sessions.items())])
    metric("session_cache_bytes", "gauge", "Pool bytes a session holds on its own",
           [({"session": sid}, nbytes) for sid, (_, nbytes) in sorted(sessions.items())])
    return "\n".join(lines) + "\n"
