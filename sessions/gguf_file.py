"""Llama-family GGUF files (llama.cpp's format): what streamer runs from them, and their linear
layers' blocks in the native stack's two formats.

The native C kernels run two block formats (sessions/native.py; `quantize_q4_1` and
`quantize_q8_0` below make them from float weights): Q4_1 (per 32 weights an fp16
scale d, an fp16 offset m and 4-bit codes, w = d q + m) and Q8_0 (an fp16 scale and 8-bit codes,
w = d q). A GGUF's linear layers reach them so:

- Q4_1, Q8_0: their blocks as they are.
- Q4_0 (w = d (q - 8)) -> Q4_1 with m = -8 d: exact (a power-of-two multiple of an fp16).
- Q4_K (super-blocks of 256: an fp16 d and dmin, 6-bit scale sc and min mn per 32, 4-bit codes;
  w = d sc q - dmin mn) -> Q4_1 with d' = d sc, m' = -dmin mn rounded to fp16, the codes as
  they are: only the two products are rounded (relative 2^-11 at most).
- Q5_K, Q6_K, Q5_0, Q5_1 (5 and 6 bits do not fit 4) -> Q8_0 of their dequantized weights:
  the only lossy repacking (about a 250th of a block's range a weight); its relative RMS error
  is measured at load and reported.
- F16, BF16, F32: no blocks; `--weights` decides (quantized at load, or run as floats).

Everything else (another architecture, another tensor type, a mixture of experts) is refused by
`inspect_gguf` with one line before any weight is read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import mmap
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

QB = 32
# general.architecture values we run (Mistral and SmolLM GGUFs say "llama").
ARCHITECTURES = ("llama", "qwen2", "qwen3")
NATIVE_TYPES = ("Q4_1", "Q8_0")  # run as they are
TO_Q4_1 = ("Q4_0", "Q4_K")  # repacked without requantizing the codes
TO_Q8_0 = ("Q5_K", "Q6_K", "Q5_0", "Q5_1")  # requantized to Q8_0
FLOAT_TYPES = ("F32", "F16", "BF16")
TYPES = NATIVE_TYPES + TO_Q4_1 + TO_Q8_0 + FLOAT_TYPES
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")

# GGUF tensor names of a Llama block -> the module path in the Hugging Face model.
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


class GgufError(ValueError):
    """A GGUF file streamer does not run; the message is one line that says why."""


@dataclass(slots=True)
class GgufInfo:
    """What a GGUF holds, read from its header (no weights)."""

    path: Path
    architecture: str
    name: str
    linear_types: Counter = field(default_factory=Counter)  # type name -> linear weights in it

    @property
    def quantized(self) -> bool:
        return any(t not in FLOAT_TYPES for t in self.linear_types)

    @property
    def four_bit(self) -> bool:
        """Most linear weights are in a 4-bit type (the native int4 format suits it)."""
        four = sum(n for t, n in self.linear_types.items() if t in FOUR_BIT)
        return four * 2 > sum(self.linear_types.values())

    def label(self) -> str:
        """The linear layers' types, most weights first: 'Q4_K+Q6_K'."""
        return "+".join(t for t, _ in self.linear_types.most_common())


@dataclass(slots=True)
class Repack:
    """What loading a GGUF's blocks into the native formats cost: shown in the log and /healthz."""

    tensors: dict[str, int] = field(default_factory=dict)  # "Q4_K->Q4_1" -> tensors
    seconds: float = 0.0
    rel_rms_error: float = 0.0  # of the requantized (lossy) tensors vs the GGUF's weights; 0 if none
    _err: float = 0.0
    _ref: float = 0.0

    def add(self, kind: str, err_sq: float = 0.0, ref_sq: float = 0.0) -> None:
        self.tensors[kind] = self.tensors.get(kind, 0) + 1
        self._err += err_sq
        self._ref += ref_sq

    def finish(self, seconds: float) -> None:
        self.seconds = seconds
        self.rel_rms_error = (self._err / self._ref) ** 0.5 if self._ref > 0 else 0.0

    def public(self) -> dict:
        return {"tensors": dict(self.tensors), "seconds": round(self.seconds, 3),
                "rel_rms_error": float(f"{self.rel_rms_error:.3g}")}


def is_gguf_path(spec: str) -> bool:
    return spec.lower().endswith(".gguf")


@functools.lru_cache(maxsize=2)
def _reader(path: str, size: int, mtime_ns: int):
    """A GGUFReader (parsing the header of a GGUF with a 50k-token vocabulary takes seconds, and
    a load that packs reads it for the config and the blocks; `inspect_gguf` reads only the
    header, with `read_header`); keyed by the file's identity so a rewritten file is read anew."""
    from gguf.gguf_reader import GGUFReader  # the class: inside shared_reads, gguf.GGUFReader is not

    return GGUFReader(path)


