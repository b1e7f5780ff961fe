"""The packed-weight cache (sessions/native.py `cached_pack`): a model from a GGUF packs its
native matrices once; later builds map them from <cache>/packed/ and compute the same logits
bit for bit; a corrupt, truncated or foreign entry is packed anew (with a warning), never
loaded; another GGUF, format or packing code gets another key.

The GGUF here is a real one, written with the `gguf` package from a tiny seeded Llama's Q4_1
blocks (in llama.cpp's layout: q/k rows permuted, blocks of fp16 d, fp16 m, 16 bytes of codes),
so a build reads it exactly as it reads the embedded model's. The kernels are loaded from the
user's cache before STREAMER_CACHE moves to a temp dir (the packed entries land there)."""

import logging
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import require_native
from streamer.sessions import gguf_file, native
from streamer.sessions.models import build_tiny_model
from streamer.sessions.runner import ModelRunner, SeqStep
from streamer.sessions.weights import GGUF_LINEARS, _gguf_row_order, apply_weights, quantize_q4_1, resolve_format

TEXT = "The lighthouse keeper was named Ada Morrow. She lived on Gull Island with a grey cat called Pepper."
PACKED = r"packed \d+ matrices for the native stack"
READ = "packed weights read from the cache"
UNUSABLE = "cannot be used"


def write_gguf(model: torch.nn.Module, path: Path, nudge: int = 0, vocabulary: list[str] | None = None) -> Path:
    """The model's linear layers as Q4_1 blocks in a GGUF, as llama.cpp's converter lays them
    out; `nudge` changes one block's codes (another GGUF of the same shape); `vocabulary`: a
    token list with scores and types in the metadata, as a real model's."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    if vocabulary is not None:
        writer.add_name("tiny with a vocabulary")
        writer.add_token_list(vocabulary)
        writer.add_token_scores([float(-i) for i in range(len(vocabulary))])
        writer.add_token_types([1] * len(vocabulary))
        writer.add_bos_token_id(1)
    for i, layer in enumerate(model.model.layers):
        for kind, module in GGUF_LINEARS.items():
            weight = layer.get_submodule(module).weight.detach()
            rows, cols = weight.shape
            codes, scale, minimum = quantize_q4_1(weight)
            if kind in ("attn_q", "attn_k"):  # the converter's rotary permutation (the reader undoes it)
                heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
                order = _gguf_row_order(rows, heads)
                permuted = [torch.empty_like(t) for t in (codes, scale, minimum)]
                for src, dst in zip((codes, scale, minimum), permuted):
                    dst[order] = src
                codes, scale, minimum = permuted
            q = codes.reshape(rows, cols // 32, 32)
            if nudge and i == 0 and kind == "ffn_down":
                q[0, 0, 0] = (q[0, 0, 0] + nudge) % 16
            packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8)
            d = scale.to(torch.float16).reshape(rows, cols // 32, 1).view(torch.uint8).reshape(rows, cols // 32, 2)
            m = minimum.to(torch.float16).reshape(rows, cols // 32, 1).view(torch.uint8).reshape(rows, cols // 32, 2)
            blocks = torch.cat([d, m, packed], dim=-1).reshape(rows, cols // 32 * 20)
            writer.add_tensor(f"blk.{i}.{kind}.weight", np.ascontiguousarray(blocks.numpy()),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture()
def cache(monkeypatch, tmp_path) -> Path:
    """An empty STREAMER_CACHE (the C kernels already loaded from the user's cache)."""
    require_native()
    root = tmp_path / "cache"
    monkeypatch.setenv("STREAMER_CACHE", str(root))
    monkeypatch.delenv("STREAMER_PACK_CACHE", raising=False)
    return root


@pytest.fixture()
def tiny_gguf(tokenizer, tmp_path) -> Path:
    return write_gguf(build_tiny_model(tokenizer, seed=5).model, tmp_path / "tiny.Q4_1.gguf")


def build(tokenizer, gguf_path: Path, caplog, fmt: str = "int4") -> tuple[ModelRunner, list[str]]:
    """A fresh tiny model (seed 5) on the native stack from `gguf_path`; the log messages of
    the weights' packing and cache."""
    caplog.clear()
    lm = build_tiny_model(tokenizer, seed=5)
    with caplog.at_level(logging.INFO, logger="streamer.sessions"):
        info = apply_weights(lm.model, fmt, gguf_path=gguf_path, native=True)
    runner = ModelRunner(lm.model, tokenizer, lm.name, info)
    assert runner.native is not None
    return runner, [r.getMessage() for r in caplog.records]


def logits(runner: ModelRunner, tokenizer) -> torch.Tensor:
    ids = tokenizer(TEXT)["input_ids"]
    with torch.inference_mode():
        return runner.forward([SeqStep(runner.new_cache(len(ids) + 8), 0, ids)], logits="all")[0]


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "packed").glob("*.bin"))


def packed(messages: list[str]) -> bool:
    """Whether `pack_native` ran (its log record)."""
    return any(re.match(PACKED, m) for m in messages)


def test_the_second_build_maps_the_packed_weights_from_the_cache_and_computes_the_same_logits(
        tokenizer, cache, tiny_gguf, caplog):
    first, log1 = build(tokenizer, tiny_gguf, caplog)
    assert packed(log1) and not any(READ in m for m in log1)
    assert first.weights.source == "gguf Q4_1"
    assert len(entries(cache)) == 1
    second, log2 = build(tokenizer, tiny_gguf, caplog)
    assert not packed(log2), log2  # the packing (and the GGUF read) did not run
    assert any(READ in m for m in log2), log2
    assert second.weights.public() == first.weights.public()
    assert torch.equal(logits(second, tokenizer), logits(first, tokenizer))
    # the cache holds the GGUF's blocks: the same weights as packing from the GGUF without it
    qkv = second.model.model.layers[1].self_attn.native_qkv
    assert torch.equal(qkv.data, first.model.model.layers[1].self_attn.native_qkv.data)


