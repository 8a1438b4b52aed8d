#!/usr/bin/env bash
# The GPU path in one run, on a machine with an NVIDIA GPU that has no network and gets only a copy of this working
# tree (issue 33; docs/gpu.md, "Checking a GPU machine"):
#
#   bash scripts/gpu_check.sh bundle        # here: gpu-bundle/ (git-ignored, about 45 MB): the trimmed engine
#                                           # source and wheels of the run's dependencies for the machine's Python
#   bash scripts/gpu_check.sh run [OUT]     # there (carry gpu-bundle): build the CUDA engine offline with the
#                                           # system compiler, test GPU layers, --verify with and without nodes,
#                                           # plan, tokens/s on the CPU and on the GPU; results and logs in OUT
#
# Settings: GPU_PY (bundle: the machine's Python version, default 3.12), GPU (run: cuda, or cpu to check the script
# on a machine without a GPU), GPU_ARCH (CMAKE_CUDA_ARCHITECTURES, default native), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}

bundle() {
    local py=${GPU_PY:-3.12}
    rm -rf gpu-bundle && mkdir -p gpu-bundle/wheels
    .venv/bin/python scripts/trim_sdist.py --out gpu-bundle/llama-cpp-python-src.tar.gz
    # primaplug's dependencies without the 240 MB Gemma package, the engine's build tools, pytest
    .venv/bin/python - > gpu-bundle/requirements.txt <<'PY'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("gemma3")))
print("scikit-build-core>=0.9.2\ncmake>=3.21\nninja\npytest>=8")
PY
    .venv/bin/python -m pip download --quiet --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform linux_x86_64 -d gpu-bundle/wheels -r gpu-bundle/requirements.txt
    du -sh gpu-bundle
}

run() {
    local out=${1:-${OUT:-gpu-results}} gpu=${GPU:-cuda} python=${PYTHON:-python3}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    exec > >(tee "$out/gpu_check.log") 2>&1
    [ -d gpu-bundle/wheels ] || { echo "gpu_check: no gpu-bundle/ here: run 'scripts/gpu_check.sh bundle' first"; exit 2; }
    local t0=$SECONDS
    step() { echo "== $* ($((SECONDS - t0)) s)"; }
    step "a venv from the bundle's wheels (no index)"
    "$python" -m venv --system-site-packages .venv-gpu
    .venv-gpu/bin/python -m pip install --quiet --no-index --find-links gpu-bundle/wheels -r gpu-bundle/requirements.txt
    export PATH="$PWD/.venv-gpu/bin:$PATH" PYTHONPATH="$PWD" PRIMAPLUG_CACHE="$out/cache"
    local py=.venv-gpu/bin/python
    step "the engine ($gpu) from the trimmed source, the system compiler, no download"
    # the system compiler: an image's CC/CXX wrapper built engines that segfaulted at their first load (docs/install.md)
    local flags="-DCMAKE_C_COMPILER=$(command -v gcc) -DCMAKE_CXX_COMPILER=$(command -v g++)"
    # nvcc's host compiler too: CMake takes it from CUDAHOSTCXX, not from CMAKE_CXX_COMPILER, and an image that
    # sets it to its wrapper gets CUDA objects that segfault at the first load (seen on the H100, 2026-11-28)
    echo "gpu_check: CC=${CC:-} CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-} (the build uses $(command -v g++))"
    unset CUDAHOSTCXX
    [ "$gpu" = cuda ] && flags="$flags -DCMAKE_CUDA_HOST_COMPILER=$(command -v g++) -DCMAKE_CUDA_ARCHITECTURES=${GPU_ARCH:-native}"
    PRIMAPLUG_ENGINE_SOURCE=gpu-bundle/llama-cpp-python-src.tar.gz PRIMAPLUG_CMAKE_ARGS="$flags" \
        "$py" -m primaplug engine build --gpu "$gpu"
    step "an 18-layer synthetic model (the bundled Gemma is too large to send)"
    local model="$out/model.gguf"
    "$py" -m primaplug synth --size 200M --layers 18 "$model"
    step "tests/test_gpu_layers.py"
    PRIMAPLUG_TEST_MODEL="$model" "$py" -m pytest -q -p no:cacheprovider tests/test_gpu_layers.py \
        --junitxml "$out/test_gpu_layers.xml" || echo "gpu_check: tests/test_gpu_layers.py failed"
    local ngl=18  # every layer of the model's 18 (the output layer stays on the CPU, as plain llama.cpp leaves it)
    [ "$gpu" = cpu ] && ngl=0
    step "primaplug run --verify: the head alone (-ngl $ngl), then 2 local nodes (-ngl $((ngl / 2)) each)"
    "$py" -m primaplug run -m "$model" -ngl "$ngl" --verify -n 32 --temp 0 -p "Once upon a time" \
        | tee "$out/run_head.txt" || echo "gpu_check: run on the head failed"
    "$py" -m primaplug run -m "$model" --local-nodes 2 --layers 9,9 -ngl "$((ngl / 2))" --verify -n 32 --temp 0 \
        -p "Once upon a time" | tee "$out/run_nodes.txt" || echo "gpu_check: run with nodes failed"
    step "primaplug plan with the profiled device"
    "$py" -m primaplug plan -m "$model" --local-nodes 2 | tee "$out/plan.txt" || echo "gpu_check: plan failed"
    step "tokens/s: plain llama-cpp-python and primaplug, every layer on the CPU, then on the GPU"
    "$py" - "$model" "$ngl" "$out/speed.json" <<'PY'
import json, sys, time
import primaplug
from primaplug.engine.reference import plain_llama
model, ngl, dest = sys.argv[1], int(sys.argv[2]), sys.argv[3]
prompt, n = list(range(3, 35)), 64
def tps(llm):
    llm.reset(); llm.eval(prompt); t = time.perf_counter()
    for _ in range(n):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    return round(n / (time.perf_counter() - t), 1)
out = {}
for layers in sorted({0, ngl}):
    with plain_llama(model, n_gpu_layers=layers, n_ctx=256, logits_all=True, verbose=False) as llm:
        out[f"plain llama-cpp-python, {layers} GPU layers"] = tps(llm)
    llm = primaplug.Llama(model, node_gpu_layers=layers, n_ctx=256, logits_all=True, verbose=False)
    try:
        out[f"primaplug, head alone, {layers} GPU layers"] = tps(llm)
    finally:
        llm.close()
print(json.dumps(out, indent=2)); json.dump(out, open(dest, "w"), indent=2)
PY
    step "done: $out"
}

case $mode in
    bundle) bundle ;;
    run) shift; run "$@" ;;
    *) echo "usage: scripts/gpu_check.sh bundle | run [OUT]"; exit 2 ;;
esac
