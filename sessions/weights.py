"""Weight formats for the linear layers: fp32, bf16, int8 and int4 weight-only, on ATen's CPU kernels.

On a CPU a decode step is bound by the bytes of weights it reads, so the format of the linear
layers decides its speed: fp32 reads 4 bytes a weight, bf16 2, int8 1 (`aten._weight_int8pack_mm`,
one scale per output channel), int4 half a byte (`aten._weight_int4pack_mm_for_cpu`, a scale and
a zero per group of 32 weights). The quantized kernels take bf16 activations: the rest of the model
(embeddings, norms, attention, the KV cache) keeps its dtype, and each linear layer converts its
input to bf16 and its output back.

int4 keeps the output head (lm_head) int8: it is a tenth of the weights and most of the
quality, and llama.cpp keeps it 8-bit too (Q8_0).

The embedded model ships as a Q4_1 GGUF (per block of 32 weights: a scale d, a minimum m and 4-bit
codes, w = d * q + m). Its blocks load straight into the int4 kernel's layout (codes as they are,
zero = m + 8 d, since the kernel computes (q - 8) * scale + zero), so int4 runs the weights
llama.cpp runs, with the scales rounded to bf16. Other checkpoints are quantized at load
(group-wise min/max for int4, per-channel absmax for int8).

`auto` (`resolve_format`) picks by a fixed rule, stated in `AUTO_RULE`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from streamer.kernels import cpu
from streamer.kernels.cpu import simd

from .gguf_file import GGUF_LINEARS  # noqa: F401  (GGUF tensor names -> module paths; tests import it here)
from .gguf_file import QB, Repack, gguf_blocks, inspect_gguf, open_gguf, q4_1_blocks, row_order
from .native import (FUSED, NativeLinear, cached_pack, install_native, native_unsupported, pack_cache_enabled,
                     pack_native, quantize_q8_0)

log = logging.getLogger(__name__)

FORMATS = ("auto", "fp32", "bf16", "int8", "int4")
GROUP = 32  # int4 group size (Q4_1's block size)
SMALL_MODEL_PARAMS = 10_000_000  # below this, a step is overhead-bound: auto keeps fp32
AUTO_RULE = ("on a CPU: for a model loaded from a quantized GGUF its own width, int4 where most linear "
             "weights are 4-bit (Q4_0, Q4_1, Q4_K: the embedded model's Q4_1 are the same weights), int8 "
             "otherwise (Q8_0, Q5_K, Q6_K); "
             f"fp32 for models under {SMALL_MODEL_PARAMS // 1_000_000}M linear weights (tests' tiny "
             "models: overhead-bound, and the exactness oracle), int8 for other checkpoints; on other "
             "devices the weights as loaded")
COMPUTE = torch.bfloat16  # the quantized kernels' activation dtype (fastest here: avx512_bf16)


class WeightFormatError(ValueError):
    """A weight format that this model or device cannot run; the message says what to use."""


@dataclass(slots=True)
class WeightsInfo:
    """What the runner's linear layers hold: shown in /healthz, /metrics and session state."""

    format: str = "fp32"
    source: str = "checkpoint"  # checkpoint | quantized at load | gguf <types>, e.g. gguf Q4_1, gguf Q4_K+Q6_K
    linear_bytes: int = 0  # bytes of the linear layers' weights (read once per decode step)
    requested: str = "fp32"
    kernels: str = "torch"  # torch | native (<simd>[ + amx]): streamer's C kernels | aten: ATen's packed kernels
    repack: dict | None = None  # a GGUF's blocks repacked into the native formats: gguf_file.Repack.public()

    def public(self) -> dict:
        out = {"format": self.format, "requested": self.requested, "source": self.source,
               "linear_bytes": self.linear_bytes, "kernels": self.kernels}
        if self.repack is not None:
            out["repack"] = self.repack
        return out


class PackedLinear(nn.Module):
    """A linear layer whose weights live in a packed format; input and output keep their dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(COMPUTE)
        out = self.matmul(rows).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Bf16Linear(PackedLinear):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(COMPUTE), persistent=False)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(rows, self.weight)


class Int8Linear(PackedLinear):
    """Symmetric per-output-channel int8 (scale = absmax / 127)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8),
                             persistent=False)
        self.register_buffer("scales", scale.to(COMPUTE), persistent=False)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)


class Int4Linear(PackedLinear):
    """Asymmetric int4, a scale and a zero per group of 32 input weights (Q4_1's layout)."""

    def __init__(self, linear: nn.Linear, codes: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, minimum: torch.Tensor | None = None) -> None:
        super().__init__(linear)
        if codes is None:  # quantize the float weights: min/max per group
            codes, scale, minimum = quantize_q4_1(linear.weight.detach())
        n, k = codes.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1), persistent=False)
        zero = minimum.float() + 8.0 * scale.float()  # the kernel computes (q - 8) * scale + zero
        sz = torch.stack([scale.float(), zero], dim=-1).reshape(n, k // GROUP, 2).transpose(0, 1)
        self.register_buffer("scales_zeros", sz.contiguous().to(COMPUTE), persistent=False)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)