def open_gguf(path: Path):
    st = path.stat()
    return _reader(str(path.resolve()), st.st_size, st.st_mtime_ns)


_shared = threading.Lock()
_shared_depth = 0


@contextlib.contextmanager
def shared_reads():
    """Within this block, transformers' reads of a GGUF share `open_gguf`'s parse. It parses the
    file once for the tokenizer, once for the config and once for the weights (`from gguf import
    GGUFReader` inside its loader), and with a 50k-token vocabulary each parse takes seconds (3 of
    a tiny model's 4 s load). Read-only reads of the same file give the same reader; anything else
    goes to the class as before. Nested and concurrent blocks keep one patch, removed by the last."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    def reader(path, mode="r"):
        return open_gguf(Path(path)) if mode == "r" else GGUFReader(path, mode)

    global _shared_depth
    with _shared:
        _shared_depth += 1
        if _shared_depth == 1:
            gguf.GGUFReader = reader
    try:
        yield
    finally:
        with _shared:
            _shared_depth -= 1
            if _shared_depth == 0:
                gguf.GGUFReader = GGUFReader


# GGUF metadata value types (gguf.GGUFValueType): fixed-size scalars by struct code; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class GgufHeader:
    """What `inspect_gguf` needs of a GGUF: its scalar and string metadata (arrays left out) and
    each tensor's (name, element count, ggml type id)."""

    fields: dict[str, object]
    tensors: list[tuple[str, int, int]]


