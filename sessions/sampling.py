"""Choosing the next token, and when to stop."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch

from .errors import Code, InvalidRequest


def greedy(logits: torch.Tensor) -> int:
    """The index of the largest logit (the first of equals, as torch.argmax). A CPU float32 row
    goes through numpy: torch's argmax dispatches to its thread pool, ~40 us a decode step on a
    2-core machine where numpy's takes ~4 (its own result: the first maximum, NaN counted as one)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


PENALTY_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "end_bias")


@dataclass(frozen=True, slots=True)
class Penalties:
    """Penalties on tokens the answer has already produced (its own tokens only: the context and
    the question are not penalized, so an answer stays free to quote what it read), and a bias
    on ending the answer.

    repetition_penalty (CTRL, as in transformers): a seen token's logit is divided by it when
    positive, multiplied when negative; 1 is off. presence_penalty is subtracted once from every
    seen token's logit, frequency_penalty once per time it was seen (OpenAI's definitions); 0 is off.
    end_bias is added at every step to the logits of the tokens that end an answer (the model's
    end-of-turn ids): above 0 an answer ends sooner (a small model stops after the sentence that
    answers instead of inventing more), below 0 later; 0 is off.
    """

    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    end_bias: float = 0.0

    @property
    def counts_tokens(self) -> bool:
        """Whether a penalty on the answer's own tokens is on."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def active(self) -> bool:
        return self.counts_tokens or self.end_bias != 0.0

    def validate(self) -> None:
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}",
                                 param="repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value}", param=name)
        if not -10.0 <= self.end_bias <= 10.0:
            raise InvalidRequest(f"end_bias must be in [-10, 10], got {self.end_bias}", param="end_bias")

    def apply(self, logits: torch.Tensor, generated: Sequence[int],
              end_ids: Collection[int] = ()) -> torch.Tensor:
        """The logits with the penalties for `generated` and the bias on `end_ids` (the stop
        ids) applied (a new tensor; the input is kept)."""
        if not self.active:
            return logits
        counted = bool(generated) and self.counts_tokens
        bias = self.end_bias != 0.0 and bool(end_ids)
        if not counted and not bias:
            return logits
        out = logits.float().clone()
        if counted:
            ids, counts = torch.unique(torch.tensor(list(generated), device=logits.device), return_counts=True)
            seen = out[ids]
            if self.repetition_penalty != 1.0:
                seen = torch.where(seen > 0, seen / self.repetition_penalty, seen * self.repetition_penalty)
            out[ids] = seen - self.presence_penalty - self.frequency_penalty * counts.float()
        if bias:
            out[sorted(end_ids)] += self.end_bias
        return out

    def public(self) -> dict:
        return {k: getattr(self, k) for k in PENALTY_KEYS}


@dataclass(slots=True)
class SamplingParams:
    """Decoding settings for one question. temperature 0 means greedy; penalties: `Penalties`."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    end_bias: float = 0.0

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty, self.end_bias)

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
        self.penalties.validate()


class Sampler:
    def __init__(self, params: SamplingParams, stop_ids: Collection[int] = ()) -> None:
        self.params = params
        self.penalties = params.penalties
        self.stop_ids = stop_ids
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor, generated: Sequence[int] = ()) -> int:
        """The next token; `generated` (the answer so far) is what the penalties count."""
        p = self.params
        logits = self.penalties.apply(logits, generated, self.stop_ids)
        if p.temperature == 0:
            return greedy(logits)
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