class RowStableLinear(nn.Linear):
    """An fp32 linear layer whose rows never depend on how many run together. On the CPU,
    torch's fp32 GEMM takes other paths below some row count, which round differently (~1e-7):
    a token read alone would differ from the same token in a step with others, and a replayed
    session from the original. That row count depends on the CPU and the BLAS build (4 on some
    machines, 16 on others), so it is measured once per layer shape (`min_rows`) and fewer rows
    are padded to it. (With one torch thread every row count then gives the same bits; with more,
    the GEMM's split of the rows over threads can still move a row by ~1e-7.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        least = min_rows(self.in_features, self.out_features, self.bias is not None)
        if rows.shape[0] >= least:
            return nn.functional.linear(x, self.weight, self.bias)
        padded = rows.new_zeros(least, self.in_features)
        padded[:rows.shape[0]] = rows
        out = nn.functional.linear(padded, self.weight, self.bias)[:rows.shape[0]]
        return out.reshape(*x.shape[:-1], self.out_features)


_MIN_ROWS: dict[tuple[int, int, bool], int] = {}
_ROW_CANDIDATES = (4, 8, 16, 32, 64)


def min_rows(in_features: int, out_features: int, bias: bool) -> int:
    """The fewest rows from which torch's fp32 GEMM on this CPU gives each row the bits it gets
    in a large batch, for this shape: the smallest candidate p such that every row count from p
    to 2p+1, and 96 and 160, match a 256-row product (measured once, on random data)."""
    key = (in_features, out_features, bias)
    if key not in _MIN_ROWS:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(out_features, in_features, generator=gen)
        b = torch.randn(out_features, generator=gen) if bias else None
        x = torch.randn(256, in_features, generator=gen)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the kernel paths, not how threads split the rows
        try:
            _MIN_ROWS[key] = _stable_from(x, w, b)
        finally:
            torch.set_num_threads(threads)
    return _MIN_ROWS[key]


def _stable_from(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> int:
    with torch.no_grad():
        full = nn.functional.linear(x, w, b)

        def stable(m: int) -> bool:
            return torch.equal(nn.functional.linear(x[:m], w, b), full[:m])

        return next((p for p in _ROW_CANDIDATES if all(stable(m) for m in (*range(p, 2 * p + 2), 96, 160))),
                    _ROW_CANDIDATES[-1] * 2)


def stabilize_rows(model: nn.Module) -> int:
    """Make the model's CPU fp32 linear layers `RowStableLinear`, in place (their class only: the
    weights stay where they are); returns how many."""
    count = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu":
            m.__class__ = RowStableLinear
            count += 1
    return count


def int4_fits(linear: nn.Linear) -> bool:
    """The int4 kernel wants output rows in multiples of 16 and input in whole groups."""
    return linear.out_features % 16 == 0 and linear.in_features % GROUP == 0


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 of a float weight [N, K]: codes [N, K] in 0..15, scale and minimum [N, K/32]
    (w ~ scale * q + minimum)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.reshape(n, k).to(torch.uint8), scale, lo


def dequantize_q4_1_blocks(blocks: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """GGUF Q4_1 blocks (uint8 [rows, cols/32 * 20]) -> codes [rows, cols], scale and minimum
    [rows, cols/32] (fp32): sessions/gguf_file.py q4_1_blocks."""

    return q4_1_blocks(blocks.numpy(), rows, cols)


def _gguf_row_order(rows: int, heads: int) -> torch.Tensor:

    return row_order(rows, heads)


def gguf_q4_1_linears(model: nn.Module, gguf_path: Path) -> dict[str, tuple[torch.Tensor, ...]]:
    """The 4-bit linear weights of a Llama-family GGUF (Q4_1 as they are, Q4_0 and Q4_K repacked
    to Q4_1: sessions/gguf_file.py) as (codes, scale, minimum), keyed by module name, in the
    model's row order."""

    blocks, _ = gguf_blocks(model, gguf_path)
    return {name: tuple(b[1:]) for name, b in blocks.items() if b[0] == 4}


