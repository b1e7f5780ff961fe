"""Choosing the next token, and when to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import Code, InvalidRequest


@dataclass(slots=True)
class SamplingParams:
    """Decoding settings for one question. temperature 0 means greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def validate(self, limit: int) -> None:
        if self.max_tokens > limit:
            raise InvalidRequest(f"max_tokens must be in [1, {limit}], got {self.max_tokens}",
                                 code=Code.MAX_TOKENS_TOO_LARGE, param="max_tokens")
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be in [1, {limit}], got {self.max_tokens}", param="max_tokens")
        if not 0.0 <= self.temperature <= 10.0:
            raise InvalidRequest(f"temperature must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if len(self.stop) > 8 or any(not s for s in self.stop):
            raise InvalidRequest("stop takes at most 8 non-empty strings")


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs > p.top_p  # keep the smallest set reaching top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))


def stop_token_ids(tokenizer, model) -> frozenset[int]:
    """End-of-turn ids from the tokenizer and the model's generation config."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return frozenset(ids)
