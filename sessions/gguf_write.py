"""Writing a Llama-family model as a GGUF file in one tensor type, as llama.cpp's converter and
quantizer lay it out: the tests' GGUFs in every type streamer loads, and bench/decode.py's
re-exports of the embedded model.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16 and BF16 are the `gguf` package's own quantizers. It has no
quantizer for the K-quants, so Q4_K, Q5_K and Q6_K here are reference quantizers written from the
block layouts its dequantizers read (gguf.quants Q4_K/Q5_K/Q6_K): plain min/max (Q4_K, Q5_K) and
absmax (Q6_K) per sub-block, without llama.cpp's search for the best scales, so their error is
somewhat larger than llama-quantize's, never smaller. A tensor whose rows are not a whole number
of 256-weight super-blocks falls back as llama-quantize falls back: Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0.

The mixes users mostly download, Q4_K_M and Q5_K_M, are written as llama-quantize lays them out
(llama_tensor_get_type): Q4_K (Q5_K) everywhere but attn_v and ffn_down of the layers that get
more bits (the first and last eighth and every third between) and an untied output head, which
are Q6_K.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .gguf_file import GGUF_LINEARS, row_order

QK = 256
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # mix -> its base type (more bits: Q6_K)


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v and ffn_down a _M mix makes Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_kind(kind: str, tensor: str, layer: int | None, layers: int) -> str:
    """The type `kind` (a type, or a mix of MIXES) gives tensor `tensor` (attn_v, output, ...)."""
    if kind not in MIXES:
        return kind
    if tensor == "output" or (tensor in ("attn_v", "ffn_down") and layer is not None and more_bits(layer, layers)):
        return "Q6_K"
    return MIXES[kind]


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins a super-block -> the 12 bytes Q4_K.get_scale_min unpacks."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _affine_k(w: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Super-blocks of 8 x 32 weights: w ~ d sc q - dmin mn with 6-bit sc, mn (min <= 0 kept)."""
    x = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    s = (x.max(-1) - lo) / levels
    d = (s.max(-1) / 63).astype(np.float16)
    dmin = ((-lo).max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(s, df, out=np.zeros_like(s), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63).astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(x + (dminf * mn)[..., None], step, out=np.zeros_like(x), where=step > 0)
    q = np.clip(np.round(q), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks (144 bytes a 256: fp16 d, fp16 dmin, 12 bytes of scales, 128 of codes)."""
    d, dmin, sc, mn, q = _affine_k(w, 15)
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scales_mins(sc, mn), qs], axis=1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """Q5_K blocks (176 bytes a 256: d, dmin, 12 bytes of scales, 32 of high bits, 128 of low nibbles)."""
    d, dmin, sc, mn, q = _affine_k(w, 31)
    low = q & 15
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for i in range(8):
        qh |= ((q[:, i, :] >> 4) & 1) << i
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scales_mins(sc, mn), qh, qs], axis=1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes a 256: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales
    of 16 weights each, fp16 d; w = d sc (q - 32))."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    s = np.abs(x).max(-1) / 31
    d = (s.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(s, df, out=np.zeros_like(s), where=df > 0)), 0, 127).astype(np.int8)
    step = (df * sc)[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step > 0)), -32, 31)
    qu = (q + 32).astype(np.uint8).reshape(-1, 2, 128)  # halves of 128
    ql = (qu[:, :, :64] & 15) | ((qu[:, :, 64:] & 15) << 4)  # [n, 2, 64]
    qh = np.zeros((qu.shape[0], 2, 32), dtype=np.uint8)
    for t in range(4):
        qh |= ((qu[:, :, 32 * t:32 * t + 32] >> 4) & 3) << (2 * t)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def encode(weight: torch.Tensor, kind: str) -> tuple[np.ndarray, str]:
    """A 2-D float weight [rows, cols] in GGUF type `kind` (or its fallback for rows that are not
    whole super-blocks): (array to write, the type written)."""
    import gguf

    w = weight.detach().float().numpy()
    rows, cols = w.shape
    if kind in K_QUANTIZERS and cols % QK:
        kind = K_FALLBACK[kind]
    if kind == "F32":
        return np.ascontiguousarray(w), kind
    if kind in K_QUANTIZERS:
        return K_QUANTIZERS[kind](w).reshape(rows, -1), kind
    qtype = gguf.GGMLQuantizationType[kind]
    return gguf.quants.quantize(w, qtype), kind


def _copy_metadata(writer, template: Path, skip: tuple[str, ...] = ()) -> None:
    """The template GGUF's tokenizer and general fields (its architecture's own keys left out)."""
    for name, value, kind, sub in _template_fields(str(Path(template).resolve())):
        if name not in skip:
            writer.add_key_value(name, value, kind, sub_type=sub)


@functools.lru_cache(maxsize=4)
def _template_fields(template: str) -> tuple[tuple, ...]:
    """(name, value, type, array item type) of a template's fields, read once per process:
    parsing a 50k-token vocabulary with GGUFReader takes seconds (most of writing a tiny file)."""
    import gguf

    reader = gguf.GGUFReader(template)
    arch = reader.fields["general.architecture"].contents()
    return tuple((f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                 for f in reader.fields.values()
                 if not f.name.startswith(("GGUF.", f"{arch}.")) and f.name not in ("general.architecture",
                                                                                  "general.file_type"))


def export_gguf(model: nn.Module, path: Path, kind: str, template: Path, name: str | None = None) -> dict[str, int]:
    """Write a Llama/Qwen2/Qwen3 Hugging Face model as a GGUF whose 2-D weights (token embedding,
    linear layers, untied output head) are `kind` (a type, or Q4_K_M / Q5_K_M: see MIXES), norms
    and biases F32, with the template GGUF's tokenizer and chat template. Returns how many tensors
    went into each type."""
    import gguf

    cfg = model.config
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    _copy_metadata(writer, template, ("general.name",) if name else ())
    if name:
        writer.add_name(name)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    counts: dict[str, int] = {}

    def put(tname: str, weight: torch.Tensor, layer: int | None = None) -> None:
        if weight.dim() == 1:
            data, written = np.ascontiguousarray(weight.detach().float().numpy()), "F32"
        else:
            part = tname.split(".")[-2]
            data, written = encode(weight, tensor_kind(kind, part, layer, cfg.num_hidden_layers))
        counts[written] = counts.get(written, 0) + 1
        raw = None if written in ("F32", "F16") else gguf.GGMLQuantizationType[written]
        writer.add_tensor(tname, data, raw_dtype=raw)

    decoder = model.model
    put("token_embd.weight", decoder.embed_tokens.weight)
    for i, layer in enumerate(decoder.layers):
        put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        for part, module in GGUF_LINEARS.items():
            linear = layer.get_submodule(module)
            weight, bias = linear.weight.detach(), linear.bias
            if arch == "llama" and part in ("attn_q", "attn_k"):  # the converter's rotary permutation
                order = row_order(weight.shape[0], heads if part == "attn_q" else kv_heads)
                permuted = torch.empty_like(weight)
                permuted[order] = weight
                weight = permuted
            put(f"blk.{i}.{part}.weight", weight, i)
            if bias is not None:
                put(f"blk.{i}.{part}.bias", bias)
        for norm in ("q_norm", "k_norm"):
            if getattr(layer.self_attn, norm, None) is not None:
                put(f"blk.{i}.attn_{norm}.weight", getattr(layer.self_attn, norm).weight)
    put("output_norm.weight", decoder.norm.weight)
    if not cfg.tie_word_embeddings:
        put("output.weight", model.get_output_embeddings().weight)
    file_type = {"F32": "ALL_F32", "Q4_K": "MOSTLY_Q4_K_S", "Q5_K": "MOSTLY_Q5_K_S"}.get(kind, f"MOSTLY_{kind}")
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts
