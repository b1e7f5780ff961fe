"""The native CPU path: a Llama-family model's decoder stack on streamer's C kernels.

`apply_native(model, fmt, blocks)` puts every linear layer into a quantized matrix of the C
kernels (`int4`: Q4_1 blocks, a scale and an offset per 32 weights, the output head Q8_0;
`int8`: Q8_0 everywhere), fusing q|k|v and gate|up into one matrix each; the model's modules
become `NativeLinear` views of those matrices, so the Hugging Face forward still runs (on the
same kernels) and the float weights are freed. `NativeStack` then runs a whole packed step in
one call into C: every layer, the K/V written into each sequence's cache at its slots, and
attention over the sequence's read-only ranges and its own cache (kernels/cpu/streamer_cpu.c).
The runner's step plan (which ranges each sequence reads, grouped so a range shared by many
forks is read once for all) is `kernels.cpu.StepPlan`, laid out by `kernels/backend.py` from the
same `SeqStep`s as the torch reference's plan. Every call into C goes through `kernels/cpu.py`.

Packing a model from a GGUF gives the same bytes at every start, so `cached_pack` keeps them in
`<cache>/packed/` (keyed by the GGUF's content hash and the packing code's digest, checksummed)
and later starts map that file instead of packing (see "the packed-weight cache" below).

Numerics: each row of a step is computed by the same operations whatever shares the step, so a
token reads bit for bit the same alone or batched, one chunk or many: within a format, the
native path is its own exactness oracle. Against the float model (the fp32 path, the oracle of
the tiny-model tests) it differs by the weights' and activations' quantization.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from streamer.kernels import cpu as ck
from streamer.kernels.cpu import QuantMatrix

from .gguf_file import quantize_q4_1, quantize_q8_0
from .models import cache_root

log = logging.getLogger(__name__)

NATIVE_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def quantize(linears: Sequence[nn.Linear], bits: int, blocks: Sequence | None = None) -> QuantMatrix:
    """One matrix of the outputs of `linears` stacked (q|k|v, gate|up); `blocks` per linear: its
    blocks as a GGUF holds them in a native format (`(4, codes, d, m)` Q4_1 or `(8, codes, d,
    None)` Q8_0, sessions/gguf_file.py), or None to quantize its float weight. A matrix is 8-bit
    if any of its parts comes 8-bit (a Q4_K_M GGUF's Q6_K attn_v fused with Q4_K q and k): its
    4-bit parts are then Q8_0 of their float weights."""
    given_all = list(blocks) if blocks is not None else [None] * len(linears)
    given_all = [(4, *b) if b is not None and len(b) == 3 else b for b in given_all]  # (codes, d, m): Q4_1
    if bits == 4 and any(b is not None and b[0] == 8 for b in given_all):
        bits = 8
    codes, ds, ms, biases = [], [], [], []
    for linear, given in zip(linears, given_all):
        if given is not None and given[0] == bits:
            _, c, d, m = given
        elif bits == 8:
            c, d = quantize_q8_0(linear.weight)
            m = None
        else:
            c, d, m = quantize_q4_1(linear.weight)
        codes.append(c)
        ds.append(d.to(torch.float16))
        if m is not None:
            ms.append(m.to(torch.float16))
        biases.append(linear.bias.detach() if linear.bias is not None
                      else torch.zeros(linear.out_features))
    has_bias = any(linear.bias is not None for linear in linears)
    return QuantMatrix.pack(bits, torch.cat(codes), torch.cat(ds), torch.cat(ms) if bits == 4 else None,
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
    try:
        lib = ck.load()  # the limits below are the C kernels'
    except ck.KernelBuildError as exc:
        return str(exc)
    cols, block = lib.matrix_cols, lib.quant_block
    if heads % kv_heads or (kv_heads * head_dim) % cols:
        return f"head_dim {head_dim} x kv heads {kv_heads} not a multiple of {cols} (heads {heads})"
    if heads // kv_heads > lib.max_group:
        return f"{heads // kv_heads} query heads per kv head (the native stack takes {lib.max_group})"
    for size in (cfg.hidden_size, heads * head_dim, cfg.intermediate_size):
        if size % block:
            return f"a layer width ({size}) that is not a multiple of {block}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and kind == "mistral":
        return "sliding-window attention"
    return None


# The fused matrices of a decoder layer: attribute -> (submodule, the linears stacked in it).
FUSED = {"native_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "native_o": ("self_attn", ("o_proj",)),
         "native_gate_up": ("mlp", ("gate_proj", "up_proj")), "native_down": ("mlp", ("down_proj",))}
HEAD = "lm_head"


def _fused_linears(model: nn.Module):
    """(name, owner, attribute, linears) of every matrix the native stack fuses, in order."""
    for i, layer in enumerate(model.model.layers):
        for attr, (part, names) in FUSED.items():
            owner = getattr(layer, part)
            yield f"model.layers.{i}.{part}.{attr}", owner, attr, [getattr(owner, n) for n in names]


def pack_native(model: nn.Module, fmt: str, blocks: dict | None = None) -> dict[str, QuantMatrix]:
    """The model's linear layers as the C kernels' matrices (q|k|v and gate|up fused), keyed by
    name (`model.layers.{i}.self_attn.native_qkv`, ..., `lm_head`); the model is not changed.
    `fmt`: "int4" (Q4_1 from `blocks`, the GGUF's, else quantized; a matrix with a part that
    comes 8-bit is Q8_0; the head Q8_0) or "int8" (Q8_0: a GGUF's 8-bit blocks, else quantized)."""
    started = time.monotonic()
    bits = 4 if fmt == "int4" else 8
    blocks = blocks or {}
    out = {}
    for name, _owner, _attr, linears in _fused_linears(model):
        prefix = name.rpartition(".")[0] + "."
        given = [blocks.get(prefix + n) for n in FUSED[name.rpartition(".")[2]][1]]
        if bits == 8:  # int8 takes a GGUF's 8-bit blocks; its 4-bit ones are requantized from floats
            given = [b if b is not None and b[0] == 8 else None for b in given]
        out[name] = quantize(linears, bits, given)
    out[HEAD] = quantize([model.get_output_embeddings()], 8)
    log.info("packed %d matrices for the native stack (%s) in %.1f s", len(out), fmt, time.monotonic() - started)
    return out


def check_packed(model: nn.Module, fmt: str, matrices: dict[str, QuantMatrix]) -> None:
    """Raise PackCacheError unless `matrices` are shaped as `pack_native` packs this model."""
    bits = 4 if fmt == "int4" else 8
    head = model.get_output_embeddings()
    want = {name: (bits, sum(m.out_features for m in linears), linears[0].in_features,
                   any(m.bias is not None for m in linears)) for name, _o, _a, linears in _fused_linears(model)}
    want[HEAD] = (8, head.out_features, head.in_features, head.bias is not None)
    if set(matrices) != set(want):
        raise PackCacheError(f"it holds {len(matrices)} matrices, not this model's {len(want)}")
    lib = ck.load()
    for name, (b, n, k, has_bias) in want.items():
        m = matrices[name]
        if bits == 4 and name != HEAD and m.bits == 8:
            b = 8  # a part of it came 8-bit from the GGUF (see `quantize`)
        if (m.bits, m.n, m.k, m.bias is not None) != (b, n, k, has_bias):
            raise PackCacheError(f"{name} is {m.bits}-bit {m.n}x{m.k}, this model's is {b}-bit {n}x{k}")
        if m.data.numel() != lib.matrix_bytes(b, n, k) or (has_bias and m.bias.numel() != n):
            raise PackCacheError(f"{name} holds {m.data.numel()} bytes, not {lib.matrix_bytes(b, n, k)}")


def install_native(model: nn.Module, fmt: str, matrices: dict[str, QuantMatrix]) -> int:
    """Put the model's linear layers on packed `matrices` (from `pack_native` or the cache), in
    place; returns their bytes."""
    total = 0
    for name, owner, attr, linears in list(_fused_linears(model)):
        matrix, at = matrices[name], 0
        for n, linear in zip(FUSED[attr][1], linears):
            setattr(owner, n, NativeLinear(matrix.rows(at, at + linear.out_features), fmt))
            at += linear.out_features
        setattr(owner, attr, matrix)
        total += matrix.nbytes()
    model.set_output_embeddings(NativeLinear(matrices[HEAD], "int8" if fmt == "int4" else fmt))
    return total + matrices[HEAD].nbytes()


def apply_native(model: nn.Module, fmt: str, blocks: dict | None = None) -> int:
    """Put the model's linear layers on the C kernels, in place (q|k|v and gate|up fused);
    returns the bytes of the packed weights. `fmt`: "int4" (Q4_1, the head Q8_0) or "int8"."""
    return install_native(model, fmt, pack_native(model, fmt, blocks))


# ---- the packed-weight cache -------------------------------------------------------------------
#
# Packing the embedded model (reading its GGUF's blocks, Q8_0 of the head, interleaving every
# matrix) takes seconds at every start; its result is a function of the GGUF and of the packing
# code, so the first start writes it to <cache>/packed/ and later starts map that file. An entry
# is named by a key over the GGUF's content (sha256 of the whole file: ~0.06 s for the embedded
# 98 MB, exact where size+mtime could miss a file rewritten in place), the format, the model's
# shape and `packing_code_digest()`; it holds its key and the sha256 of its data, checked at
# every load, so a stale or corrupt entry is packed anew (with a warning), never loaded.

PACK_VERSION = 1  # the file layout below; the key also hashes the packing code itself
PACK_MAGIC = b"STRMPACK"
PACK_ALIGN = 64  # every matrix starts on a cache line; the data on a page


class PackCacheError(ValueError):
    """A packed-weight cache entry that cannot be used (missing, stale, corrupt); it is rebuilt."""


def pack_cache_enabled() -> bool:
    """`STREAMER_PACK_CACHE=0` (or off/false/no) packs at every start and writes nothing."""
    return os.environ.get("STREAMER_PACK_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def packing_code_digest(version: int | None = None) -> str:
    """What decides the packed bytes besides the GGUF: this file (the fusing), weights.py and
    gguf_file.py (reading and repacking the GGUF's blocks, the quantizers), kernels/cpu.py and the
    C source (sk_pack's layout), and the torch and transformers versions (the quantizers'
    arithmetic, the float weights a GGUF converts to)."""
    import transformers

    h = hashlib.sha256(f"streamer packed weights v{PACK_VERSION if version is None else version}\0".encode())
    for path in (Path(__file__), Path(__file__).with_name("weights.py"), Path(__file__).with_name("gguf_file.py"),
                 Path(ck.__file__), ck.SOURCE):
        h.update(path.read_bytes())
    h.update(f"\0{torch.__version__}\0{transformers.__version__}".encode())
    return h.hexdigest()


def model_signature(model: nn.Module) -> str:
    cfg = model.config
    fields = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    return json.dumps({f: getattr(cfg, f, None) for f in fields}, sort_keys=True)


def pack_key(gguf_sha256: str, fmt: str, signature: str, code: str) -> str:
    """The cache key of a packing: the GGUF's content hash, the format, the model's shape and
    the packing code's digest."""
    return hashlib.sha256("\0".join((gguf_sha256, fmt, signature, code)).encode()).hexdigest()


def _align(n: int, to: int = PACK_ALIGN) -> int:
    return (n + to - 1) // to * to


def write_packed(path: Path, key: str, matrices: dict[str, QuantMatrix], source: str | dict) -> None:
    """Write an entry atomically (a temp file in the same directory, then rename). `source`: what
    the weights were packed from (a string, or a JSON object: a GGUF's repacking report)."""
    entries, offset = [], 0
    for name, m in matrices.items():
        offset = _align(offset)
        entry = {"name": name, "bits": m.bits, "n": m.n, "k": m.k, "offset": offset, "nbytes": m.data.numel()}
        offset += m.data.numel()
        if m.bias is not None:
            offset = _align(offset)
            entry["bias_offset"] = offset
            offset += m.bias.numel() * 4
        entries.append(entry)
    blob = torch.zeros(offset, dtype=torch.uint8)
    for entry, m in zip(entries, matrices.values()):
        blob[entry["offset"]:entry["offset"] + entry["nbytes"]] = m.data
        if m.bias is not None:
            blob[entry["bias_offset"]:entry["bias_offset"] + m.bias.numel() * 4] = m.bias.float().view(torch.uint8)
    header = {"version": PACK_VERSION, "key": key, "source": source, "data_bytes": offset,
              "sha256": hashlib.sha256(blob.numpy()).hexdigest(), "matrices": entries}
    header["data_start"] = start = _align(16 + len(json.dumps(header)) + 32, 4096)  # 32: room for its digits
    text = json.dumps(header).encode()
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(PACK_MAGIC + len(text).to_bytes(8, "little") + text)
            f.write(b"\0" * (start - 16 - len(text)))
            f.write(memoryview(blob.numpy()))  # no fsync: a torn file fails its size or checksum at load
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_packed(path: Path, key: str) -> tuple[dict[str, QuantMatrix], str | dict]:
    """An entry's matrices, mapped from the file (not copied), and the source they were packed
    from. Raises PackCacheError if the file is not a whole entry for `key` or its data fails its
    checksum."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != PACK_MAGIC:
                raise PackCacheError("not a packed-weight file")
            length = int.from_bytes(head[8:], "little")
            if length > 1 << 24:
                raise PackCacheError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        if header["version"] != PACK_VERSION or header["key"] != key:
            raise PackCacheError("written for another GGUF, format or packing code")
        start, size = int(header["data_start"]), int(header["data_bytes"])
        actual = path.stat().st_size
        if actual != start + size:
            raise PackCacheError(f"{actual} bytes where its header says {start + size}")
        blob = torch.from_file(str(path), shared=False, size=actual, dtype=torch.uint8)
        data = blob[start:]
        if hashlib.sha256(data.numpy()).hexdigest() != header["sha256"]:
            raise PackCacheError("its data does not match its checksum")
        matrices = {}
        for e in header["matrices"]:
            bits, n, k, at = int(e["bits"]), int(e["n"]), int(e["k"]), int(e["offset"])
            bias = None
            if "bias_offset" in e:
                b = int(e["bias_offset"])
                bias = data[b:b + 4 * n].view(torch.float32)
            matrices[e["name"]] = QuantMatrix(bits, n, k, data[at:at + int(e["nbytes"])], bias)
        source = header["source"]
        return matrices, source if isinstance(source, dict) else str(source)
    except PackCacheError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise PackCacheError(f"unreadable ({type(exc).__name__}: {exc})") from exc


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def cached_pack(model: nn.Module, fmt: str, gguf: Path,
                pack: Callable[[], tuple[dict[str, QuantMatrix], str | dict]]
                ) -> tuple[dict[str, QuantMatrix], str | dict]:
    """`pack()`'s result (matrices, source) for this model packed from `gguf`, read from the cache
    when an entry for it is there and whole, else packed and written (under a file lock, so two
    processes starting together pack once). A cache that cannot be written only costs the next
    start the packing."""
    from filelock import FileLock

    started = time.monotonic()
    key = pack_key(file_sha256(gguf), fmt, model_signature(model), packing_code_digest())
    path = cache_root() / "packed" / f"{gguf.stem}-{fmt}-{key[:20]}.bin"

    def read() -> tuple[dict[str, QuantMatrix], str | dict] | None:
        try:
            matrices, source = read_packed(path, key)
            check_packed(model, fmt, matrices)
        except PackCacheError as exc:
            log.warning("the packed-weight cache %s cannot be used (%s): packing the weights anew", path, exc)
            return None
        log.info("packed weights read from the cache in %.2f s (%s, %.1f MB)", time.monotonic() - started,
                 path, sum(m.nbytes() for m in matrices.values()) / 1e6)
        return matrices, source

    seen = _identity(path)
    if seen is not None and (found := read()) is not None:
        return found
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock")
        lock.acquire()
    except OSError as exc:
        log.warning("the packed-weight cache %s cannot be written (%s): packing at every start", path.parent, exc)
        return pack()
    try:
        now = _identity(path)
        if now is not None and now != seen and (found := read()) is not None:  # another process wrote it
            return found
        matrices, source = pack()
        try:
            write_packed(path, key, matrices, source)
        except OSError as exc:
            log.warning("could not write the packed-weight cache %s (%s): the next start packs again", path, exc)
            return matrices, source
        for old in path.parent.glob(f"{gguf.stem}-{fmt}-*.bin"):  # entries of older code or GGUFs
            if old != path:
                old.unlink(missing_ok=True)
        log.info("packed weights cached at %s", path)
        return matrices, source
    finally:
        lock.release()


ROPE_BLOCK = 1024  # positions whose cos/sin the rotary table adds at a time
ROPE_TABLE_MAX = 1 << 17  # past this position a step runs the rotary module itself (the table stays <= 64 MB at head_dim 64)
MOVING_ROPE = ("dynamic", "longrope")  # frequencies that depend on the longest position of a call: no table


class NativeStack:
    """The decoder of a model that `apply_native` converted, as one C call per step. `kernels`:
    the build of the C kernels to run (default: this machine's)."""

    def __init__(self, model: nn.Module, kv_dtype: torch.dtype, kernels: ck.Kernels | None = None) -> None:
        self.lib = kernels or ck.load()
        self.ctx = self.lib.context()  # this stack's buffers in C
        cfg = model.config
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.head = model.get_output_embeddings()  # (as the layers: the modules the stack was built on)
        # a plain fp32 table is looked up directly (a decode step's module call and dtype/layout
        # checks cost ~30 us on the caches the step flushed); a scaled or other embedding runs its module
        self._plain_embed = (type(self.embed) is nn.Embedding and self.embed.weight.dtype == torch.float32
                             and self.embed.max_norm is None)
        self.rotary = decoder.rotary_emb
        heads = cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            layers.append(ck.LayerWeights(attn.native_qkv, attn.native_o, mlp.native_gate_up, mlp.native_down,
                                          layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                          q_norm.weight if q_norm is not None else None,
                                          k_norm.weight if k_norm is not None else None))
        scale = float(getattr(decoder.layers[0].self_attn, "scaling", head_dim ** -0.5))
        self.model = ck.DecoderModel(layers, hidden=cfg.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                     inter=cfg.intermediate_size, kv_fp16=kv_dtype == torch.float16,
                                     eps=cfg.rms_norm_eps, scale=scale, final_norm=decoder.norm.weight)
        self.hidden, self.head_dim, self.kv_dtype = cfg.hidden_size, head_dim, kv_dtype
        rope_type = getattr(self.rotary, "rope_type", "default")
        # cos/sin of positions 0 .. n-1 computed by the model's rotary module (fp32), grown a block
        # at a time; None where the frequencies move with a call's positions
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = (
            (torch.empty(0, head_dim), torch.empty(0, head_dim))
            if isinstance(rope_type, str) and rope_type not in MOVING_ROPE else None)

    def _cos_sin(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[rows, head_dim]` (fp32, contiguous) of the step's positions. The rotary
        module's values are elementwise in the position (a position's cos/sin are the same in any
        call), so a table of them gives every step the same values the module would, without its
        half dozen small ops a step (a decode step's Python runs on caches the step just flushed)."""
        table = self._rope
        if positions.numel() == 1 and table is not None:  # a decode step: one row, a view of the table's
            p = int(positions[0])
            if p < table[0].shape[0]:
                return table[0][p:p + 1], table[1][p:p + 1]
        top = int(positions.max()) + 1  # a step has at least one row
        if table is None or top > ROPE_TABLE_MAX:
            cos, sin = self.rotary(h[None], positions[None])
            return cos[0].float().contiguous(), sin[0].float().contiguous()
        have = table[0].shape[0]
        if top > have:
            more = torch.arange(have, (top + ROPE_BLOCK - 1) // ROPE_BLOCK * ROPE_BLOCK)
            cos, sin = self.rotary(h[None], more[None])
            table = self._rope = (torch.cat([table[0], cos[0].float()]), torch.cat([table[1], sin[0].float()]))
        return table[0][positions], table[1][positions]

    @torch.inference_mode()
    def forward(self, seqs: Sequence, ids: list[int], positions: torch.Tensor) -> torch.Tensor:
        """The final-normed hidden states `[N, hidden]` of the step's tokens (`ids`, at
        `positions`), each sequence's K/V written at its slots (seq.offset: its first row)."""
        ids_t = torch.tensor(ids, dtype=torch.long)
        if self._plain_embed:  # the table's rows, copied (the step updates h in place)
            h = torch.nn.functional.embedding(ids_t, self.embed.weight)
        else:
            h = self.embed(ids_t).float().contiguous()
        plan = ck.StepPlan(seqs, *self._cos_sin(h, positions))
        return self.lib.forward(self.model, plan, h, torch.empty_like(h), self.ctx)
