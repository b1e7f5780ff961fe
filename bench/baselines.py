"""Baselines shared by the benchmarks."""

from __future__ import annotations

import time

import torch

from streamer.sessions.runner import ModelRunner, SeqStep


def stateless_answer(runner: ModelRunner, ids: list[int], answer_tokens: int) -> float:
    """What a request-driven engine pays per question: prefill context + question in one
    forward on a fresh cache, then decode `answer_tokens` greedily. Returns seconds."""
    cache = runner.new_cache()
    started = time.perf_counter()
    logits = runner.forward([SeqStep(cache, 0, ids)], logits="last")[0]
    for pos in range(len(ids), len(ids) + answer_tokens - 1):
        logits = runner.forward([SeqStep(cache, pos, [int(torch.argmax(logits))])], logits="last")[0]
    return time.perf_counter() - started


class _LlamaCppEngine:
    """llama.cpp itself, in the worker process (see LlamaCpp)."""

    def __init__(self, threads: int, n_ctx: int, n_batch: int) -> None:
        from llama_cpp import Llama

        from streamer.sessions.models import embedded_gguf_path

        self.llm = Llama(model_path=str(embedded_gguf_path()), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=n_batch, verbose=False)

    def _evaluate(self, ids: list[int], reuse: int | None = None) -> None:
        """Evaluate `ids`, reusing the common prefix of what is cached (at most `reuse` tokens of
        it: what is past them is evaluated again, as a question asked anew)."""
        llm = self.llm
        cached = list(llm._input_ids[:llm.n_tokens])
        common = 0
        for a, b in zip(cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token evaluated: its logits are read
        if reuse is not None:
            common = min(common, reuse)
        llm.n_tokens = common
        llm.eval(ids[common:])

    def _argmax(self) -> int:
        """The greedy next token: argmax of the logits of the last evaluated token (the only
        row llama.cpp computes when not asked for all)."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def greedy(self, ids: list[int], tokens: int, reuse: int | None = None) -> list[int]:
        """`tokens` greedy tokens after `ids`, past any end-of-text (the last is not
        evaluated: nothing reads its logits)."""
        self._evaluate(ids, reuse)
        out = [self._argmax()]
        for _ in range(tokens - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return out

    def prefill_rate(self, ids: list[int]) -> float:
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - started)

    def decode_rate(self, ids: list[int], tokens: int) -> float:
        self._evaluate(ids)
        first = self._argmax()
        started = time.perf_counter()
        out = [first]
        for _ in range(tokens - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return (time.perf_counter() - started) / max(1, tokens - 1)

    def answer(self, ids: list[int], tokens: int, reuse: int | None = None) -> float:
        started = time.perf_counter()
        self.greedy(ids, tokens, reuse)
        return time.perf_counter() - started


def _llama_worker(conn, threads: int, n_ctx: int, n_batch: int) -> None:
    try:
        engine = _LlamaCppEngine(threads, n_ctx, n_batch)
    except ImportError as exc:
        conn.send(("error", f"ImportError: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the benchmark ended
            return
        if msg is None:
            return
        method, args = msg
        conn.send(("ok", getattr(engine, method)(*args)))


class LlamaCpp:
    """llama.cpp (`llama-cpp-python`, optional: never a test dependency) on the embedded GGUF,
    fed token ids, greedy, in a process of its own: it shares no threads, allocator or runtime
    with the engine it is compared with (in one process it measured ~50% slower beside an idle
    engine), and each side is idle while the other runs. Its KV cache stays between calls:
    each call evaluates only what follows the longest common prefix with what it last
    evaluated. Raises ImportError where llama-cpp-python is not installed."""

    def __init__(self, threads: int, n_ctx: int, n_batch: int = 512) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_llama_worker, args=(child, threads, n_ctx, n_batch), daemon=True)
        self._proc.start()
        status, detail = self._conn.recv()
        if status == "error":
            self._proc.join()
            raise ImportError(detail)

    def _call(self, method: str, *args):
        self._conn.send((method, args))
        status, value = self._conn.recv()
        return value

    def prefill_rate(self, ids: list[int]) -> float:
        """Tokens per second evaluating `ids` on an empty cache."""
        return self._call("prefill_rate", list(ids))

    def decode_rate(self, ids: list[int], tokens: int) -> float:
        """Seconds per generated token after `ids` (evaluated first, not timed)."""
        return self._call("decode_rate", list(ids), tokens)

    def answer(self, ids: list[int], tokens: int, reuse: int | None = None) -> float:
        """Seconds to a `tokens`-token answer to `ids`: what is new in them (past `reuse` tokens
        at most: a question asked again is evaluated again), then the answer."""
        return self._call("answer", list(ids), tokens, reuse)

    def greedy(self, ids: list[int], tokens: int) -> list[int]:
        return self._call("greedy", list(ids), tokens)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(10)
