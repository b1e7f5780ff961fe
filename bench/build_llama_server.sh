#!/usr/bin/env bash
# Build llama.cpp's `llama-server` for the peer half of bench/capacity.py (a bench dependency
# only: nothing in streamer or its tests needs it).
#
# The source is the llama.cpp that the `llama-cpp-python` source package ships (the same one
# bench/peers.py and bench/decode.py run through `llama-cpp-python`), fetched with
# `pip download` from the configured package index. Only the server target is built, for this
# CPU (GGML_NATIVE; on an AMX CPU its AVX-512 paths without AMX, see below), without libcurl or
# OpenSSL (it serves plain HTTP on localhost).
# About 10-20 minutes on 2 cores.
#
#   bash bench/build_llama_server.sh [DEST]      (default DEST: ~/.cache/streamer-bench)
#
# Prints the binary's path last; bench/capacity.py finds it there (or pass --llama-server PATH,
# or put `llama-server` on PATH). LLAMA_CPP_SDIST=/path/to/llama_cpp_python-X.tar.gz skips the
# download.
set -euo pipefail

dest="${1:-${HOME}/.cache/streamer-bench}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"

sdist="${LLAMA_CPP_SDIST:-}"
if [ -z "$sdist" ]; then
    echo "fetching the llama-cpp-python source package into $dest/src ..." >&2
    mkdir -p "$dest/src"
    python3 -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d "$dest/src"
    sdist="$(ls -t "$dest"/src/llama_cpp_python-*.tar.gz | head -1)"
fi
[ -f "$sdist" ] || { echo "no such source package: $sdist" >&2; exit 2; }

name="$(basename "$sdist" .tar.gz)"
if [ ! -d "$dest/src/$name" ]; then
    echo "unpacking $sdist ..." >&2
    mkdir -p "$dest/src"
    tar -xzf "$sdist" -C "$dest/src"
fi
source_dir="$dest/src/$name/vendor/llama.cpp"
[ -f "$source_dir/CMakeLists.txt" ] || { echo "no llama.cpp source in $sdist (expected vendor/llama.cpp)" >&2; exit 2; }

# On a CPU with AMX (Sapphire Rapids and later) llama.cpp's native build (llama-cpp-python 0.3.36's
# source) segfaulted at its first evaluation; its AVX-512 paths without AMX run. $LLAMA_CMAKE_ARGS
# replaces this choice.
if [ -n "${LLAMA_CMAKE_ARGS:-}" ]; then
    read -r -a cpu_args <<< "$LLAMA_CMAKE_ARGS"
elif grep -q -w amx_int8 /proc/cpuinfo 2>/dev/null; then
    echo "this CPU has AMX: building llama.cpp's AVX-512 paths without AMX (its native build crashed here)" >&2
    cpu_args=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
              -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
              -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else
    cpu_args=(-DGGML_NATIVE=ON)
fi

build="$dest/build-$name"
echo "configuring in $build ..." >&2
cmake -S "$source_dir" -B "$build" -DCMAKE_BUILD_TYPE=Release "${cpu_args[@]}" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF >&2
echo "building llama-server (this takes a while; progress below) ..." >&2
cmake --build "$build" --target llama-server -j "$(nproc)" >&2

binary="$build/bin/llama-server"
[ -x "$binary" ] || { echo "the build finished but $binary is missing" >&2; exit 1; }
ln -sf "$binary" "$dest/llama-server"
"$binary" --version >&2 || true
echo "$dest/llama-server"
