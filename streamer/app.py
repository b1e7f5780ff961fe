"""Wiring: model -> runner -> engine -> server."""

from __future__ import annotations

import logging

import torch

from streamer.sessions.engine import Engine, EngineLimits
from streamer.sessions.models import load_model
from streamer.sessions.runner import ModelRunner
from streamer.sessions.weights import apply_weights, check_request

log = logging.getLogger(__name__)


def build_engine(model: str = "embedded", dtype: str = "float32", device: str = "cpu",
                 limits: EngineLimits | None = None, threads: int | None = None,
                 weights: str = "auto") -> Engine:
    """Load a model, put its linear layers in the weight format (`auto`: streamer.sessions.weights
    AUTO_RULE; WeightFormatError for a combination that cannot run) and start its engine thread."""
    if threads:
        torch.set_num_threads(threads)
    return Engine(build_runner(model, dtype, device, weights), limits).start()


def build_runner(model: str = "embedded", dtype: str = "float32", device: str = "cpu",
                 weights: str = "auto") -> ModelRunner:
    check_request(weights, device)  # before the model loads: a wrong request fails in a second
    loaded = load_tiny(model) if model.split(":")[0] == "tiny" else load_model(model, dtype=dtype, device=device)
    info = apply_weights(loaded.model, weights, device, loaded.gguf)
    return ModelRunner(loaded.model, loaded.tokenizer, loaded.name, info)


def load_tiny(spec: str = "tiny"):
    """`tiny` or `tiny:SEED`: a seeded random-weight 2-layer Llama (fp32) with the embedded
    tokenizer. Loads in a second; the same seed gives the same weights in every process, so
    tests can restart or fail over real server processes and compare greedy answers."""
    from transformers import AutoTokenizer

    from streamer.sessions.models import build_tiny_model, embedded_model_dir

    _, _, seed = spec.partition(":")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return build_tiny_model(tokenizer, seed=int(seed or 7))
