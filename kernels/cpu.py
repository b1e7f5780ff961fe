"""streamer's CPU kernels (`cpu/streamer_cpu.c`): built at first use, loaded with ctypes.

The C library runs a Llama-family decoder stack over a packed step with weight-only quantized
linear layers (4-bit or 8-bit codes, a scale and an offset per block of 32 weights, int8
activations: the arithmetic llama.cpp uses), attention over ranges of session caches, and a
persistent thread pool. See the C file's header for the math and the determinism rules.

Building: the first use compiles the source with the system's C compiler (`$CC`, else `cc` or
`gcc`; `-O3 -march=native`, a few seconds) into `<cache>/kernels/` (`$STREAMER_CACHE`, else
`$XDG_CACHE_HOME/streamer`, else `~/.cache/streamer`), named by a hash of the source, the flags,
the compiler and the CPU's features, so a later start loads it in milliseconds and a changed
source or machine builds anew. The build takes the fastest code path the CPU has: AVX-512 VNNI,
else AVX2 (+FMA, F16C), else portable C. Where no compiler exists, or only the portable path
would run (slower than ATen's kernels), `available()` is False and `unavailable_reason()` says
why; callers then fall back to ATen's kernels.

This module is the whole C boundary: the ctypes structures, every call into the library and the
pointers handed to it live here, behind typed objects (`Kernels`, `QuantMatrix`, `DecoderModel`,
`StepPlan`, `Context`). At load it checks the library's ABI version and its structures' sizes
against the declarations here (`KernelAbiError`), and takes the sizes it needs (block bytes, the
columns of a group, the limits of a step) from C. A failed call raises the exception of its
code: `KernelOutOfMemory` (a MemoryError), `KernelBadArgument`, `KernelUnsupported`,
`KernelPlanError` (ValueErrors).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .backend import layer_stride, parts_key, sequence_layout
from .governor import GOVERNOR

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "streamer_cpu.c"
FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off",
         "-fno-math-errno", "-Wall", "-Wno-unused-function")
VARIANTS = {  # the build this machine runs, and the other code paths (tests build them to check them here)
    "native": FLAGS,
    "avx2": (*FLAGS, "-mno-avx512f"),  # the AVX2 path (most laptops) on a CPU that also has AVX-512
    "portable": ("-O2", "-std=c11", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-math-errno",
                 "-Wall", "-Wno-unused-function"),  # no SIMD beyond the baseline
}
SIMD = {2: "avx512-vnni", 1: "avx2", 0: "portable"}  # sk_simd()


class KernelBuildError(RuntimeError):
    """The C kernels could not be built or loaded; the message says why and what to install."""


class KernelAbiError(KernelBuildError):
    """The built library and the ctypes declarations here disagree (a structure's size, the ABI
    version): calling it would read and write the wrong bytes."""


# ---- errors of a call -----------------------------------------------------------------------
# Each code the C kernels return (streamer_cpu.c SK_E*) is its own exception.


class KernelError(Exception):
    """A call into the C kernels failed; `code` is what it returned, `call` which function."""

    def __init__(self, call: str, code: int, detail: str) -> None:
        super().__init__(f"{call} failed ({code}): {detail}")
        self.call, self.code = call, code


class KernelOutOfMemory(KernelError, MemoryError):
    """SK_ENOMEM: a buffer of the call could not be allocated."""


class KernelBadArgument(KernelError, ValueError):
    """SK_EINVAL: an argument the kernels cannot take (no rows, a width not in whole blocks,
    query heads not a multiple of kv heads, a bit width other than 4 or 8)."""


class KernelUnsupported(KernelError, ValueError):
    """SK_EUNSUPPORTED: a valid request beyond what the kernels take (more query heads per kv
    head, or more read-only ranges for a sequence, than their tasks hold)."""


class KernelPlanError(KernelError, ValueError):
    """SK_EPLAN: an inconsistent plan (a sequence's rows outside the step, a group that is not
    there, a negative range count)."""


CALL_ERRORS = {-1: (KernelOutOfMemory, "out of memory"), -2: (KernelBadArgument, "a bad argument"),
               -3: (KernelUnsupported, "beyond what the kernels take"), -4: (KernelPlanError, "an inconsistent plan")}


def check(call: str, code: int) -> None:
    """Raise the exception of a C call's return code (nothing for SK_OK)."""
    if code == 0:
        return
    cls, detail = CALL_ERRORS.get(code, (KernelError, "an unknown error code"))
    raise cls(call, code, detail)


# ---- the C structures (checked against streamer_cpu.c at load: check_abi) ---------------------