def read_header(path: Path) -> GgufHeader:
    """The header of a little-endian GGUF (version 2 or 3), read without its weights and without
    building its arrays: gguf.GGUFReader makes a numpy view per vocabulary entry (~100k on a
    50k-token model), seconds at every start, where skipping them by their lengths takes
    milliseconds. ValueError (or struct.error) for a file that is not such a GGUF."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
            raise ValueError("no little-endian GGUF v2/v3 header")
        n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", data, at)
            if at + 8 + n > len(data):
                raise ValueError(f"a string of {n} bytes runs past the end of the file")
            return data[at + 8:at + 8 + n].decode("utf-8", "replace"), at + 8 + n

        def skip(kind: int, at: int, count: int = 1) -> int:
            if kind in _SCALARS:
                return at + count * struct.calcsize("<" + _SCALARS[kind])
            if kind == _STRING:
                for _ in range(count):
                    at += 8 + struct.unpack_from("<Q", data, at)[0]
                return at
            if kind == _ARRAY:
                for _ in range(count):
                    item, n = struct.unpack_from("<IQ", data, at)
                    at = skip(item, at + 12, n)
                return at
            raise ValueError(f"unknown metadata value type {kind}")

        fields: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", data, pos)
            pos += 4
            if kind in _SCALARS:
                (fields[key],) = struct.unpack_from("<" + _SCALARS[kind], data, pos)
            elif kind == _STRING:
                fields[key], _ = string(pos)
            pos = skip(kind, pos)
        tensors = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", data, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
            type_id, _offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, int(np.prod(dims, dtype=np.int64)) if dims else 1, type_id))
    return GgufHeader(fields, tensors)


def _type_name(type_id: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def _field(reader, name: str):
    f = reader.fields.get(name)
    return None if f is None else f.contents()


def inspect_gguf(path: str | Path) -> GgufInfo:
    """The GGUF's architecture and linear layers' types; GgufError (one line) if streamer does
    not run it: a missing or unreadable file, another architecture, a mixture of experts, a
    tensor type outside TYPES."""
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"{path}: no such GGUF file")
    try:
        header = read_header(path)
    except (ValueError, OSError, struct.error) as exc:
        raise GgufError(f"{path.name}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = header.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GgufError(f"{path.name}: architecture {arch!r} is not one streamer runs from a GGUF "
                        f"({', '.join(ARCHITECTURES)}: Llama, Mistral, SmolLM, Qwen2/2.5/3)")
    info = GgufInfo(path, arch, str(header.fields.get("general.name") or path.stem))
    for name, n_elements, type_id in header.tensors:
        kind = _type_name(type_id)
        if "_exps" in name:
            raise GgufError(f"{path.name}: a mixture of experts ({name}); streamer runs dense models")
        if kind not in TYPES:
            raise GgufError(f"{path.name}: tensor {name} is {kind}; streamer runs {', '.join(TYPES)}")
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS and parts[3] == "weight":
            info.linear_types[kind] += n_elements  # not their biases (Qwen2's q/k/v: F32)
    if not info.linear_types:
        raise GgufError(f"{path.name}: no decoder layers (blk.N.attn_q.weight ...) in it")
    return info


def _f16(b: np.ndarray) -> torch.Tensor:
    """fp16 values stored as 2 bytes (the last axis) -> fp32 tensor."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def q4_1_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Q4_1 blocks (20 bytes: fp16 d, fp16 m, 16 bytes of codes, low nibbles weights 0..15 of
    the block, high 16..31) -> codes uint8 [rows, cols], d and m [rows, cols/32] (fp32)."""
    b = data.reshape(rows, cols // QB, 20)
    qs = torch.from_numpy(np.ascontiguousarray(b[..., 4:]))
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    return codes.reshape(rows, cols), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def q4_0_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Q4_0 (18 bytes: fp16 d, 16 bytes of codes; w = d (q - 8)) as Q4_1: m = -8 d, exact."""
    b = data.reshape(rows, cols // QB, 18)
    qs = torch.from_numpy(np.ascontiguousarray(b[..., 2:]))
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
    d = _f16(b[..., 0:2])
    return codes.reshape(rows, cols), d, -8.0 * d


def q4_k_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """Q4_K (144 bytes a 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of
    codes; sub-block 2c+h is the nibble h of bytes 32c..32c+31) as Q4_1 per 32: d sc, -dmin mn."""
    from gguf.quants import Q4_K

    b = data.reshape(rows * (cols // 256), 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    scale = (d[:, None] * torch.from_numpy(sc.astype(np.float32))).reshape(rows, cols // QB)
    minimum = (-dmin[:, None] * torch.from_numpy(mn.astype(np.float32))).reshape(rows, cols // QB)
    qs = torch.from_numpy(np.ascontiguousarray(b[:, 16:])).reshape(-1, 4, 1, 32)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(rows, cols)
    return codes, scale, minimum


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


def q8_0_blocks(data: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 (34 bytes: fp16 d, 32 int8 codes) -> codes + 128 uint8 [rows, cols], d [rows, cols/32]."""
    b = data.reshape(rows, cols // QB, 34)
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.int16) + 128)
    return q.to(torch.uint8).reshape(rows, cols), _f16(b[..., 0:2])


def _requantize_q8_0(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Q8_0 of float weights and the squared error it adds (and the weights' squared norm)."""
    codes, d = quantize_q8_0(weights)
    n, k = weights.shape
    back = (codes.float().reshape(n, k // QB, QB) - 128) * d.float()[..., None]
    err = float((back.reshape(n, k) - weights).double().pow(2).sum())
    return codes, d, err, float(weights.double().pow(2).sum())


def row_order(rows: int, heads: int) -> torch.Tensor:
    """The inverse of the q/k row permutation llama.cpp's converter applies to Llama GGUFs (it
    interleaves the two rotary halves of each head): row i of the Hugging Face weight is GGUF
    row order[i]."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


# A linear layer's blocks in a native format: (4, codes, d, m) or (8, codes + 128, d, None).
Block = tuple


def tensor_block(t, arch: str, cfg, repack: Repack) -> Block | None:
    """One GGUF linear tensor's blocks in a native format, in the model's row order (None for a
    float tensor: --weights decides)."""
    import gguf

    kind = t.tensor_type.name
    cols, rows = (int(x) for x in t.shape)
    data = np.asarray(t.data).view(np.uint8)
    if kind in FLOAT_TYPES:
        return None
    if kind == "Q4_1":
        block = (4, *q4_1_blocks(data, rows, cols))
    elif kind == "Q4_0":
        block = (4, *q4_0_blocks(data, rows, cols))
        repack.add("Q4_0->Q4_1")
    elif kind == "Q4_K":
        block = (4, *q4_k_blocks(data, rows, cols))
        repack.add("Q4_K->Q4_1")
    elif kind == "Q8_0":
        block = (8, *q8_0_blocks(data, rows, cols), None)
    else:  # 5 and 6 bits: Q8_0 of the GGUF's own dequantization
        weights = torch.from_numpy(gguf.quants.dequantize(data, t.tensor_type).astype(np.float32)).reshape(rows, cols)
        codes, d, err, ref = _requantize_q8_0(weights)
        block = (8, codes, d, None)
        repack.add(f"{kind}->Q8_0", err, ref)
    part = t.name.split(".")[2]
    if arch == "llama" and part in ("attn_q", "attn_k"):
        heads = cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
        order = row_order(rows, heads)
        block = (block[0], *(None if x is None else x[order] for x in block[1:]))
    return block


def gguf_blocks(model: torch.nn.Module, path: Path) -> tuple[dict[str, Block], Repack]:
    """The quantized linear weights of a Llama-family GGUF in the native formats, keyed by module
    name (`model.layers.{i}.self_attn.q_proj`), and what repacking them cost."""
    started = time.monotonic()
    reader = open_gguf(Path(path))
    arch = _field(reader, "general.architecture")
    repack, out = Repack(), {}
    for t in reader.tensors:
        parts = t.name.split(".")  # blk.{i}.{kind}.weight
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LINEARS or parts[3] != "weight":
            continue
        block = tensor_block(t, arch, model.config, repack)
        if block is not None:
            out[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = block
    repack.finish(time.monotonic() - started)
    return out, repack  # logged as packed (weights.py: fusing can make 4-bit blocks Q8_0)
