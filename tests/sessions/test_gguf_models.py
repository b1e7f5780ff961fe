"""`--model path/to/file.gguf`: Llama-family GGUFs in every type streamer loads (sessions/gguf_file.py).

The GGUFs are real files written with the `gguf` package (sessions/gguf_write.py: the package's
own quantizers, and reference K-quantizers checked here against the package's dequantizers) from
one tiny seeded Llama (hidden 256, so every tensor is whole K-quant super-blocks), with the
embedded model's tokenizer and chat template in their metadata. Each is loaded as a user's file
is: the reference is transformers' dequantization of it (the float model), the model under test
the same file on the native stack in the format `auto` picks, its blocks taken as they are or
repacked. Tiny seeded Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim 64) files, whose q/k
rows are not permuted as Llama's are, are held to the same checks in F32, Q8_0 and Q4_K, and a
real `streamer serve --model` process runs a Qwen2 Q6_K file: /healthz states the repacking, a
session reads text and answers. The C kernels are built in the user's cache before STREAMER_CACHE
moves to a temp dir (its kernels/ links to the user's, so the server finds them built).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import require_native
from streamer.sessions.gguf_file import QB, gguf_blocks, inspect_gguf
from streamer.sessions.gguf_write import encode, export_gguf
from streamer.sessions.models import ModelLoadError, embedded_gguf_path, load_model
from streamer.sessions.runner import ModelRunner, SeqStep
from streamer.sessions.weights import apply_weights

TEXT = "The lighthouse keeper was named Ada Morrow. She lived on Gull Island with a grey cat called Pepper."
# type -> (the format auto runs, how its blocks reach the kernels, max |logit error| / logit std vs
# the dequantized reference). Native and losslessly repacked types differ only by the kernels'
# 8-bit activations and Q8_0 head (measured here: up to ~0.05 of the std for Q8_0); Q5_K/Q6_K
# add their requantization to Q8_0 (~0.08); the float files run as --weights auto puts them (int8
# here: the tiny model's 12M-weight head is over the 10M line), so they add Q8_0's weight error
# (~0.09).
TYPES = {"Q4_0": ("int4", "Q4_0->Q4_1", 0.15), "Q4_1": ("int4", None, 0.15), "Q8_0": ("int8", None, 0.05),
         "Q4_K": ("int4", "Q4_K->Q4_1", 0.15), "Q5_K": ("int8", "Q5_K->Q8_0", 0.12),
         "Q6_K": ("int8", "Q6_K->Q8_0", 0.12), "F16": ("int8", None, 0.12), "BF16": ("int8", None, 0.12),
         "F32": ("int8", None, 0.12),
         # the mixes users mostly download: layer 1's attn_v and ffn_down are Q6_K (gguf_write.more_bits);
         # its q|k|v matrix is then 8-bit, so Q4_K_M's q and k there are Q8_0 of their weights
         # (measured: 0.065 Q4_K_M, 0.082 Q5_K_M)
         "Q4_K_M": ("int4", {"Q4_K->Q4_1": 10, "Q4_K->Q8_0": 2, "Q6_K->Q8_0": 2}, 0.15),
         "Q5_K_M": ("int8", {"Q5_K->Q8_0": 12, "Q6_K->Q8_0": 2}, 0.12)}
# the reference (the file dequantized) against the float model it was written from: max |error| / std
FILE_ERROR = {"Q4_0": 1.5, "Q4_1": 1.5, "Q8_0": 0.1, "Q4_K": 1.5, "Q5_K": 0.6, "Q6_K": 0.3, "F16": 0.01,
              "BF16": 0.05, "F32": 0.0, "Q4_K_M": 1.5, "Q5_K_M": 0.6}


def tiny_llama(tokenizer, seed: int = 3) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def source(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory) -> dict[str, Path]:
    """A GGUF of the tiny model in each type, written on first use."""
    root = tmp_path_factory.mktemp("gguf")

    class Files(dict):
        def __missing__(self, kind: str) -> Path:
            path = root / f"tiny.{kind}.gguf"
            export_gguf(source, path, kind, embedded_gguf_path(), name="tiny llama")
            return self.setdefault(kind, path)

    return Files()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """A private STREAMER_CACHE (pack cache entries) whose kernels/ is the user's, so a server
    started as a subprocess finds the library built already."""
    from streamer.kernels import cpu

    require_native()
    root = tmp_path_factory.mktemp("cache")
    (root / "kernels").symlink_to(cpu.cache_dir(), target_is_directory=True)
    old = os.environ.get("STREAMER_CACHE")
    os.environ["STREAMER_CACHE"] = str(root)
    yield root
    if old is None:
        os.environ.pop("STREAMER_CACHE", None)
    else:
        os.environ["STREAMER_CACHE"] = old


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


# ---- the writer's K-quants, checked against the gguf package's dequantizers --------------------

@pytest.mark.parametrize("kind,bound", [("Q4_K", 0.12), ("Q5_K", 0.06), ("Q6_K", 0.05)])
def test_reference_k_quantizers_decode_through_the_gguf_package(kind, bound):
    w = torch.randn(64, 512) * torch.linspace(0.01, 1.0, 512)  # ranges that differ per block
    data, written = encode(w, kind)
    assert written == kind
    back = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])).reshape(64, 512)
    rel = float((back - w).norm() / w.norm())
    assert rel < bound, rel
    # and a row that is not whole super-blocks falls back as llama-quantize does
    assert encode(torch.randn(4, 96), kind)[1] == {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}[kind]


# ---- the blocks the native stack takes, against the gguf package's dequantization ---------------

def _dequantized(block) -> torch.Tensor:
    bits, codes, d, m = block
    n, k = codes.shape
    q = codes.float().reshape(n, k // QB, QB)
    if bits == 8:
        return ((q - 128) * d.to(torch.float16).float()[..., None]).reshape(n, k)
    return (q * d.to(torch.float16).float()[..., None] + m.to(torch.float16).float()[..., None]).reshape(n, k)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_native_blocks_are_the_gguf_weights(kind, files, source):
    """Every linear layer's blocks, as the kernels get them (scales in fp16), against the file's
    weights as gguf dequantizes them: exact for Q4_0, Q4_1, Q8_0; Q4_K's only rounding is its
    scale products to fp16; Q5_K/Q6_K carry Q8_0's requantization, which the report states."""
    from transformers import AutoModelForCausalLM

    path = files[kind]
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    blocks, repack = gguf_blocks(source, path)
    assert len(blocks) == 2 * 7
    err = ref_sq = 0.0
    for name, block in blocks.items():
        want = ref.get_submodule(name).weight.detach()
        got = _dequantized(block)
        err += float((got - want).double().pow(2).sum())
        ref_sq += float(want.double().pow(2).sum())
        if kind in ("Q4_0", "Q4_1", "Q8_0"):
            assert torch.equal(got, want), name
        elif kind == "Q4_K":
            # d sc and dmin mn rounded to fp16 (2^-11 relative), times codes up to 15
            assert float((got - want).abs().max()) <= 2 ** -9 * float(want.abs().max()), name
    rel = (err / ref_sq) ** 0.5
    expected = TYPES[kind][1]
    assert repack.tensors == ({expected: 14} if expected else {})
    if kind in ("Q5_K", "Q6_K"):
        assert 0 < rel < 0.01 and repack.rel_rms_error == pytest.approx(rel, rel=1e-3)
    else:
        assert repack.rel_rms_error == 0.0


# ---- loaded models: logits, the format auto picks, what /healthz says, incremental == one-shot ---

@pytest.mark.parametrize("kind", list(TYPES))
def test_a_gguf_in_each_type_runs_on_the_native_stack_within_its_tolerance(kind, files, source, cache, tokenizer):
    fmt, repacked, tolerance = TYPES[kind]
    path = files[kind]
    ref = load_model(str(path))
    ids = ref.tokenizer(TEXT)["input_ids"]
    assert ids == tokenizer(TEXT)["input_ids"]  # the tokenizer came from the file's metadata
    assert ref.tokenizer.chat_template == tokenizer.chat_template
    expected = logits(ref.model, ids)
    scale = float(expected.std())
    file_error = float((expected - logits(source, ids)).abs().max()) / scale
    assert file_error <= FILE_ERROR[kind], file_error

    model = copy.deepcopy(ref.model)
    info = apply_weights(model, "auto", "cpu", ref.gguf)
    public = info.public()
    assert (info.format, info.kernels.startswith("native")) == (fmt, True), public
    if kind in ("F16", "BF16", "F32"):
        assert info.source == "quantized at load" and "repack" not in public
    else:
        assert info.source == f"gguf {inspect_gguf(path).label()}"
        assert (public.get("repack", {}).get("tensors")) == (
            {repacked: 14} if isinstance(repacked, str) else repacked)
    got = logits(model, ids)
    error = float((got - expected).abs().max()) / scale
    assert error <= tolerance, (kind, error)

    assert_incremental_is_one_shot(model, ref, info, ids)


def assert_incremental_is_one_shot(model, ref, info, ids: list[int]) -> None:
    """On the native stack, the text read in four uneven pieces gives the one-shot logits, bit
    for bit."""
    runner = ModelRunner(model, ref.tokenizer, ref.name, info)
    assert runner.native is not None
    with torch.inference_mode():
        one_shot = runner.forward([SeqStep(runner.new_cache(len(ids) + 8), 0, ids)], logits="all")[0]
        cache_ = runner.new_cache(len(ids) + 8)
        steps = [runner.forward([SeqStep(cache_, i, ids[i:j])], logits="all")[0]
                 for i, j in ((0, 5), (5, 6), (6, 20), (20, len(ids)))]
    assert torch.equal(torch.cat(steps), one_shot)


def test_the_pack_cache_keeps_the_repacking_report(files, source, cache, caplog):
    """A second start maps the packed entry; /healthz still says what repacking cost (the start
    that packed it), and so does the log line of each start."""
    path = files["Q6_K"]
    loaded = load_model(str(path))  # each start packs (or maps) a model of its own
    with caplog.at_level("INFO", logger="streamer.sessions.weights"):
        a = apply_weights(copy.deepcopy(loaded.model), "auto", "cpu", loaded.gguf)
        b = apply_weights(copy.deepcopy(loaded.model), "auto", "cpu", loaded.gguf)
    assert list((cache / "packed").glob("tiny.Q6_K-int8-*.bin"))
    assert b.public() == a.public() and b.repack["tensors"] == {"Q6_K->Q8_0": 14}
    said = [r.getMessage() for r in caplog.records if "repacked at load" in r.getMessage()]
    assert len(said) == 2, caplog.text
    assert all("14 Q6_K->Q8_0" in line and f"{a.repack['rel_rms_error']:.2g}" in line for line in said), said


def test_the_repacking_report_says_what_the_fused_matrices_hold(files, cache, caplog):
    """In a Q4_K_M layer whose attn_v is Q6_K the fused q|k|v matrix is Q8_0: its Q4_K q and k
    are Q8_0 of their weights, and the report (/healthz and the log line) says so, with their
    requantization in its error; int8 on the same file makes every Q4_K tensor Q8_0."""
    loaded = load_model(str(files["Q4_K_M"]))
    model = copy.deepcopy(loaded.model)
    with caplog.at_level("INFO", logger="streamer.sessions"):
        info = apply_weights(model, "int4", "cpu", loaded.gguf)
    assert [layer.self_attn.native_qkv.bits for layer in model.model.layers] == [4, 8]
    assert info.repack["tensors"] == {"Q4_K->Q4_1": 10, "Q4_K->Q8_0": 2, "Q6_K->Q8_0": 2}
    said = [r.getMessage() for r in caplog.records if "repacked at load" in r.getMessage()]
    assert said and all("10 Q4_K->Q4_1" in line and "2 Q4_K->Q8_0" in line for line in said), said
    blocks, raw = gguf_blocks(loaded.model, files["Q4_K_M"])
    assert raw.tensors == {"Q4_K->Q4_1": 12, "Q6_K->Q8_0": 2}  # the blocks as read, before fusing
    assert 0 < info.repack["rel_rms_error"] < 0.01  # Q6_K's and now Q4_K's requantization to Q8_0
    eight = apply_weights(copy.deepcopy(loaded.model), "int8", "cpu", loaded.gguf)
    assert eight.repack["tensors"] == {"Q4_K->Q8_0": 12, "Q6_K->Q8_0": 2}


