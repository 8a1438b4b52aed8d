#!/usr/bin/env python3
"""One rung's result as JSON, for benchmarks/results/rungs/ (scripts/rungs/*.sh): the platform, the tests that
ran (from pytest's JUnit XML files) and each checked command's last lines. Standard library only: it runs inside
the rungs' chroots.

    python summary.py --rung NAME --junit a.xml [--junit b.xml] [--command "TITLE=FILE"] [--fact KEY=VALUE] > out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def tests_of(path: Path) -> dict[str, object]:
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    out: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in cases:
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"].append(f"{name}: {case.find('skipped').get('message', '')}")  # type: ignore[union-attr]
        else:
            out["passed"].append(name)
    return {"file": path.name, "counts": {k: len(v) for k, v in out.items()}, **out}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rung", required=True)
    ap.add_argument("--junit", type=Path, action="append", default=[])
    ap.add_argument("--command", action="append", default=[], help="TITLE=FILE: a command's output, kept in part")
    ap.add_argument("--fact", action="append", default=[], help="KEY=VALUE")
    args = ap.parse_args()
    libc = " ".join(platform.libc_ver())
    result: dict[str, object] = {
        "rung": args.rung,
        "date": time.strftime("%Y-%m-%d"),
        "platform": {"machine": platform.machine(), "python": platform.python_version(), "libc": libc,
                     "os": _os_release()},
        **dict(f.split("=", 1) for f in args.fact),
        "tests": [tests_of(p) for p in args.junit if p.exists()],
        "commands": {title: Path(file).read_text(errors="replace").splitlines()[-6:]
                     for title, file in (c.split("=", 1) for c in args.command) if Path(file).exists()},
    }
    failed = sum(t["counts"]["failed"] for t in result["tests"])  # type: ignore[index,misc]
    result["ok"] = failed == 0 and all(t["counts"]["passed"] for t in result["tests"])  # type: ignore[index]
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


def _os_release() -> str:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        return platform.platform()
    return next((ln.split("=", 1)[1].strip('"') for ln in text.splitlines() if ln.startswith("PRETTY_NAME=")), "")


if __name__ == "__main__":
    sys.exit(main())