def linear_params(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def check_request(requested: str, device: torch.device | str) -> None:
    """What can be refused before a model loads: an unknown name, a CPU-only format elsewhere."""
    if requested not in FORMATS:
        raise WeightFormatError(f"unknown weight format {requested!r}: choose one of {', '.join(FORMATS)}")
    if requested in ("int8", "int4") and torch.device(device).type != "cpu":
        raise WeightFormatError(f"--weights {requested} runs on ATen's CPU kernels; on {device} use "
                                "--weights fp32 or bf16 (or auto)")


def resolve_format(requested: str, model: nn.Module, device: torch.device | str,
                   gguf_path: Path | None = None) -> str:
    """The format to run: `requested`, or for `auto` the rule in AUTO_RULE. Raises
    WeightFormatError for a name, device or model the formats do not cover."""
    check_request(requested, device)
    cpu = torch.device(device).type == "cpu"
    dtype = next(model.parameters()).dtype
    if requested == "auto":
        if not cpu:
            return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, "fp32")
        if gguf_path is not None:

            info = inspect_gguf(gguf_path)
            if info.quantized:
                return "int4" if info.four_bit else "int8"
        return "fp32" if linear_params(model) < SMALL_MODEL_PARAMS else "int8"
    if requested == "fp32" and dtype != torch.float32:
        raise WeightFormatError(f"--weights fp32 with a {dtype} model: use --dtype float32, or --weights bf16")
    return requested


def describe_weights(model: nn.Module, requested: str | None = None) -> WeightsInfo:
    """The format of a model's linear layers as they are (unpacked: named by their dtype)."""

    native = [m for m in model.modules() if isinstance(m, NativeLinear)]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    plain = [m for m in model.modules() if isinstance(m, nn.Linear)]
    order = ("bf16", "int8", "int4")
    if native:
        fmt = max((m.format for m in native), key=order.index)
    elif packed:
        kinds = {Bf16Linear: "bf16", Int8Linear: "int8", Int4Linear: "int4"}
        fmt = max((kinds[type(m)] for m in packed), key=order.index)
    else:
        dtype = plain[0].weight.dtype if plain else torch.float32
        fmt = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    nbytes = sum(m.nbytes() for m in packed) + sum(m.weight.numel() * m.weight.element_size() for m in plain)
    kernels = "aten" if packed and fmt != "bf16" else "torch"
    if native:

        nbytes += sum(m.nbytes() for m in _fused_matrices(model))
        kernels = f"native ({simd()}{' + amx' if cpu.load().amx() else ''})"
    return WeightsInfo(format=fmt, requested=requested or fmt, linear_bytes=nbytes, kernels=kernels)


def _fused_matrices(model: nn.Module) -> list:
    """The native stack's packed matrices (each fused one counted once) and its output head."""
    out = []
    for m in model.modules():
        for name in ("native_qkv", "native_o", "native_gate_up", "native_down"):
            if hasattr(m, name):
                out.append(getattr(m, name))
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "matrix"):
        out.append(head.matrix)
    return out


def apply_weights(model: nn.Module, requested: str = "auto", device: torch.device | str = "cpu",
                  gguf_path: Path | None = None, native: bool | None = None) -> WeightsInfo:
    """Put the model's linear layers (lm_head included) into the chosen format, in place.
    int8/int4 run on streamer's C kernels (`native`, with the whole decoder stack in C: see
    sessions/native.py) where they build and the architecture is one they run, else on ATen's
    packed kernels; `native=False` forces ATen, True requires the C kernels."""
    fmt = resolve_format(requested, model, device, gguf_path)
    if fmt == "fp32" or (fmt == "bf16" and next(model.parameters()).dtype == torch.bfloat16):
        return describe_weights(model, requested)
    if fmt in ("int4", "int8") and native is not False:
        reason = native_unavailable(model)
        if reason is None:

            def pack() -> tuple[dict, str | dict]:
                blocks, repack = _gguf_native_blocks(model, gguf_path)
                repack = _as_packed(model, fmt, blocks, repack, gguf_path)
                matrices = pack_native(model, fmt, blocks)
                used = any(fmt == "int4" or b[0] == 8 for b in blocks.values())
                if not used:
                    return matrices, "quantized at load"
                source = _gguf_source(gguf_path)
                return matrices, {"source": source, "repack": repack.public()} if repack.tensors else source

            # A model from a GGUF packs the same bytes at every start: the cache keeps them.
            cached = gguf_path is not None and pack_cache_enabled()
            matrices, source = cached_pack(model, fmt, gguf_path, pack) if cached else pack()
            install_native(model, fmt, matrices)
            info = describe_weights(model, requested)
            if isinstance(source, dict):  # repacked: the cost of the start that packed it
                info.source, info.repack = str(source["source"]), dict(source["repack"])
            else:
                info.source = source
            log.info("linear layers as %s (%s) on %s: %.1f MB%s", fmt, info.source, info.kernels,
                     info.linear_bytes / 1e6, _repack_note(info.repack))
            return info
        if native:
            raise WeightFormatError(f"--weights {fmt} on the native kernels cannot run here: {reason}")
        log.warning("%s runs on ATen's kernels (several times slower to decode): %s", fmt, reason)
    blocks = gguf_q4_1_linears(model, gguf_path) if fmt == "int4" and gguf_path is not None else {}
    source = _gguf_source(gguf_path) if blocks else "quantized at load"
    info = WeightsInfo(format=fmt, requested=requested, source=source, kernels="aten" if fmt != "bf16" else "torch")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    swaps = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in swaps:
        # int4 keeps the output head int8, as llama.cpp keeps it Q8_0: on the bundled log the
        # embedded model's perplexity is 16.71 so (fp32: 16.70) and 17.32 with an int4 head.
        packed = _pack(linear, "int8" if fmt == "int4" and linear is head else fmt, blocks.get(name))
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, packed)
        info.linear_bytes += packed.nbytes()
    if fmt == "int4" and any(isinstance(m, Int8Linear) for m in model.modules()):
        log.info("layers the int4 kernel cannot shape (rows not a multiple of 16) are int8")
    log.info("linear layers as %s (%s): %.1f MB", fmt, info.source, info.linear_bytes / 1e6)
    return info