def test_int4_on_a_q8_0_file_and_int8_on_a_q4_file(files, cache):
    """An explicit --weights other than the file's width: int4 on Q8_0 keeps the 8-bit blocks
    (a matrix with an 8-bit part is Q8_0), int8 on Q4_1 quantizes the float weights."""
    q8 = load_model(str(files["Q8_0"]))
    info = apply_weights(q8.model, "int4", "cpu", q8.gguf)
    assert info.format == "int4" and info.source == "gguf Q8_0"
    assert q8.model.model.layers[0].self_attn.native_qkv.bits == 8
    q4 = load_model(str(files["Q4_1"]))
    info = apply_weights(q4.model, "int8", "cpu", q4.gguf)
    assert info.format == "int8" and info.source == "quantized at load"


# ---- Qwen2 and Qwen3: no q/k row permutation, Qwen2's q/k/v biases, Qwen3's q/k norms ------------

# type -> (the format auto runs, how its blocks reach the kernels)
QWEN_TYPES = {"F32": ("int8", None), "Q8_0": ("int8", None), "Q4_K": ("int4", "Q4_K->Q4_1")}
# (architecture, type) -> (max |logit error| / std of the native stack vs the dequantized
# reference, of the reference vs the float model). Measured here (avx512-vnni): Qwen2 as the
# Llama above (native 0.04 Q8_0, 0.05 Q4_K, 0.06 F32 at int8; file 0.04 Q8_0, 0.64 Q4_K); Qwen3's
# q/k norms rescale each head's q and k to unit RMS, so rounding weighs more (native 0.056 Q8_0,
# 0.076 Q4_K, 0.115 F32 at int8; file 0.095 Q8_0, 1.33 Q4_K).
QWEN_TOLERANCE = {("qwen2", "F32"): (0.12, 0.0), ("qwen2", "Q8_0"): (0.05, 0.1), ("qwen2", "Q4_K"): (0.15, 1.0),
                  ("qwen3", "F32"): (0.15, 0.0), ("qwen3", "Q8_0"): (0.08, 0.15), ("qwen3", "Q4_K"): (0.15, 1.6)}