class QMat(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("pad", ctypes.c_int32),
                ("group_bytes", ctypes.c_int64), ("data", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", QMat), ("o", QMat), ("gate_up", QMat), ("down", QMat),
                ("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)]


class Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int32), ("hidden", ctypes.c_int32), ("heads", ctypes.c_int32),
                ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("inter", ctypes.c_int32),
                ("kv_fp16", ctypes.c_int32), ("pad", ctypes.c_int32), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("layer", ctypes.POINTER(Layer)), ("final_norm", ctypes.c_void_p)]


class Range(ctypes.Structure):
    _fields_ = [("k", ctypes.c_uint64), ("v", ctypes.c_uint64), ("layer_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("len", ctypes.c_int32), ("pad", ctypes.c_int32)]


class Seq(ctypes.Structure):
    _fields_ = [("row0", ctypes.c_int32), ("n", ctypes.c_int32), ("start", ctypes.c_int32),
                ("group", ctypes.c_int32), ("own", Range)]


class Group(ctypes.Structure):
    _fields_ = [("range0", ctypes.c_int32), ("nranges", ctypes.c_int32)]


class Plan(ctypes.Structure):
    _fields_ = [("nseqs", ctypes.c_int32), ("ngroups", ctypes.c_int32), ("seqs", ctypes.POINTER(Seq)),
                ("groups", ctypes.POINTER(Group)), ("ranges", ctypes.POINTER(Range)),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]


# ---- building and loading ---------------------------------------------------------------------


def cache_dir() -> Path:
    if env := os.environ.get("STREAMER_CACHE"):
        return Path(env) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "streamer" / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(variant: str = "native") -> Path:
    """The compiled library (compiled now if not cached): `native` for this machine, or another
    code path (`VARIANTS`). Raises KernelBuildError with the compiler's message where it cannot
    be built."""
    cc = compiler()
    if cc is None:
        raise KernelBuildError("no C compiler found (set $CC, or install gcc: apt-get install gcc)")
    flags = VARIANTS[variant]
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), _compiler_version(cc).encode(),
                                     _cpu_features().encode(), platform.machine().encode()])).hexdigest()[:16]
    target = cache_dir() / f"libstreamer_cpu-{'' if variant == 'native' else variant + '-'}{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling streamer's CPU kernels (%s, one time, a few seconds) ...", variant)
    started = time.monotonic()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0:
            raise KernelBuildError(f"{cc} failed to compile {SOURCE.name}:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a process building the same library at once is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("compiled in %.1f s: %s", time.monotonic() - started, target)
    return target


ABI_VERSION = 2  # streamer_cpu.c SK_ABI_VERSION: the structures above and the signatures below
STRUCTS = {"qmat": QMat, "layer": Layer, "model": Model, "range": Range, "seq": Seq, "group": Group, "plan": Plan}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    P, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    signatures = {
        "sk_abi_version": ([], i32), "sk_simd": ([], i32), "sk_set_threads": ([i32], i32), "sk_threads": ([], i32),
        "sk_amx": ([], i32), "sk_set_amx": ([i32], i32),
        "sk_block_bytes": ([i32], i32), "sk_quant_block": ([], i32), "sk_matrix_cols": ([], i32),
        "sk_max_ranges": ([], i32), "sk_max_group": ([], i32), "sk_max_threads": ([], i32),
        "sk_group_bytes": ([i32, i32], i64), "sk_matrix_bytes": ([i32, i32, i32], i64),
        "sk_pack": ([i32, i32, i32, P, P, P, P], None),
        "sk_ctx_new": ([], P), "sk_ctx_free": ([P], None), "sk_profile": ([P, i32, P], i32),
        "sk_linear": ([P, ctypes.POINTER(QMat), P, i32, i64, P, i64], i32),
        "sk_forward": ([P, ctypes.POINTER(Model), ctypes.POINTER(Plan), i32, P, P], i32),
        **{f"sk_sizeof_{name}": ([], i64) for name in STRUCTS},
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def check_abi(lib: ctypes.CDLL, version: int = ABI_VERSION, sizes: dict[str, int] | None = None) -> None:
    """Raise KernelAbiError unless the library's ABI version is `version` and each structure has
    the size C gives it (`sizes`: name -> the size expected, by default the ctypes structure's)."""
    found = lib.sk_abi_version()
    if found != version:
        raise KernelAbiError(f"the C kernels' ABI is version {found}, kernels/cpu.py declares {version}: "
                             f"{SOURCE.name} and cpu.py are out of step")
    expected = sizes if sizes is not None else {name: ctypes.sizeof(cls) for name, cls in STRUCTS.items()}
    wrong = {name: (getattr(lib, f"sk_sizeof_{name}")(), want) for name, want in expected.items()
             if getattr(lib, f"sk_sizeof_{name}")() != want}
    if wrong:
        said = ", ".join(f"sk_{name} is {c} bytes in C, {py} in cpu.py" for name, (c, py) in wrong.items())
        raise KernelAbiError(f"the C kernels' structures differ from kernels/cpu.py's ctypes declarations: {said}")


PROFILE_PARTS = ("norm+quantize", "qkv", "rope+kv write", "attention (partials)", "attention (merge, long rows)",
                 "o", "gate+up", "down", "waiting at barriers", "head")


class Context:
    """A caller's state in the C kernels (sk_ctx): the buffers its calls reuse and its step
    timings. Freed when the object is collected."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib, self._threads = lib, lib.sk_max_threads()  # rows of sk_profile's output
        self.ptr = lib.sk_ctx_new()
        if not self.ptr:
            raise KernelOutOfMemory("sk_ctx_new", -1, "out of memory")
        weakref.finalize(self, lib.sk_ctx_free, self.ptr)

    def profile(self, enable: bool) -> list[list[float]]:
        """Start (True) or stop timing; the seconds so far per thread and part (then reset)."""
        out = (ctypes.c_double * (self._threads * len(PROFILE_PARTS)))()
        parts = self._lib.sk_profile(self.ptr, int(enable), out)
        return [[out[t * parts + i] for i in range(parts)] for t in range(self._threads)]


class Kernels:
    """One loaded build of the C kernels, called through typed methods: the library's sizes
    (from C), packing, the linear layer, a whole decoder step, the thread pool. `load()` gives
    this machine's; each is checked against the declarations here when it loads."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.cdll = _declare(lib)
        check_abi(lib)
        self.quant_block = lib.sk_quant_block()  # weights per quantization block (32)
        self.matrix_cols = lib.sk_matrix_cols()  # output columns interleaved in a group (16)
        self.max_ranges = lib.sk_max_ranges()  # read-only ranges one sequence may read
        self.max_group = lib.sk_max_group()  # query heads per kv head
        self.block_bytes = {bits: lib.sk_block_bytes(bits) for bits in (4, 8)}  # one block of a column group
        if os.environ.get("STREAMER_AMX", "1") == "0":  # the vector path for every row (same results)
            lib.sk_set_amx(0)
        self.contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self.shared = self.context()  # for callers without their own (a model's standalone linear layers)
        # the pool's threads: at most what set_threads asked for, fewer while other work holds cores
        self.threads_pool = GOVERNOR.adopt(f"native kernels {id(self):x}", self.cdll.sk_threads,
                                           self.cdll.sk_set_threads, self.cdll.sk_threads())

    def simd(self) -> str:
        return SIMD[self.cdll.sk_simd()]

    def amx(self) -> bool:
        """Whether full tiles of 16 rows run their integer sums on AMX (same results as the
        vector path: only faster)."""
        return bool(self.cdll.sk_amx())

    def set_amx(self, on: bool) -> bool:
        """Use AMX where the CPU and the kernel allow it (the default unless STREAMER_AMX=0), or
        not; returns whether it is in use."""
        return bool(self.cdll.sk_set_amx(int(bool(on))))

    def threads(self) -> int:
        return self.cdll.sk_threads()

    def set_threads(self, n: int) -> int:
        """At most `n` threads from now (the caller's included): all `n` unless the thread
        governor (kernels/governor.py) sees other work holding cores; returns the number in use."""
        self.cdll.sk_set_threads(max(1, int(n)))  # starts the workers the ceiling needs
        return self.threads_pool.set_ceiling(n)

    @property
    def ceiling(self) -> int:
        return self.threads_pool.ceiling

    def context(self) -> Context:
        ctx = Context(self.cdll)
        self.contexts.add(ctx)
        return ctx

    def group_bytes(self, bits: int, k: int) -> int:
        return self.cdll.sk_group_bytes(bits, k)

    def matrix_bytes(self, bits: int, n: int, k: int) -> int:
        return self.cdll.sk_matrix_bytes(bits, n, k)

    def pack(self, bits: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        """The packed bytes of a matrix from codes `uint8 [n, k]`, scales and offsets (fp16
        `[n, k/32]`; no offsets for 8 bits)."""
        n, k = codes.shape
        if k % self.quant_block:
            raise ValueError(f"a quantized matrix needs whole blocks of {self.quant_block} inputs, got {k}")
        data = torch.empty(self.matrix_bytes(bits, n, k), dtype=torch.uint8)
        d16 = d.to(torch.float16).contiguous()
        m16 = (m if m is not None else torch.zeros_like(d)).to(torch.float16).contiguous()
        codes = codes.to(torch.uint8).contiguous()
        self.cdll.sk_pack(bits, n, k, codes.data_ptr(), d16.data_ptr(), m16.data_ptr(), data.data_ptr())
        return data

    def linear(self, matrix: QMat, x: torch.Tensor, out: torch.Tensor, ctx: Context | None = None) -> torch.Tensor:
        """out = x W^T (+ bias): x float32 `[rows, k]`, out float32 `[rows, n]`, each row
        contiguous (rows may be strided)."""
        if x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(1) != 1 or out.stride(1) != 1:
            raise ValueError("the linear kernel reads and writes float32 rows with contiguous columns")
        if x.shape[1] != matrix.k or out.shape[1] != matrix.n or x.shape[0] != out.shape[0]:
            raise ValueError(f"shapes {tuple(x.shape)} -> {tuple(out.shape)} for a {matrix.n}x{matrix.k} matrix")
        rc = self.cdll.sk_linear((ctx or self.shared).ptr, ctypes.byref(matrix), x.data_ptr(), x.shape[0],
                                 x.stride(0), out.data_ptr(), out.stride(0))
        check("sk_linear", rc)
        return out

    def forward(self, model: "DecoderModel", plan: "StepPlan", h: torch.Tensor, out: torch.Tensor,
                ctx: Context | None = None) -> torch.Tensor:
        """Every layer of `model` over the step `plan`: h `[rows, hidden]` float32 (the residual
        stream, updated in place), out the final-normed hidden states."""
        rc = self.cdll.sk_forward((ctx or self.shared).ptr, ctypes.byref(model.c), ctypes.byref(plan.c),
                                  h.shape[0], h.data_ptr(), out.data_ptr())
        check("sk_forward", rc)
        return out

    def profile_start(self) -> None:
        for ctx in list(self.contexts):
            ctx.profile(True)

    def profile_stop(self) -> list[list[float]]:
        """Seconds per thread and part, summed over this library's contexts, since profile_start."""
        total = [[0.0] * len(PROFILE_PARTS) for _ in range(self.cdll.sk_max_threads())]
        for ctx in list(self.contexts):
            for row, got in zip(total, ctx.profile(False)):
                row[:] = [a + b for a, b in zip(row, got)]
        return total


_lock = threading.Lock()
_libs: dict[str, Kernels] = {}
_errors: dict[str, str] = {}


def load(variant: str = "native") -> Kernels:
    """The loaded library (built at first use, its ABI checked). Raises KernelBuildError."""
    with _lock:
        if variant in _libs:
            return _libs[variant]
        if variant in _errors:
            raise KernelBuildError(_errors[variant])
        try:
            lib = Kernels(ctypes.CDLL(str(build(variant))))
        except (KernelBuildError, OSError, AttributeError) as exc:  # AttributeError: a function it lacks
            _errors[variant] = str(exc)
            raise KernelBuildError(str(exc)) from exc
        _libs[variant] = lib
        return lib


def available() -> bool:
    """Whether the C kernels build here and have a SIMD path for this CPU (the portable C path
    is only for checking: ATen's kernels are faster than it)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    try:
        lib = load()
    except KernelBuildError as exc:
        return str(exc)
    if lib.simd() == "portable":
        return ("this CPU has neither AVX2 (with FMA and F16C) nor AVX-512 VNNI: the portable C kernels decode "
                "several times slower than ATen's")
    return None


def simd(lib: Kernels | None = None) -> str:
    """Which code path a library (default: this machine's) was built with: "avx512-vnni",
    "avx2" or "portable"."""
    return (lib or load()).simd()


def set_threads(n: int, lib: Kernels | None = None) -> int:
    """Threads the kernels use (the caller's thread included); returns the number in use."""
    return (lib or load()).set_threads(n)


def profile_start(lib: Kernels | None = None) -> None:
    """Start timing the parts of every step of the library's callers (its contexts open now;
    small overhead: two clock reads a phase)."""
    (lib or load()).profile_start()


def profile_stop(lib: Kernels | None = None) -> dict[str, list[float]]:
    """Stop timing; seconds per part, per thread, since `profile_start`."""
    lib = lib or load()
    seconds = lib.profile_stop()
    threads = lib.threads()
    return {name: [seconds[t][i] for t in range(threads)] for i, name in enumerate(PROFILE_PARTS)}


# ---- the typed objects callers hand to the kernels --------------------------------------------


class QuantMatrix:
    """A quantized weight matrix in the C kernels' layout (`sk_pack`: groups of 16 output
    columns interleaved block by block); `rows(a, b)` is a view of outputs [a, b) (a and b
    multiples of 16, or b the last)."""

    def __init__(self, bits: int, n: int, k: int, data: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        lib = load()
        self.bits, self.n, self.k, self.data, self.bias = bits, n, k, data, bias
        self.cols = lib.matrix_cols
        self.group_bytes = lib.group_bytes(bits, k)
        self.c = QMat(bits, n, k, 0, self.group_bytes, data.data_ptr(), None if bias is None else bias.data_ptr())

    @classmethod
    def pack(cls, bits: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
             bias: torch.Tensor | None = None) -> "QuantMatrix":
        """From codes `uint8 [n, k]` (0..15, or q + 128 for 8 bits), scales and offsets (fp16
        `[n, k/32]`; no offsets for 8 bits)."""
        n, k = codes.shape
        data = load().pack(bits, codes, d, m)
        if bias is not None:
            bias = bias.detach().float().contiguous()
        return cls(bits, n, k, data, bias)

    def rows(self, a: int, b: int) -> "QuantMatrix":
        cols = self.cols
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
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        if x.shape[0]:
            load().linear(self.c, x, out)
        return out


@dataclass
class LayerWeights:
    """One decoder layer as the kernels run it: its fused matrices and its norms' weights."""

    qkv: QuantMatrix
    o: QuantMatrix
    gate_up: QuantMatrix
    down: QuantMatrix
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None = None  # per-head norms (Qwen3)
    k_norm: torch.Tensor | None = None


class DecoderModel:
    """A decoder stack in the kernels' structures (sk_model and its layers), holding the
    tensors they point into."""

    def __init__(self, layers: Sequence[LayerWeights], *, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 inter: int, kv_fp16: bool, eps: float, scale: float, final_norm: torch.Tensor) -> None:
        keep = []

        def vec(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().float().contiguous()
            keep.append(t)
            return t.data_ptr()

        self.layers = (Layer * len(layers))()
        for i, w in enumerate(layers):
            self.layers[i] = Layer(w.qkv.c, w.o.c, w.gate_up.c, w.down.c, vec(w.in_norm), vec(w.post_norm),
                                   vec(w.q_norm), vec(w.k_norm))
        self.c = Model(len(layers), hidden, heads, kv_heads, head_dim, inter, int(kv_fp16), 0, float(eps),
                       float(scale), self.layers, vec(final_norm))
        self._keep = keep


def _range(buffer, length: int) -> Range:
    """A cache buffer's keys and values of layer 0 as the kernels address them."""
    k, v = buffer.layer(0)
    return Range(k.data_ptr(), v.data_ptr(), layer_stride(buffer, k), k.stride(0), length, 0)


class StepPlan:
    """A step's plan in the kernels' structures (sk_plan): per sequence its rows, its own cache
    and the group of read-only ranges it reads (`kernels/backend.py`'s layout of it; sequences
    reading the same ranges share a group, so the kernels read them once for all). `seqs`: the
    runner's `SeqStep`s (`cache`, `start`, `n`, `offset`, `prefixes`); cos/sin `[rows, head_dim]`."""

    def __init__(self, seqs: Sequence, cos: torch.Tensor, sin: torch.Tensor) -> None:
        groups: dict[tuple, int] = {}
        ranges: list[Range] = []
        group_list: list[Group] = []
        self.seqs = (Seq * len(seqs))()
        for i, seq in enumerate(seqs):
            own_start, parts = sequence_layout(seq)
            group = -1
            if parts:
                key = parts_key(parts)
                group = groups.get(key, -1)
                if group < 0:
                    group = groups[key] = len(group_list)
                    group_list.append(Group(len(ranges), len(parts)))
                    ranges.extend(_range(b, n) for b, n in parts)
            self.seqs[i] = Seq(seq.offset, seq.n, own_start, group, _range(seq.cache, 0))
        self.ranges = (Range * max(1, len(ranges)))(*ranges)
        self.groups = (Group * max(1, len(group_list)))(*group_list)
        self.cos, self.sin = cos, sin
        self.c = Plan(len(seqs), len(group_list), self.seqs, self.groups, self.ranges, cos.data_ptr(), sin.data_ptr())
