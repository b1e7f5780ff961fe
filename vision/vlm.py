"""Qwen2.5-VL on the engine: the video encoder of a session whose engine model is a VLM, and the
models (a tiny seeded random one for tests and benchmarks, checkpoints by id or path).

The engine runs the VLM like any model (sessions/multimodal.py: input embeddings, 3-D M-RoPE
positions, frames as prefill jobs in the shared pool, windows re-anchored by rotation). This
module turns a media stream's sampled frames into those inputs: each frame is resized to fit a
visual-token budget and cut into the model's patches on the thread that decoded it (`vlm_patches.py`:
numpy/torch, since transformers' fast image processor needs torchvision, which does not import
beside this torch build) and handed to the engine, preceded by its media time as text
(`[12.5s] `): the model's positions order frames but carry no clock. The vision tower runs on
the engine thread, as the first part of the frame's job, batched with other sessions' frames.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .encoder import Frame, Observation, VisionEncoder
from .errors import MediaTooLarge
from .vlm_patches import PatchSpec, fit_size, patchify

__all__ = ["EngineFrameEncoder", "PatchSpec", "TinyVLMConfig", "build_tiny_vl", "build_tiny_vlm", "fit_size",
           "load_vlm", "patchify"]

log = logging.getLogger(__name__)


class EngineFrameEncoder(VisionEncoder):
    """The video path of a session on an engine whose model is a VLM: each frame is patched on
    the thread that encodes it (the decoder's) and handed on to the engine (`append_frame`: a job that runs the vision
    tower on the engine thread, batched with other sessions' frames, then reads the embeddings
    into the session's own reading cache), preceded by its media time as text (`[12.5s] `).
    `encode` does not wait for the engine: each observation carries the engine's future
    (`Observation.pending`); when it resolves, a callback fills in what the engine did
    (`appended`, `events`), and the caller's callback, added after it, hands the observation on.
    While a frame is in flight the stream's newest-frame-wins slot drops frames. `engine` is the
    media path's logged engine (frames are logged as blobs)."""

    name = "engine-vl"
    appends_text = False

    def __init__(self, engine, session_id: str, frame_tokens: int = 256, max_pixels: int = 4096 * 4096) -> None:
        self.engine = engine
        self.session_id = session_id
        self.frame_tokens = frame_tokens
        self.max_pixels = max_pixels
        self.runner = engine.runner
        self.frames = 0
        self.visual_tokens = 0

    def encode(self, frames: Sequence[Frame]) -> list[Observation]:
        from streamer.sessions.multimodal import frame_patches

        out = []
        for frame in frames:
            if frame.height * frame.width > self.max_pixels:
                raise MediaTooLarge(f"frame of {frame.width}x{frame.height} pixels exceeds {self.max_pixels} pixels")
            label = f"[{frame.pts:.1f}s] "
            item = frame_patches(self.runner.vl, frame.image, self.frame_tokens, self.runner.tokenize(label), frame.pts)
            obs = Observation(start_s=frame.pts, end_s=frame.pts, ts=frame.ts, tokens=item.visual_tokens,
                              frames=[frame.index])
            obs.pending = self.engine.append_frame(self.session_id, item, f"[frame {frame.pts:.2f}s]",
                                                   frame_tokens=self.frame_tokens, label=label)
            obs.pending.add_done_callback(lambda f, obs=obs: self._read(obs, f))
            out.append(obs)
        return out

    def _read(self, obs: Observation, f) -> None:
        """The engine's answer for one frame (on the thread that resolved it): what it did."""
        if f.cancelled() or f.exception() is not None:
            return  # the caller's callback reports the error
        result = f.result()
        obs.appended = result
        obs.events = ["evicted"] if result.evicted_seqs else []
        self.frames += 1
        self.visual_tokens += obs.tokens

    def state(self) -> dict:
        return {"encoder": self.name, "frames": self.frames, "visual_tokens": self.visual_tokens,
                "frame_tokens": self.frame_tokens}


# ---------------------------------------------------------------------------------------------
# models


@dataclass(slots=True)
class TinyVLMConfig:
    """A tiny random-weight Qwen2.5-VL for tests and benchmarks (vocabulary of ids only)."""

    seed: int = 0
    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 4096
    vision_hidden: int = 32
    vision_depth: int = 2
    eos_token_id: int | None = None  # default: the top id
    extra: dict = field(default_factory=dict)


def build_tiny_vlm(config: TinyVLMConfig | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded tiny Qwen2.5-VL (fp32 by default). Special ids sit at the top of the vocabulary."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = config or TinyVLMConfig()

    half = config.hidden // config.heads // 2  # rotary frequencies per head
    t = half // 4  # mrope_section splits them as Qwen2.5-VL does ([16, 24, 24] of 64): 1/4, 3/8, 3/8
    section = [t, (half - t) // 2, half - t - (half - t) // 2]
    v = config.vocab
    text = {"vocab_size": v, "hidden_size": config.hidden, "intermediate_size": config.hidden * 2,
            "num_hidden_layers": config.layers, "num_attention_heads": config.heads,
            "num_key_value_heads": config.kv_heads, "max_position_embeddings": config.max_positions,
            "bos_token_id": None, "pad_token_id": None,
            "eos_token_id": v - 1 if config.eos_token_id is None else config.eos_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}}
    vision = {"depth": config.vision_depth, "hidden_size": config.vision_hidden,
              "intermediate_size": config.vision_hidden * 2, "num_heads": 2, "out_hidden_size": config.hidden,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
              "fullatt_block_indexes": [config.vision_depth - 1]}
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=v - 6, video_token_id=v - 5,
                           vision_start_token_id=v - 4, vision_end_token_id=v - 3, **config.extra)
    torch.manual_seed(config.seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).to(dtype).eval()


VL_SPECIAL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>",
                     "<|vl_unused_0|>", "<|vl_unused_1|>")  # at the top of the vocabulary, as build_tiny_vlm wants


def build_tiny_vl(tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32, layers: int = 2):
    """A tiny seeded random Qwen2.5-VL that runs on the engine with a real text tokenizer (the
    embedded one): the vision special tokens are added to the tokenizer, and the vocabulary is
    the tokenizer's. Loads in a second; the same seed gives the same weights in every process."""
    from streamer.sessions.models import LoadedModel

    tokenizer.add_special_tokens({"additional_special_tokens": list(VL_SPECIAL_TOKENS)})
    ids = tokenizer.convert_tokens_to_ids(list(VL_SPECIAL_TOKENS))
    if ids != list(range(len(tokenizer) - len(ids), len(tokenizer))):
        raise ValueError(f"the tokenizer already has some of {VL_SPECIAL_TOKENS}; use a fresh one")
    config = TinyVLMConfig(seed=seed, vocab=len(tokenizer), layers=layers, max_positions=8192,
                           eos_token_id=tokenizer.eos_token_id)
    model = build_tiny_vlm(config, dtype)
    return LoadedModel(model, tokenizer, f"tiny-vl-{layers}x{config.hidden}-seed{seed}")


def load_vlm(spec: str, dtype: str | torch.dtype = "float32",
             device: str = "cpu") -> tuple[torch.nn.Module, object]:
    """A Qwen2.5-VL checkpoint (Hugging Face id or local directory) and its tokenizer."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from streamer.sessions.models import ModelLoadError, parse_dtype

    try:
        tokenizer = AutoTokenizer.from_pretrained(spec)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(spec, dtype=parse_dtype(dtype))
    except OSError as exc:
        raise ModelLoadError(f"cannot load vision-language model {spec!r}: {exc}") from exc
    return model.to(device).eval(), tokenizer