def tiny_qwen(arch: str, tokenizer, seed: int = 5) -> torch.nn.Module:
    """A tiny seeded Qwen2 (q/k/v biases, random rather than the init's zeros) or Qwen3 (q/k
    RMS norms, random rather than ones; head_dim 64, not Qwen3Config's default 128)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in ("q_proj", "k_proj", "v_proj"):
                    getattr(layer.self_attn, proj).bias.normal_(0, 0.3)
        return model
    model = Qwen3ForCausalLM(Qwen3Config(head_dim=64, **common)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def qwen(tokenizer, tmp_path_factory):
    """(the float model, {type: its GGUF}) per architecture, each written on first use."""
    root = tmp_path_factory.mktemp("gguf-qwen")

    class Files(dict):
        def __init__(self, arch: str) -> None:
            super().__init__()
            self.arch, self.source = arch, tiny_qwen(arch, tokenizer)

        def __missing__(self, kind: str) -> Path:
            path = root / f"tiny-{self.arch}.{kind}.gguf"
            export_gguf(self.source, path, kind, embedded_gguf_path(), name=f"tiny {self.arch}")
            return self.setdefault(kind, path)

    return {arch: Files(arch) for arch in ("qwen2", "qwen3")}


@pytest.mark.parametrize("kind", list(QWEN_TYPES))
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen2_and_qwen3_ggufs_run_on_the_native_stack_within_their_tolerance(arch, kind, qwen, cache, tokenizer):
    fmt, repacked = QWEN_TYPES[kind]
    tolerance, file_bound = QWEN_TOLERANCE[arch, kind]
    files = qwen[arch]
    source, path = files.source, files[kind]
    assert inspect_gguf(path).architecture == arch
    ref = load_model(str(path))
    assert type(ref.model) is type(source)
    assert ref.model.model.layers[0].self_attn.head_dim == 64  # the file's key_length (transformers reads none)
    ids = ref.tokenizer(TEXT)["input_ids"]
    assert ids == tokenizer(TEXT)["input_ids"] and ref.tokenizer.chat_template == tokenizer.chat_template
    # what only Qwen has reaches the reference as written (norms and biases are F32 in every type)
    for got, want in zip(ref.model.model.layers, source.model.layers, strict=True):
        for part in (("q_proj", "k_proj", "v_proj") if arch == "qwen2" else ("q_norm", "k_norm")):
            tensor = "bias" if arch == "qwen2" else "weight"
            assert torch.equal(getattr(got.self_attn.get_submodule(part), tensor),
                               getattr(want.self_attn.get_submodule(part), tensor)), part
    expected = logits(ref.model, ids)
    scale = float(expected.std())
    file_error = float((expected - logits(source, ids)).abs().max()) / scale
    assert file_error <= file_bound, (arch, kind, file_error)

    model = copy.deepcopy(ref.model)
    info = apply_weights(model, "auto", "cpu", ref.gguf)
    public = info.public()
    assert (info.format, info.kernels.startswith("native")) == (fmt, True), public
    if kind == "F32":
        assert info.source == "quantized at load" and "repack" not in public
    else:
        assert info.source == f"gguf {kind}", public  # Qwen2's F32 biases are not linear weights' types
        assert public.get("repack", {}).get("tensors") == ({repacked: 14} if repacked else None)
    got = logits(model, ids)
    error = float((got - expected).abs().max()) / scale
    assert error <= tolerance, (arch, kind, error)
    assert_incremental_is_one_shot(model, ref, info, ids)


def test_serve_runs_a_gguf_and_healthz_states_its_repacking(qwen, cache):
    """`streamer serve --model tiny-qwen2.Q6_K.gguf`, a real process: /healthz names the file's
    type and the repacking (Q6_K -> Q8_0, its error), a session reads text, a question is answered."""
    import asyncio
    import json
    import urllib.request

    from procutil import ServerProcess
    from wsutil import raw

    path = qwen["qwen2"]["Q6_K"]
    with ServerProcess("--store", "memory:", "--model", str(path), ready_timeout=300) as server:
        port = int(server.url.rsplit(":", 1)[1].strip("/"))
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30))

        async def ask() -> tuple[dict, list[dict]]:
            peer = await raw(server.url)
            try:
                sid = await peer.create()
                ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": TEXT})
                assert ack["type"] == "input.ack", ack
                await peer.send({"type": "query.create", "session_id": sid, "question": "Who keeps the light?",
                                 "max_tokens": 8, "event_id": "q1"})
                return ack, await peer.until("query.done", timeout=120)
            finally:
                await peer.ws.close()

        ack, events = asyncio.run(ask())
    assert health["status"] == "ok" and health["model"] == path.name, health
    weights = health["weights"]
    assert (weights["format"], weights["source"]) == ("int8", "gguf Q6_K"), weights
    assert weights["kernels"].startswith("native"), weights
    assert weights["repack"]["tensors"] == {"Q6_K->Q8_0": 14}, weights
    assert 0 < weights["repack"]["rel_rms_error"] < 0.01 and weights["repack"]["seconds"] > 0, weights
    assert ack["tokens"] > 0 and ack["total_tokens"] >= ack["tokens"], ack
    done = events[-1]
    deltas = [e for e in events if e["type"] == "query.delta" and e.get("reply_to") == "q1"]
    assert done.get("reply_to") == "q1" and done["finish_reason"] in ("length", "stop"), done
    assert done["tokens"] > 0 and done["text"] and "".join(e["delta"] for e in deltas) == done["text"], events
    assert done["context_tokens"] >= ack["total_tokens"], done


# ---- what streamer does not run: one line --------------------------------------------------------

def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, raw) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refusals(tmp: Path) -> dict[str, tuple[Path, str]]:
    f32 = np.zeros((256, 256), dtype=np.float32)
    q2k = np.zeros((256, 84), dtype=np.uint8)  # Q2_K: 84 bytes a 256
    (tmp / "text.gguf").write_text("not a gguf\n")
    return {
        "architecture": (_write(tmp / "gemma.gguf", "gemma2", {"blk.0.attn_q.weight": (f32, None)}),
                         "gemma.gguf: architecture 'gemma2' is not one streamer runs from a GGUF"),
        "type": (_write(tmp / "q2k.gguf", "llama", {"blk.0.attn_q.weight": (q2k, gguf.GGMLQuantizationType.Q2_K)}),
                 "q2k.gguf: tensor blk.0.attn_q.weight is Q2_K; streamer runs Q4_1, Q8_0, Q4_0, Q4_K"),
        "experts": (_write(tmp / "moe.gguf", "llama", {"blk.0.ffn_gate_exps.weight": (f32, None)}),
                    "moe.gguf: a mixture of experts (blk.0.ffn_gate_exps.weight)"),
        "not-gguf": (tmp / "text.gguf", "text.gguf: not a readable GGUF file"),
        "missing": (tmp / "nowhere.gguf", "nowhere.gguf: no such GGUF file"),
    }


@pytest.mark.parametrize("case", ["architecture", "type", "experts", "not-gguf", "missing"])
def test_a_file_streamer_does_not_run_is_refused_in_one_line(case, tmp_path):
    path, says = refusals(tmp_path)[case]
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(path))
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_streamer_serve_refuses_an_architecture_with_exit_2(tmp_path):
    path, says = refusals(tmp_path)["architecture"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "STREAMER_STORE": "memory:"}
    run = subprocess.run([sys.executable, "-m", "streamer", "serve", "--port", "0", "--model", str(path)],
                         capture_output=True, text=True, timeout=120, env=env, check=False)
    lines = run.stderr.splitlines()
    assert run.returncode == 2, run.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("streamer serve: error: ") and says in lines[0], run.stderr


def test_inspect_reads_the_types_without_the_weights(files):
    info = inspect_gguf(files["Q4_K"])
    assert (info.architecture, info.label(), info.quantized, info.four_bit) == ("llama", "Q4_K", True, True)
    assert inspect_gguf(files["F16"]).quantized is False
    mix = inspect_gguf(files["Q4_K_M"])
    assert (mix.label(), mix.four_bit) == ("Q4_K+Q6_K", True) and inspect_gguf(files["Q5_K_M"]).four_bit is False


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M"])
def test_the_k_mixes_are_laid_out_as_llama_quantize_lays_them(kind, files):
    """Q6_K for attn_v and ffn_down of the layers with more bits (of 2 layers: the last), the base
    K type for every other 2-D tensor (the tied embedding too), norms F32; the file type says the mix."""
    reader = gguf.GGUFReader(str(files[kind]))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    six = sorted(n for n, t in types.items() if t == "Q6_K")
    assert six == ["blk.1.attn_v.weight", "blk.1.ffn_down.weight"], types
    assert {t for n, t in types.items() if n not in six and not n.endswith("norm.weight")} == {kind[:4]}, types
    assert int(reader.fields["general.file_type"].contents()) == gguf.LlamaFileType[f"MOSTLY_{kind}"]