def _gguf_native_blocks(model: nn.Module, gguf_path: Path | None) -> tuple[dict, object]:
    """A GGUF's quantized linear blocks in the native formats and what repacking them cost."""

    if gguf_path is None:
        return {}, Repack()
    return gguf_blocks(model, gguf_path)


def _as_packed(model: nn.Module, fmt: str, blocks: dict, repack, gguf_path: Path | None):
    """The repacking report as `pack_native` packs the blocks: a fused matrix with an 8-bit part
    (a Q4_K_M layer's Q6_K attn_v beside Q4_K q and k), and every matrix under int8, is Q8_0, and
    its 4-bit parts are then Q8_0 of their float weights (sessions/native.py `quantize`), not
    Q4_1 nor their own blocks: they are counted as `<type>->Q8_0`, with their requantization
    error in the report's."""

    if not blocks:
        return repack
    types = {}
    for t in open_gguf(Path(gguf_path)).tensors:
        parts = t.name.split(".")  # blk.{i}.{kind}.weight
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LINEARS:
            types[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}"] = t.tensor_type.name
    out = Repack(dict(repack.tensors), _err=repack._err, _ref=repack._ref)
    for i in range(len(model.model.layers)):
        for owner, linears in FUSED.values():
            names = [f"model.layers.{i}.{owner}.{n}" for n in linears]
            given = [blocks.get(n) for n in names]
            if fmt != "int8" and not any(b is not None and b[0] == 8 for b in given):
                continue  # 4-bit: the blocks as gguf_blocks reported them
            for name, block in zip(names, given):
                if block is None or block[0] == 8:
                    continue
                kind = types[name]
                if out.tensors.get(f"{kind}->Q4_1"):
                    out.tensors[f"{kind}->Q4_1"] -= 1
                    if not out.tensors[f"{kind}->Q4_1"]:
                        del out.tensors[f"{kind}->Q4_1"]
                weight = model.get_submodule(name).weight.detach().float()
                codes, d = quantize_q8_0(weight)
                back = (codes.float().reshape(d.shape[0], -1, QB) - 128) * d.float()[..., None]
                out.add(f"{kind}->Q8_0", float((back.reshape(weight.shape) - weight).double().pow(2).sum()),
                        float(weight.double().pow(2).sum()))
    out.finish(repack.seconds)
    return out


def _gguf_source(gguf_path: Path) -> str:

    return f"gguf {inspect_gguf(gguf_path).label()}"


def _repack_note(repack: dict | None) -> str:
    if not repack:
        return ""
    kinds = ", ".join(f"{n} {k}" for k, n in repack["tensors"].items())
    return (f"; repacked at load in {repack['seconds']:.2f} s ({kinds}; relative RMS error of the "
            f"requantized weights {repack['rel_rms_error']:.2g})")


def native_unavailable(model: nn.Module) -> str | None:
    """Why int8/int4 cannot run on the native stack for this model (None: they can)."""


    if next(model.parameters()).device.type != "cpu":
        return "the model is not on the CPU"
    reason = native_unsupported(model)
    if reason is not None:
        return reason
    return cpu.unavailable_reason()


def _pack(linear: nn.Linear, fmt: str, block: tuple | None) -> PackedLinear:
    if fmt == "bf16":
        return Bf16Linear(linear)
    if fmt == "int8" or not int4_fits(linear):
        return Int8Linear(linear)  # int4 layers the kernel cannot shape stay int8
    if block is not None:
        return Int4Linear(linear, *block)
    return Int4Linear(linear)
