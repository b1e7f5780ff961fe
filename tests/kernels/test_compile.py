"""The kernels compile for CUDA GPUs (Ampere and Hopper) through Triton's own toolchain, with
no GPU: this checks the compiled path that the interpreter does not (tensor-core dots in
bf16/fp16, IEEE fp32 dots, pointers loaded from the range table, 16-byte vector or async
loads of K/V tiles, shared memory within an SM).

Triton decides interpretation when it is imported, and this folder's tests import it
interpreted (conftest), so the compiler runs in a fresh interpreter without TRITON_INTERPRET.
"""

import json
import os
import subprocess
import sys

SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from streamer.kernels import triton_attention as ta

strides = ["stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_ps", "stride_pt", "stride_ph",
           "stride_ls", "stride_lt"]
results = []
for arch, dtype, block_m in ((90, "bf16", 16), (90, "fp32", 16), (80, "fp16", 64)):
    if True:
        signature = {"Q": "*" + dtype, "OUT": "*" + dtype, "OP": "*fp32", "LP": "*fp32", "SEG": "*i64",
                     "ITEM": "*i64", "QTOK": "*i32", "TILE": "*i32", "layer": "i32", "scale_log2": "fp32"}
        signature.update({name: "i64" for name in strides})
        signature.update({name: "constexpr" for name in ("G", "D", "BLOCK_D", "BLOCK_M", "BLOCK_N", "IEEE", "UPCAST",
                                                         "ALIGNED")})
        constexprs = {"G": 4, "D": 128, "BLOCK_D": 128, "BLOCK_M": block_m, "BLOCK_N": 64,
                      "IEEE": dtype == "fp32", "UPCAST": False, "ALIGNED": True}
        k = triton.compile(ASTSource(fn=ta._attention_kernel, signature=signature, constexprs=constexprs),
                           target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 2})
        results.append({"kernel": "attention", "arch": arch, "dtype": dtype, "block_m": block_m,
                        "cubin": len(k.asm["cubin"]), "shared": k.metadata.shared, "mma": "mma" in k.asm["ptx"],
                        "vector_loads": "cp.async.cg.shared.global" in k.asm["ptx"] or "ld.global.v4" in k.asm["ptx"]})
signature = {"OUT": "*bf16", "OP": "*fp32", "LP": "*fp32", "MTOK": "*i32", "NSLOT": "*i32", "LSE": "*fp32"}
signature.update({name: "i64" for name in ("stride_ot", "stride_oh", "stride_ps", "stride_pt", "stride_ph",
                                           "stride_ls", "stride_lt")})
signature.update({name: "constexpr" for name in ("D", "BLOCK_D", "BLOCK_S", "WRITE_LSE")})
k = triton.compile(ASTSource(fn=ta._merge_kernel, signature=signature,
                             constexprs={"D": 128, "BLOCK_D": 128, "BLOCK_S": 8, "WRITE_LSE": True}),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
results.append({"kernel": "merge", "arch": 90, "cubin": len(k.asm["cubin"]), "shared": k.metadata.shared})
print(json.dumps(results))
'''

SMEM = {80: 163 * 1024, 90: 227 * 1024}  # shared memory one block may use


def test_kernels_compile_for_ampere_and_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 4
    for r in results:
        assert r["cubin"] > 0 and r["shared"] <= SMEM[r["arch"]], r
        if r["kernel"] == "attention":
            assert r["vector_loads"], r  # K/V tiles move in 16-byte (async) copies, not element by element
            if r["dtype"] != "fp32":
                assert r["mma"], r  # tensor cores, not scalar FMAs