def _flip_data_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])


def _not_a_pack_file(path: Path) -> None:
    path.write_bytes(b"\0" * 4096)


def _garbled_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[20:40] = b"}{" * 10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", [_flip_data_byte, _truncate, _not_a_pack_file, _garbled_header],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_damaged_entry_is_packed_anew_with_a_warning_never_loaded(tokenizer, cache, tiny_gguf, caplog, damage):
    first, _ = build(tokenizer, tiny_gguf, caplog)
    [entry] = entries(cache)
    damage(entry)
    second, log2 = build(tokenizer, tiny_gguf, caplog)
    assert any(UNUSABLE in m for m in log2) and packed(log2), log2
    assert torch.equal(logits(second, tokenizer), logits(first, tokenizer))
    [rewritten] = entries(cache)  # written again, whole: the next build reads it
    third, log3 = build(tokenizer, tiny_gguf, caplog)
    assert not packed(log3) and any(READ in m for m in log3), log3
    assert torch.equal(logits(third, tokenizer), logits(first, tokenizer))


def test_another_gguf_format_or_packing_version_gets_another_key(tokenizer, cache, tiny_gguf, tmp_path, caplog,
                                                                monkeypatch):
    (tmp_path / "other").mkdir()
    other = write_gguf(build_tiny_model(tokenizer, seed=5).model, tmp_path / "other" / "tiny.Q4_1.gguf", nudge=1)
    assert other.stat().st_size == tiny_gguf.stat().st_size  # the same shape, one code differs
    sig = native.model_signature(build_tiny_model(tokenizer, seed=5).model)
    code = native.packing_code_digest()
    key = native.pack_key(native.file_sha256(tiny_gguf), "int4", sig, code)
    assert native.pack_key(native.file_sha256(other), "int4", sig, code) != key
    assert native.pack_key(native.file_sha256(tiny_gguf), "int8", sig, code) != key
    assert native.packing_code_digest(native.PACK_VERSION + 1) != code
    # and a build follows the key: none of these reads another's entry
    first, log1 = build(tokenizer, tiny_gguf, caplog)
    assert packed(log1)
    nudged, log2 = build(tokenizer, other, caplog)
    assert packed(log2) and not any(READ in m for m in log2), log2
    assert not torch.equal(logits(nudged, tokenizer), logits(first, tokenizer))
    _, log3 = build(tokenizer, tiny_gguf, caplog, fmt="int8")
    assert packed(log3) and not any(READ in m for m in log3), log3
    monkeypatch.setattr(native, "PACK_VERSION", native.PACK_VERSION + 1)
    _, log4 = build(tokenizer, tiny_gguf, caplog)
    assert packed(log4) and not any(READ in m for m in log4), log4


def test_pack_cache_off_packs_at_every_build_and_writes_nothing(tokenizer, cache, tiny_gguf, caplog, monkeypatch):
    monkeypatch.setenv("STREAMER_PACK_CACHE", "0")
    first, log1 = build(tokenizer, tiny_gguf, caplog)
    second, log2 = build(tokenizer, tiny_gguf, caplog)
    assert packed(log1) and packed(log2)
    assert entries(cache) == []
    assert torch.equal(logits(second, tokenizer), logits(first, tokenizer))
    monkeypatch.delenv("STREAMER_PACK_CACHE")  # on again: the next build writes it, the one after reads it
    _, log3 = build(tokenizer, tiny_gguf, caplog)
    _, log4 = build(tokenizer, tiny_gguf, caplog)
    assert packed(log3) and len(entries(cache)) == 1 and not packed(log4), (log3, log4)


def test_auto_reads_the_gguf_header_itself_and_agrees_with_gguf_reader(tokenizer, tmp_path, monkeypatch):
    """Every start with --weights auto (the default) inspects the GGUF's tensor types. gguf's
    GGUFReader builds a numpy view per metadata array entry: on the embedded model's 49k-token
    vocabulary (~100k entries) seconds, most of a warm start once the packed weights were cached.
    The header is read by sessions/gguf_file.py's own reader, which must agree with GGUFReader
    on every tensor and every scalar or string field; a truncated file is refused in one line."""
    model = build_tiny_model(tokenizer, seed=5).model
    path = write_gguf(model, tmp_path / "vocab.Q4_1.gguf", vocabulary=[f"tok{i}\u00e9" for i in range(3000)])
    reference = gguf.GGUFReader(str(path))
    tensors = [(t.name, int(t.n_elements), int(t.tensor_type)) for t in reference.tensors]
    fields = {name: f.contents() for name, f in reference.fields.items()
              if not name.startswith("GGUF.") and f.types[0] != gguf.GGUFValueType.ARRAY}
    assert "tokenizer.ggml.tokens" in reference.fields and fields["general.name"] == "tiny with a vocabulary"

    def refuse(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader parsed the whole header to choose the format")

    gguf_file._reader.cache_clear()
    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    header = gguf_file.read_header(path)
    assert header.tensors == tensors and header.fields == fields
    assert resolve_format("auto", model, "cpu", path) == "int4"
    assert gguf_file.inspect_gguf(path).label() == "Q4_1"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:4000])
    with pytest.raises(gguf_file.GgufError, match=r"^cut.gguf: not a readable GGUF file \(") as refused:
        gguf_file.inspect_gguf(cut)
    assert "\n" not in str(refused.value)
