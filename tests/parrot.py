"""The parrot: the tiny seeded model with one row of its output layer changed so that every
reasoning note it writes is the same (' same same ...'), whatever it reads. Today's dual
thinking kept such repeats; the refusal must catch them (tests/sessions/test_thinking.py,
tests/streamer/test_thinking_server.py)."""

from __future__ import annotations

import torch


def parrot_runner(tokenizer, seed: int = 1234):
    """A ModelRunner on the tiny seeded Llama whose token ' same' scores three times the token
    greedy writes anyway (the newline): it writes ' same' at every step."""
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=seed)
    head = lm.model.get_output_embeddings().weight
    same, newline = tokenizer.encode(" same")[0], tokenizer.encode("\n")[0]
    with torch.no_grad():
        head[same] = 3 * head[newline]
    return ModelRunner(lm.model, tokenizer, lm.name)
