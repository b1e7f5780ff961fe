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
from pathlib import Path

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


# ---- the C structures (kept in step with streamer_cpu.c) --------------------------------------


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


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    P, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.sk_set_threads.argtypes, lib.sk_set_threads.restype = [i32], i32
    lib.sk_threads.argtypes, lib.sk_threads.restype = [], i32
    lib.sk_group_bytes.argtypes, lib.sk_group_bytes.restype = [i32, i32], i64
    lib.sk_matrix_bytes.argtypes, lib.sk_matrix_bytes.restype = [i32, i32, i32], i64
    lib.sk_pack.argtypes, lib.sk_pack.restype = [i32, i32, i32, P, P, P, P], None
    lib.sk_linear.argtypes, lib.sk_linear.restype = [ctypes.POINTER(QMat), P, i32, i64, P, i64], i32
    lib.sk_forward.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Plan), i32, P, P]
    lib.sk_forward.restype = i32
    lib.sk_profile.argtypes, lib.sk_profile.restype = [i32, P], i32
    lib.sk_simd.argtypes, lib.sk_simd.restype = [], i32
    return lib


_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL] = {}
_errors: dict[str, str] = {}


def load(variant: str = "native") -> ctypes.CDLL:
    """The loaded library (built at first use). Raises KernelBuildError."""
    with _lock:
        if variant in _libs:
            return _libs[variant]
        if variant in _errors:
            raise KernelBuildError(_errors[variant])
        try:
            lib = _declare(ctypes.CDLL(str(build(variant))))
        except (KernelBuildError, OSError) as exc:
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
    if simd(lib) == "portable":
        return ("this CPU has neither AVX2 (with FMA and F16C) nor AVX-512 VNNI: the portable C kernels decode "
                "several times slower than ATen's")
    return None


def simd(lib: ctypes.CDLL | None = None) -> str:
    """Which code path a library (default: this machine's) was built with: "avx512-vnni",
    "avx2" or "portable"."""
    return SIMD[(lib or load()).sk_simd()]


def set_threads(n: int, lib: ctypes.CDLL | None = None) -> int:
    """Threads the kernels use (the caller's thread included); returns the number in use."""
    return (lib or load()).sk_set_threads(max(1, int(n)))


PROFILE_PARTS = ("norm+quantize", "qkv", "rope+kv write", "attention (partials)", "attention (merge, long rows)",
                 "o", "gate+up", "down", "waiting at barriers", "head")


def profile_start(lib: ctypes.CDLL | None = None) -> None:
    """Start timing the parts of every step (small overhead: two clock reads a phase)."""
    (lib or load()).sk_profile(1, None)


def profile_stop(lib: ctypes.CDLL | None = None) -> dict[str, list[float]]:
    """Stop timing; seconds per part, per thread, since `profile_start`."""
    lib = lib or load()
    out = (ctypes.c_double * (64 * len(PROFILE_PARTS)))()
    parts = lib.sk_profile(0, out)
    threads = lib.sk_threads()
    return {name: [out[t * parts + i] for t in range(threads)] for i, name in enumerate(PROFILE_PARTS)}
