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


class LlamaCpp:
    """llama.cpp (`llama-cpp-python`, optional: never a test dependency) on the embedded GGUF,
    fed token ids, greedy. Its KV cache stays between calls: each call evaluates only what
    follows the longest common prefix with what it last evaluated."""

    def __init__(self, threads: int, n_ctx: int, n_batch: int = 512) -> None:
        from llama_cpp import Llama

        from streamer.sessions.models import embedded_gguf_path

        self.llm = Llama(model_path=str(embedded_gguf_path()), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, n_batch=n_batch, verbose=False)

    def _evaluate(self, ids: list[int]) -> None:
        """Evaluate `ids`, reusing the common prefix of what is cached."""
        llm = self.llm
        cached = list(llm._input_ids[:llm.n_tokens])
        common = 0
        for a, b in zip(cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token evaluated: its logits are read
        llm.n_tokens = common
        llm.eval(ids[common:])

    def _argmax(self) -> int:
        """The greedy next token: argmax of the logits of the last evaluated token (the only
        row llama.cpp computes when not asked for all)."""
        import numpy as np

        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def _greedy(self, tokens: int) -> list[int]:
        """Generate `tokens` greedily after the evaluated ids (the last one is not evaluated:
        nothing reads its logits), past any end-of-text."""
        out = [self._argmax()]
        for _ in range(tokens - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return out

    def prefill_rate(self, ids: list[int]) -> float:
        """Tokens per second evaluating `ids` on an empty cache."""
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - started)

    def decode_rate(self, ids: list[int], tokens: int) -> float:
        """Seconds per generated token after `ids` (evaluated first, not timed)."""
        self._evaluate(ids)
        started = time.perf_counter()
        self._greedy(tokens)
        return (time.perf_counter() - started) / max(1, tokens - 1)

    def answer(self, ids: list[int], tokens: int) -> float:
        """Seconds to a `tokens`-token answer to `ids`: what is new in them, then the answer."""
        started = time.perf_counter()
        self._evaluate(ids)
        self._greedy(tokens)
        return time.perf_counter() - started
