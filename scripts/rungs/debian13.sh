#!/usr/bin/env bash
# The newer-toolchain rung (issue 33; docs/platforms.md): primaplug as a new user gets it on Debian 13 (gcc 14,
# glibc 2.41, Python 3.13), in a debootstrap chroot kept in primaplug's cache folder (rungs/trixie-amd64):
#
#   sudo scripts/rungs/debian13.sh [OUT]      # OUT: default benchmarks/results/rungs
#
# A copy of this working tree there runs `make setup` (the engine from the pinned sdist, built once and cached in
# the chroot), the engine, window, streaming and ring tests, and `primaplug run --verify` on the head alone and on
# 2 local nodes. Writes OUT/debian13.json; exits 1 when anything failed, 2 when it could not run (and says why).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/rungs/chroot.sh
need_root_tools debootstrap git
out=$(realpath -m "${1:-benchmarks/results/rungs}")
root=$(cache_root)/rungs/trixie-amd64
make_chroot "$root" trixie amd64 gcc g++ cmake make patch python3-dev
trap 'unmount_chroot "$root"' EXIT
copy_tree "$root/work/primaplug"
mkdir -p "$out"
t0=$SECONDS
in_chroot "$root" bash -c '
    set -uo pipefail
    cd /work/primaplug && rm -rf rung && mkdir rung
    make setup > rung/setup.log 2>&1 || { tail -30 rung/setup.log; exit 2; }
    py=.venv/bin/python
    $py -m pytest -p no:cacheprovider -q tests/test_build_engine.py tests/test_windows_match_llama.py \
        tests/test_exact_windows.py tests/test_batch_rounding.py tests/test_prefetch_ring.py tests/test_ring.py \
        --junitxml rung/tests.xml | tail -5
    $py -m primaplug run --layers 9,9 --temp 0 -n 32 --verify > rung/run_head.txt 2>&1; tail -2 rung/run_head.txt
    $py -m primaplug run --local-nodes 2 --scheduler even --temp 0 -n 32 --verify > rung/run_nodes.txt 2>&1
    tail -2 rung/run_nodes.txt
    $py scripts/rungs/summary.py --rung debian13 --junit rung/tests.xml --command "run --layers 9,9 --verify=rung/run_head.txt" \
        --command "run --local-nodes 2 --verify=rung/run_nodes.txt" --fact "compiler=$(gcc --version | head -1)" \
        --fact "engine_setup=$(grep -m1 -o "built in .*" rung/setup.log || echo cached)" > rung/debian13.json
'
cp "$root/work/primaplug/rung/debian13.json" "$out/debian13.json"
echo "debian13: $((SECONDS - t0)) s; $out/debian13.json"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); sys.exit(0 if r["ok"] and all("gave the same" in " ".join(v) for v in r["commands"].values()) and len(r["commands"]) == 2 else 1)' "$out/debian13.json"
