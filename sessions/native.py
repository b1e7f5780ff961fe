"""The native CPU path: a Llama-family model's decoder stack on streamer's C kernels.

`apply_native(model, fmt, blocks)` puts every linear layer into a quantized matrix of the C
kernels (`int4`: Q4_1 blocks, a scale and an offset per 32 weights, the output head Q8_0;
`int8`: Q8_0 everywhere), fusing q|k|v and gate|up into one matrix each; the model's modules
become `NativeLinear` views of those matrices, so the Hugging Face forward still runs (on the
same kernels) and the float weights are freed. `NativeStack` then runs a whole packed step in
one call into C: every layer, the K/V written into each sequence's cache at its slots, and
attention over the sequence's read-only ranges and its own cache (kernels/cpu/streamer_cpu.c).
The runner's step plan (which ranges each sequence reads, grouped so a range shared by many
forks is read once for all) is built here from the same `SeqStep`s as the torch reference's.

Numerics: each row of a step is computed by the same operations whatever shares the step, so a
token reads bit for bit the same alone or batched, one chunk or many: within a format, the
native path is its own exactness oracle. Against the float model (the fp32 path, the oracle of
the tiny-model tests) it differs by the weights' and activations' quantization.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import torch
from torch import nn

from streamer.kernels import cpu as ck
from streamer.kernels.backend import read_only_parts

log = logging.getLogger(__name__)

QB = 32
MAX_RANGES = 16  # read-only ranges a sequence may read (streamer_cpu.c MAX_SEGS - 1)
MAX_GROUP = 32  # query heads per kv head (streamer_cpu.c MAX_Q / GROUP_ROWS)
NATIVE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class QuantMatrix:
    """A quantized weight matrix in the C kernels' layout (`sk_pack`: groups of 16 output
    columns interleaved block by block); `rows(a, b)` is a view of outputs [a, b) (a and b
    multiples of 16, or b the last)."""

    COLS = 16

    def __init__(self, bits: int, n: int, k: int, data: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bits, self.n, self.k, self.data, self.bias = bits, n, k, data, bias
        self.group_bytes = k // QB * (544 if bits == 8 else 320)
        self.c = ck.QMat(bits, n, k, 0, self.group_bytes, data.data_ptr(),
                         None if bias is None else bias.data_ptr())

    @classmethod
    def pack(cls, bits: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
             bias: torch.Tensor | None = None) -> "QuantMatrix":
        """From codes `uint8 [n, k]` (0..15, or q + 128 for 8 bits), scales and offsets (fp16
        `[n, k/32]`; no offsets for 8 bits)."""
        lib = ck.load()
        n, k = codes.shape
        if k % QB:
            raise ValueError(f"a quantized matrix needs whole blocks of {QB} inputs, got {k}")
        data = torch.empty(lib.sk_matrix_bytes(bits, n, k), dtype=torch.uint8)
        d16 = d.to(torch.float16).contiguous()
        m16 = (m if m is not None else torch.zeros_like(d)).to(torch.float16).contiguous()
        codes = codes.to(torch.uint8).contiguous()
        lib.sk_pack(bits, n, k, codes.data_ptr(), d16.data_ptr(), m16.data_ptr(), data.data_ptr())
        if bias is not None:
            bias = bias.detach().float().contiguous()
        return cls(bits, n, k, data, bias)

    def rows(self, a: int, b: int) -> "QuantMatrix":
        cols = self.COLS
        if a % cols or (b % cols and b != self.n):
            raise ValueError(f"a view of a packed matrix starts and ends at whole groups of {cols} outputs: {a}..{b}")
        data = self.data[a // cols * self.group_bytes:(b + cols - 1) // cols * self.group_bytes]
        bias = None if self.bias is None else self.bias[a:b]
        return QuantMatrix(self.bits, b - a, self.k, data, bias)

    def nbytes(self) -> int:
        return self.data.numel() + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[rows, k]` (fp32) -> `[rows, n]`."""
        x = x.float().contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.n, dtype=torch.float32)
        if rows:
            rc = ck.load().sk_linear(ctypes.byref(self.c), x.data_ptr(), rows, self.k, out.data_ptr(), self.n)
            if rc:
                raise MemoryError(f"sk_linear failed ({rc})")
        return out


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 of a float weight [N, K] as llama.cpp makes it: per block of 32 a scale d = (max -
    min) / 15 and a minimum m (both fp16), codes round((w - m) / d) in 0..15."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QB, QB)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15.0).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(lo))
    codes = torch.round((w - m.float()[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(n, k), d, m


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 of a float weight [N, K]: per block of 32 a scale d = amax / 127 (fp16), codes
    round(w / d) in -127..127, stored + 128."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // QB, QB)
    d = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    codes = torch.round(w * inv[..., None]).clamp(-127, 127) + 128
    return codes.to(torch.uint8).reshape(n, k), d


def quantize(linears: Sequence[nn.Linear], bits: int, blocks: Sequence | None = None) -> QuantMatrix:
    """One matrix of the outputs of `linears` stacked (q|k|v, gate|up); `blocks` per linear:
    its Q4_1 (codes, d, m) as a GGUF holds them, or None to quantize its float weight."""
    codes, ds, ms, biases = [], [], [], []
    for i, linear in enumerate(linears):
        given = blocks[i] if blocks is not None else None
        if bits == 8:
            c, d = quantize_q8_0(linear.weight)
            m = None
        elif given is not None:
            c, d, m = given
        else:
            c, d, m = quantize_q4_1(linear.weight)
        codes.append(c)
        ds.append(d.to(torch.float16))
        if m is not None:
            ms.append(m.to(torch.float16))
        biases.append(linear.bias.detach() if linear.bias is not None
                      else torch.zeros(linear.out_features))
    has_bias = any(linear.bias is not None for linear in linears)
    return QuantMatrix.pack(bits, torch.cat(codes), torch.cat(ds), torch.cat(ms) if ms else None,
                            torch.cat(biases) if has_bias else None)


class NativeLinear(nn.Module):
    """A linear layer on the C kernels: a view of a packed matrix (possibly of a fused one)."""

    def __init__(self, matrix: QuantMatrix, fmt: str) -> None:
        super().__init__()
        self.matrix, self.format = matrix, fmt
        self.in_features, self.out_features = matrix.k, matrix.n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return self.matrix(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.matrix.nbytes()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def native_unsupported(model: nn.Module) -> str | None:
    """Why this model cannot run on the native stack (None: it can)."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in NATIVE_TYPES:
        return f"model type {kind!r} (the native stack runs {', '.join(NATIVE_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return "no decoder layers at model.model.layers"
    attn, mlp = layers[0].self_attn, layers[0].mlp
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not isinstance(getattr(attn, name, None), nn.Linear):
            return f"self_attn.{name} is not a linear layer"
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not isinstance(getattr(mlp, name, None), nn.Linear):
            return f"mlp.{name} is not a linear layer"
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    if heads % kv_heads or (kv_heads * head_dim) % QuantMatrix.COLS:
        return f"head_dim {head_dim} x kv heads {kv_heads} not a multiple of {QuantMatrix.COLS} (heads {heads})"
    if heads // kv_heads > MAX_GROUP:
        return f"{heads // kv_heads} query heads per kv head (the native stack takes {MAX_GROUP})"
    for size in (cfg.hidden_size, heads * head_dim, cfg.intermediate_size):
        if size % QB:
            return f"a layer width ({size}) that is not a multiple of {QB}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and kind == "mistral":
        return "sliding-window attention"
    return None


def apply_native(model: nn.Module, fmt: str, blocks: dict | None = None) -> int:
    """Put the model's linear layers on the C kernels, in place (q|k|v and gate|up fused);
    returns the bytes of the packed weights. `fmt`: "int4" (Q4_1, the head Q8_0) or "int8"."""
    bits = 4 if fmt == "int4" else 8
    blocks = blocks or {}
    total = 0
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{i}."

        def fused(owner, names, where):
            linears = [getattr(owner, n) for n in names]
            given = [blocks.get(prefix + where + n) for n in names]
            matrix = quantize(linears, bits, given if bits == 4 else None)
            at = 0
            for n, linear in zip(names, linears):
                setattr(owner, n, NativeLinear(matrix.rows(at, at + linear.out_features), fmt))
                at += linear.out_features
            return matrix

        attn.native_qkv = fused(attn, ("q_proj", "k_proj", "v_proj"), "self_attn.")
        attn.native_o = fused(attn, ("o_proj",), "self_attn.")
        mlp.native_gate_up = fused(mlp, ("gate_proj", "up_proj"), "mlp.")
        mlp.native_down = fused(mlp, ("down_proj",), "mlp.")
        total += sum(m.nbytes() for m in (attn.native_qkv, attn.native_o, mlp.native_gate_up, mlp.native_down))
    head = model.get_output_embeddings()
    model.set_output_embeddings(NativeLinear(quantize([head], 8), "int8" if bits == 4 else fmt))
    total += model.get_output_embeddings().nbytes()
    return total


def _range(buffer, length: int) -> ck.Range:
    """A cache buffer's keys and values of layer 0 as the C kernels address them."""
    k, v = buffer.layer(0)
    try:
        layer_stride = buffer.layer(1)[0].data_ptr() - k.data_ptr()
    except IndexError:
        layer_stride = 0
    return ck.Range(k.data_ptr(), v.data_ptr(), layer_stride // k.element_size(), k.stride(0), length, 0)


class NativeStack:
    """The decoder of a model that `apply_native` converted, as one C call per step."""

    def __init__(self, model: nn.Module, kv_dtype: torch.dtype) -> None:
        self.lib = ck.load()
        cfg = model.config
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        keep = []  # tensors the C structures point into

        def vec(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        layers = (ck.Layer * len(decoder.layers))()
        for i, layer in enumerate(decoder.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            layers[i] = ck.Layer(attn.native_qkv.c, attn.native_o.c, mlp.native_gate_up.c, mlp.native_down.c,
                                 vec(layer.input_layernorm.weight), vec(layer.post_attention_layernorm.weight),
                                 vec(q_norm.weight if q_norm is not None else None),
                                 vec(k_norm.weight if k_norm is not None else None))
        scale = float(getattr(decoder.layers[0].self_attn, "scaling", head_dim ** -0.5))
        self.model = ck.Model(len(decoder.layers), cfg.hidden_size, heads, kv_heads, head_dim,
                              cfg.intermediate_size, int(kv_dtype == torch.float16), 0, float(cfg.rms_norm_eps),
                              scale, layers, vec(decoder.norm.weight))
        self._keep, self._layers = keep, layers
        self.hidden, self.head_dim, self.kv_dtype = cfg.hidden_size, head_dim, kv_dtype

    @torch.inference_mode()
    def forward(self, seqs: Sequence, ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states `[N, hidden]` of the step's tokens (`ids`, at
        `positions`), each sequence's K/V written at its slots (seq.offset: its first row)."""
        rows = len(ids)
        h = self.embed(torch.tensor(ids, dtype=torch.long)).float().contiguous()
        cos, sin = self.rotary(h[None], positions[None])
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        plan, keep = self.plan(seqs, cos, sin)
        out = torch.empty_like(h)
        rc = self.lib.sk_forward(ctypes.byref(self.model), ctypes.byref(plan), rows, h.data_ptr(), out.data_ptr())
        del keep
        if rc:
            raise MemoryError(f"the native forward failed ({rc}): out of memory or an inconsistent plan")
        return out

    def plan(self, seqs: Sequence, cos: torch.Tensor, sin: torch.Tensor):
        """The step's plan for the C kernels: per sequence its rows, own cache and the group of
        read-only ranges it reads (sequences reading the same ranges share a group)."""
        groups: dict[tuple, int] = {}
        ranges: list[ck.Range] = []
        group_list: list[ck.Group] = []
        cseqs = (ck.Seq * len(seqs))()
        for i, seq in enumerate(seqs):
            cache = seq.cache
            parts = [p for c, n in seq.prefixes for p in read_only_parts(c, n)]
            if cache.prefix_len:
                parts.append((cache.prefix, cache.prefix_len))
            parts = [(b, n) for b, n in parts if n > 0]
            if len(parts) > MAX_RANGES:
                raise ValueError(f"a sequence reads {len(parts)} read-only ranges; the native stack takes {MAX_RANGES}")
            group = -1
            if parts:
                key = tuple((id(b), n) for b, n in parts)
                group = groups.get(key, -1)
                if group < 0:
                    group = groups[key] = len(group_list)
                    group_list.append(ck.Group(len(ranges), len(parts)))
                    ranges.extend(_range(b, n) for b, n in parts)
            own = _range(cache, 0)
            cseqs[i] = ck.Seq(seq.offset, seq.n, seq.start - cache.prefix_len, group, own)
        cranges = (ck.Range * max(1, len(ranges)))(*ranges)
        cgroups = (ck.Group * max(1, len(group_list)))(*group_list)
        plan = ck.Plan(len(seqs), len(group_list), cseqs, cgroups, cranges, cos.data_ptr(), sin.data_ptr())
        return plan, (cseqs, cranges, cgroups, cos, sin)
