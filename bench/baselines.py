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
