"""The model runner: one forward over new tokens of one or more sessions, on their live caches.

Hugging Face model definitions run unchanged. We register an attention function with
transformers' `AttentionInterface`; the model is called with `use_cache=False`, explicit
`position_ids` and a `StepMetadata` object passed as a keyword argument, which transformers
hands to every attention call. The attention function writes each layer's new keys/values
into the sessions' caches at explicit slots and attends over them with the runner's attention
backend: the pure-torch reference, or the fused Triton kernels (`kernels.backend`), which run
from a plan built once per step from the caches' extents. No globals carry per-step state, and
nothing is monkeypatched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from streamer.kernels import cpu
from streamer.kernels.backend import ReferencePlan, plan_step, resolve_backend, triton_kernels
from streamer.kernels.governor import GOVERNOR

from .kvcache import KVBuffer, KVCache, KVShape
from .multimodal import vl_parts
from .native import NativeStack
from .rope import inverse_frequencies
from .weights import WeightsInfo, describe_weights, stabilize_rows

log = logging.getLogger(__name__)

ATTENTION_NAME = "streamer_cache"


class DeferredLogits:
    """The last token's final hidden state of a step whose job did not need its logits (a
    prefill: nothing samples after reading input). The output head, a GEMV over the whole
    vocabulary (most of a prefill step on a small model), runs only if someone reads them."""

    __slots__ = ("hidden", "head", "_value")

    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module) -> None:
        self.hidden, self.head, self._value = hidden, head, None

    def value(self) -> torch.Tensor:
        if self._value is None:
            with torch.inference_mode():
                self._value = self.head(self.hidden[None])[0].float()
            self.hidden = None
        return self._value


def resolve_logits(logits) -> torch.Tensor | None:
    """A logits row, computing a deferred one."""
    return logits.value() if isinstance(logits, DeferredLogits) else logits


# Causal LMs whose logits are exactly `get_output_embeddings()` of the decoder's last hidden
# state (no scaling or soft-capping after the head): their head can be deferred per row.
PLAIN_HEAD_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(slots=True)
class SeqStep:
    """New tokens of one sequence in a packed step: written at cache slots [start, start+n).

    A fork (a question, a flash question, a reasoning stream) may keep its tokens in a cache of
    its own on top of read-only ranges of other caches: `prefixes` lists `(cache, length)`, and
    its tokens attend to all of those plus its own cache, causally. Forks with the same
    prefixes in one step read them once. Positions start at `pos0` (default: after the
    prefixes, i.e. their summed length + start).
    """

    cache: KVBuffer
    start: int
    tokens: Sequence[int]
    prefixes: tuple[tuple[KVBuffer, int], ...] = ()
    pos0: int | None = None
    offset: int = 0  # index of the first token in the packed batch
    embeds: torch.Tensor | None = None  # VL model: input embeddings `[n, hidden]` instead of the tokens'
    mpos: torch.Tensor | None = None  # VL model: explicit M-RoPE positions `[3, n]` (default: text positions)
    head: bool = True  # its job reads its last token's logits now; else they come back `DeferredLogits`

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def position(self) -> int:
        if self.pos0 is not None:
            return self.pos0 + self.start
        return sum(length for _, length in self.prefixes) + self.start


@dataclass(slots=True)
class StepMetadata:
    seqs: list[SeqStep] = field(default_factory=list)
    backend: str = "reference"
    plan: object = None  # the step's attention plan (kernels.backend.plan_step), run by every layer

    writes: list = field(default_factory=list)  # (storage, slots, token rows or None): where each layer's new K/V go

    def __post_init__(self) -> None:
        if self.plan is None:  # a caller outside the runner (one sequence, reference attention)
            self.plan = ReferencePlan(self.seqs, FORK_SUFFIX_MAX)
        self.writes = kv_writes(self.seqs)


def kv_writes(seqs: Sequence[SeqStep]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The step's K/V writes, once for every layer: per storage tensor the slots its sequences'
    new tokens go to and which rows of the packed step they are (None: all of them, when one
    storage holds every sequence: `forward` packs the sequences in order). One `index_copy_` per
    storage and layer then writes every sequence."""
    groups: dict[int, tuple[torch.Tensor, list, list]] = {}
    for seq in seqs:
        storage, base = seq.cache.storage()
        first = base + seq.start - seq.cache.prefix_len
        entry = groups.setdefault(id(storage), (storage, [], []))
        entry[1].append(torch.arange(first, first + seq.n))
        entry[2].append(torch.arange(seq.offset, seq.offset + seq.n))
    return [(storage, torch.cat(slots).to(storage.device),
             None if len(groups) == 1 else torch.cat(rows).to(storage.device))
            for storage, slots, rows in groups.values()]


