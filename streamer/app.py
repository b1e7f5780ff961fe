"""Wiring: model -> runner -> engine -> server."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from streamer.sessions.engine import Engine, EngineLimits
from streamer.sessions.models import load_model
from streamer.sessions.runner import ModelRunner
from streamer.sessions.weights import apply_weights, check_request

log = logging.getLogger(__name__)


def build_engine(model: str = "embedded", dtype: str = "float32", device: str = "cpu",
                 limits: EngineLimits | None = None, threads: int | None = None,
                 weights: str = "auto", check: Callable[[ModelRunner], None] | None = None) -> Engine:
    """Load a model, put its linear layers in the weight format (`auto`: streamer.sessions.weights
    AUTO_RULE; WeightFormatError for a combination that cannot run) and start its engine thread.
    `check(runner)` runs between the two (the CLI refuses a KV budget too small for the model)."""
    if threads:
        torch.set_num_threads(threads)
    runner = build_runner(model, dtype, device, weights)
    if check is not None:
        check(runner)
    return Engine(runner, limits).start()


def build_runner(model: str = "embedded", dtype: str = "float32", device: str = "cpu",
                 weights: str = "auto") -> ModelRunner:
    check_request(weights, device)  # before the model loads: a wrong request fails in a second
    kind = model.split(":")[0]
    if kind == "tiny":
        loaded = load_tiny(model)
    elif kind == "tiny-vl":
        loaded = load_tiny_vl(model)
    elif is_vl_checkpoint(model):
        from streamer.sessions.models import LoadedModel
        from streamer.vision.vlm import load_vlm

        vlm, tokenizer = load_vlm(model, dtype, device)
        loaded = LoadedModel(vlm, tokenizer, model)
    else:
        loaded = load_model(model, dtype=dtype, device=device)
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


def load_tiny_vl(spec: str = "tiny-vl"):
    """`tiny-vl` or `tiny-vl:SEED`: a seeded tiny random Qwen2.5-VL (fp32) with the embedded
    tokenizer (plus the vision special tokens), for tests and for trying the video path without
    weights: it sees frames exactly as a real one does, but what it says is noise."""
    from transformers import AutoTokenizer

    from streamer.sessions.models import embedded_model_dir
    from streamer.vision.vlm import build_tiny_vl

    _, _, seed = spec.partition(":")
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    return build_tiny_vl(tokenizer, seed=int(seed or 7))


VL_MODEL_TYPES = ("qwen2_5_vl",)


def is_vl_checkpoint(spec: str) -> bool:
    """Whether a Hugging Face id or directory is a vision-language model the engine runs."""
    from transformers import AutoConfig

    from streamer.sessions.models import EMBEDDED_ALIASES

    if spec in EMBEDDED_ALIASES:  # a name, not a hub id: never looked up online
        return False
    try:
        return AutoConfig.from_pretrained(spec).model_type in VL_MODEL_TYPES
    except (OSError, ValueError):
        return False  # load_model says what is wrong with it
