#!/usr/bin/env bash
# The sanitizer rung (issue 33; docs/platforms.md): the engine built with AddressSanitizer and
# UndefinedBehaviorSanitizer (ggml's and llama.cpp's own switches), under the tests that load windows, stream them,
# batch sequences, rewind drafts and fuzz a node, node processes included. No root needed.
#
#   scripts/rungs/sanitize.sh [OUT]          # OUT/sanitize.json (default benchmarks/results/rungs)
#
# Its own Python environment in primaplug's cache folder (rungs/sanitize-venv), the engine built into it once per
# key (about 5 minutes on 2 cores) and cached like any other. Every process's reports go to files (log_path), so the
# nodes' count too: the rung fails on any report, or any failed test. Exits 2 when it could not run.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/rungs/chroot.sh
TESTS=(tests/test_windows_match_llama.py tests/test_exact_windows.py tests/test_prefetch_ring.py
       tests/test_batch_rounding.py tests/test_speculative.py tests/test_fuzz_node.py)
out=$(realpath -m "${1:-benchmarks/results/rungs}")
python=${PYTHON:-python3}
command -v gcc >/dev/null || rung_fail "needs gcc (apt-get install build-essential)"
asan=$(gcc -print-file-name=libasan.so)
ubsan=$(gcc -print-file-name=libubsan.so)
[ -f "$asan" ] && [ -f "$ubsan" ] || rung_fail "gcc has no sanitizer runtimes here (apt-get install libasan8 libubsan1)"
venv=$(cache_root)/rungs/sanitize-venv
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q -e '.[test]' 2>&1 | grep -v "^$" || true
flags="-DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON -DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON"
PRIMAPLUG_CMAKE_ARGS="$flags" "$venv/bin/python" scripts/build_engine.py --python "$venv/bin/python" \
    | grep -v "^engine: applied" || rung_fail "the sanitized engine did not build"
mkdir -p "$out"
reports=$(mktemp -d)
t0=$SECONDS
# the sanitizers' runtimes first in every process (python itself is not built with them); leaks are not checked:
# CPython keeps its own allocations to the end. A 16 MiB quarantine of freed memory (ASan's default, 256 MiB, grew a
# fuzzed node's RSS by 57 MiB, past test_fuzz_node's bound of 48; with 16 it stays within)
set +e
LD_PRELOAD="$asan $ubsan" \
    ASAN_OPTIONS="detect_leaks=0:log_path=$reports/asan:halt_on_error=1:quarantine_size_mb=16" \
    UBSAN_OPTIONS="print_stacktrace=1:log_path=$reports/ubsan:halt_on_error=0" \
    PRIMAPLUG_CMAKE_ARGS="$flags" \
    "$venv/bin/python" -m pytest -p no:cacheprovider -q "${TESTS[@]}" --junitxml "$reports/tests.xml" | tail -5
set -e
n_reports=$(find "$reports" -name 'asan.*' -o -name 'ubsan.*' | wc -l)
for f in "$reports"/asan.* "$reports"/ubsan.*; do
    [ -f "$f" ] && { echo "== $f"; head -40 "$f"; }
done
"$venv/bin/python" scripts/rungs/summary.py --rung sanitize --junit "$reports/tests.xml" \
    --fact "sanitizers=address,undefined (ggml and llama.cpp: $flags)" --fact "reports=$n_reports" \
    --fact "compiler=$(gcc --version | head -1)" --fact "minutes=$(((SECONDS - t0) / 60))" > "$out/sanitize.json"
echo "sanitize: $n_reports reports; $out/sanitize.json"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if r["ok"] and r["reports"] == "0" else 1)' \
    "$out/sanitize.json"
