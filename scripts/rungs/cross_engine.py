#!/usr/bin/env python3
"""Cross-compile primaplug's engine for 64-bit ARM Linux here, for the aarch64 rung (scripts/rungs/arm64.sh):
compiling it under emulation would take the better part of an hour.

    python scripts/rungs/cross_engine.py --cpu dotprod --out DIR   # llama_cpp_python-...-linux_aarch64.whl in DIR

The wheel is primaplug's own build (primaplug/engine/build.py: the pinned sdist, the patches, the same flags, cached
by its key) with Debian's cross compiler, for one class of ARM CPU (CPUS below): ggml's ARM kernels are chosen when
the engine is compiled, and a phone's own `make setup` compiles for the phone's CPU (-mcpu=native). Standard
library only."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from build_engine import load_build  # noqa: E402  (primaplug/engine/build.py by its path)

# an ARM CPU class: the -march it is compiled for, and the emulated CPU (qemu's -cpu) that has those features
CPUS = {
    # NEON alone: the oldest 64-bit phones (Cortex-A53, A72, A73); no fp16 arithmetic, so f16 dot products (the KV
    # cache's) sum in f32 as on x86 (benchmarks/mixed_cpus.py --cpu neon)
    "neon": ("armv8-a", "cortex-a72"),
    # NEON and dotprod: the phones of about 2019-2021 (Cortex-A76/A77/A78); repacked Q4_K is 8x4, dot products one row
    "dotprod": ("armv8.2-a+dotprod+fp16", "cortex-a76"),
    # and i8mm and SVE (128-bit vectors, as in phones: Cortex-X2, A710 and later); repacked Q4_K is 8x8, and mmla's
    # two-row dot products exist
    "i8mm": ("armv8.6-a+dotprod+fp16+i8mm+sve", "max,sve-default-vector-length=16"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", choices=sorted(CPUS), default="dotprod", help="the ARM CPU class to compile for")
    ap.add_argument("--out", type=Path, help="the folder to write the aarch64 wheel into")
    ap.add_argument("--list", action="store_true", help="print the CPU classes and stop")
    ap.add_argument("--print-qemu-cpu", action="store_true", help="print the emulated CPU of --cpu and stop")
    args = ap.parse_args()
    march, qemu_cpu = CPUS[args.cpu]
    if args.list or args.print_qemu_cpu:
        print(" ".join(CPUS) if args.list else qemu_cpu)
        return 0
    if args.out is None:
        ap.error("--out is required")
    for tool in ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-g++"):
        if shutil.which(tool) is None:
            print(f"cross_engine: needs {tool} (apt-get install {'g++' if tool.endswith('++') else 'gcc'}"
                  "-aarch64-linux-gnu)", file=sys.stderr)
            return 2
    os.environ["PRIMAPLUG_CMAKE_ARGS"] = " ".join([
        os.environ.get("PRIMAPLUG_CMAKE_ARGS", ""), f"-DCMAKE_TOOLCHAIN_FILE={HERE / 'aarch64-toolchain.cmake'}",
        "-DGGML_NATIVE=OFF", f"-DGGML_CPU_ARM_ARCH={march}"]).strip()
    build = load_build()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("llama_cpp_python-*.whl"):
        old.unlink()
    built = build.build_engine(sys.executable, "cpu", install_it=False, wheel_dir=args.out)
    assert built is not None
    dest = build.tidy_wheel(args.out / built.name, "linux_aarch64")  # the copy in --out, retagged
    print(f"cross_engine: {dest} (-march={march}; emulate with QEMU_CPU={qemu_cpu})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