FORK_SUFFIX_MAX = 128  # own tokens up to which forks of one group are batched together


def _session_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       streamer_meta: StepMetadata | None = None, **kwargs):
    """transformers attention hook: query `[1, H, N, D]`, key/value `[1, Hkv, N, D]` (packed).

    Each sequence's new K/V go to its own cache at explicit slots; then the step's attention
    plan (built once for all layers, `kernels.backend.plan_step`) runs for this layer.
    """
    if streamer_meta is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs `streamer_meta`; run through ModelRunner")
    layer = module.layer_idx
    for storage, slots, rows in streamer_meta.writes:
        k, v = (key[0], value[0]) if rows is None else (key[0].index_select(1, rows), value[0].index_select(1, rows))
        storage[layer, 0].index_copy_(1, slots, k.to(storage.dtype))
        storage[layer, 1].index_copy_(1, slots, v.to(storage.dtype))
    out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))  # [N, H, D]
    if streamer_meta.backend == "triton":
        streamer_meta.plan.run(query[0].transpose(0, 1), layer, out=out, scaling=scaling)
    else:
        streamer_meta.plan.run(query[0], layer, out, scaling)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """Masks are built per sequence inside the attention function."""
    return None


def register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _session_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def native_stack(model: torch.nn.Module) -> NativeStack | None:
    """The native stack of a model whose linear layers `weights.apply_weights` put on the C
    kernels (None otherwise). Its KV cache is fp16: half the bytes attention reads a token, the
    dtype llama.cpp keeps."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not hasattr(layers[0].self_attn, "native_qkv"):
        return None
    cpu.set_threads(torch.get_num_threads())
    return NativeStack(model, torch.float16)


class ModelRunner:
    """Owns a causal LM and runs packed steps over session caches. Not thread-safe: one
    thread (the engine's) drives it."""

    def __init__(self, model: torch.nn.Module, tokenizer, name: str = "model",
                 weights: WeightsInfo | None = None) -> None:
        register_attention()
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.vl = vl_parts(model)  # a vision-language model (sessions/multimodal.py), or None
        if self.vl is not None:  # the vision tower keeps its own attention
            model.set_attn_implementation({"text_config": ATTENTION_NAME})
        else:
            model.set_attn_implementation(ATTENTION_NAME)
        model.eval()
        stabilize_rows(model)  # a token's output never depends on how many share its step
        cfg = model.config if self.vl is None else model.config.text_config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        param = next(model.parameters())
        self.native = native_stack(model) if self.vl is None else None  # the whole step in C (sessions/native.py)
        self.kv_shape = KVShape(
            layers=cfg.num_hidden_layers,
            kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim, dtype=self.native.kv_dtype if self.native else param.dtype, device=param.device,
        )
        self.heads = cfg.num_attention_heads
        self.context_window = int(getattr(cfg, "max_position_embeddings", 2048))
        self.device = param.device
        self.attention_backend = "reference"
        self.weights = weights or describe_weights(model)  # the linear layers' format (sessions/weights.py)
        self._inv_freq: torch.Tensor | None = None
        self._plain_head = self.vl is None and getattr(model.config, "model_type", None) in PLAIN_HEAD_TYPES

    @property
    def inv_freq(self) -> torch.Tensor:
        """The model's rotary inverse frequencies (re-anchoring turns cached keys with them)."""
        if self._inv_freq is None:
            self._inv_freq = inverse_frequencies(self.model if self.vl is None else self.vl.lm)
        return self._inv_freq

    def set_attention_backend(self, requested: str | None) -> str:
        """Choose the attention backend (auto | reference | triton; None: the environment's
        STREAMER_ATTENTION_BACKEND, else auto); returns the one in use."""
        self.attention_backend = resolve_backend(requested, self.device)
        if self.attention_backend == "triton" and self.device.type == "cuda":
            self._warm_up_kernels()
        return self.attention_backend

    def _warm_up_kernels(self) -> None:
        """Compile the Triton kernels for this model's head shape now, not in its first steps
        (kernels/triton_attention.py `warm_up`)."""
        started = time.monotonic()
        shape = self.kv_shape
        triton_kernels().warm_up(self.heads, shape.kv_heads, shape.head_dim, shape.dtype, self.device)
        log.info("Triton attention kernels ready for %d heads (%d kv) of %d, %s, in %.1f s", self.heads,
                 shape.kv_heads, shape.head_dim, shape.dtype, time.monotonic() - started)

    def tokenize(self, text: str) -> list[int]:
        """Tokenize one piece on its own: never the concatenation with earlier text, so chunk
        boundaries never shift tokens that are already in the cache."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        return KVCache(self.kv_shape, max_tokens or self.context_window)

    def threads(self) -> dict | None:
        """The native pool's threads a step gets now (kernels/governor.py); None off the native stack."""
        return GOVERNOR.state(self.native.lib.threads_pool.name) if self.native is not None else None

    @torch.inference_mode()
    def forward(self, seqs: Sequence[SeqStep], logits: str = "last") -> list[torch.Tensor] | None:
        """Run the new tokens of `seqs` in one forward; caches get the new K/V at their slots
        (the caller commits them). `logits`: "last" (one row per sequence; a sequence whose step
        has `head=False` gets `DeferredLogits`), "all" (rows per token, per sequence) or "none"."""
        if not seqs:
            raise ValueError("forward needs at least one sequence")
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        for seq in seqs:
            if seq.n == 0:
                raise ValueError("a sequence in a step has no tokens")
            if self.vl is None and (seq.embeds is not None or seq.mpos is not None):
                raise ValueError(f"{self.name} is a text model: a step cannot carry embeddings or M-RoPE positions")
            seq.cache.reserve(seq.start + seq.n)
            seq.offset = len(ids)
            ids.extend(seq.tokens)
            positions.append(torch.arange(seq.position, seq.position + seq.n))
        if self.native is not None:
            # the native pool's threads shrink while other work holds cores (kernels/governor.py);
            # torch's are left alone: its results depend on its thread count (a session replayed
            # on 1 thread differs from the original on 2: tests/sessions/test_thinking.py)
            GOVERNOR.tick(len(ids))
            hidden = self.native.forward(seqs, ids, torch.cat(positions))
            return self._logits(seqs, hidden, self.native.head, logits)
        shape = self.kv_shape
        plan = plan_step(seqs, self.attention_backend, self.heads, shape.kv_heads, shape.head_dim, self.device,
                         FORK_SUFFIX_MAX)
        meta = StepMetadata(list(seqs), self.attention_backend, plan)
        if self.vl is not None:
            hidden, head = self._forward_vl(seqs, positions, meta), self.vl.head
        else:
            input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
            position_ids = torch.cat(positions).unsqueeze(0).to(self.device)
            if not self._plain_head:  # the model's own head (it may scale or cap its logits)
                last = torch.tensor([s.offset + s.n - 1 for s in seqs], device=self.device)
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 streamer_meta=meta, logits_to_keep=0 if logits == "all" else last)
                rows = out.logits[0].float()
                if logits == "all":
                    return [rows[s.offset:s.offset + s.n] for s in seqs]
                return None if logits == "none" else list(rows.unbind(0))
            out = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                           streamer_meta=meta)
            hidden, head = out.last_hidden_state[0], self.model.get_output_embeddings()
        return self._logits(seqs, hidden, head, logits)

    def _logits(self, seqs: Sequence[SeqStep], hidden: torch.Tensor, head, logits: str):
        """The step's logits from its final hidden states `[N, hidden]` (see `forward`)."""
        if logits == "none":
            return None
        if logits == "all":
            rows = head(hidden).float()
            return [rows[s.offset:s.offset + s.n] for s in seqs]
        last = [s.offset + s.n - 1 for s in seqs]  # each sequence's last row
        wanted = [row for row, s in zip(last, seqs) if s.head]
        if wanted and wanted[-1] - wanted[0] == len(wanted) - 1:  # consecutive rows (a decode step's one): a view
            picked = hidden[wanted[0]:wanted[-1] + 1]  # (a list index copies, ~5x the time, cold after the step)
        else:
            picked = hidden[wanted]
        rows = iter(head(picked).float().unbind(0) if wanted else ())
        return [next(rows) if s.head else DeferredLogits(hidden[row].clone(), head) for row, s in zip(last, seqs)]

    def _forward_vl(self, seqs: Sequence[SeqStep], positions: list[torch.Tensor], meta: StepMetadata) -> torch.Tensor:
        """A VL model's language model over input embeddings (token embeddings, or a frame's own)
        with M-RoPE positions `[3, 1, N]`; its last hidden states `[N, hidden]`."""
        vl = self.vl
        embeds = [seq.embeds.to(self.device, self.kv_shape.dtype) if seq.embeds is not None else vl.embed(seq.tokens)
                  for seq in seqs]
        mpos = [seq.mpos if seq.mpos is not None else p.expand(3, -1) for seq, p in zip(seqs, positions)]
        out = vl.lm(inputs_embeds=torch.cat(embeds)[None], position_ids=torch.cat(mpos, 1)[:, None, :].to(self.device),
                    use_cache=False, streamer_meta=meta)
        return out.last_hidden_state[0]
