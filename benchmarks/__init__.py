"""Rerunnable benchmarks (see the README's Benchmarks section)."""

import importlib.util


def need_charts() -> None:
    """Stop before a long run, not after it, when the charts' library is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("the benchmark's charts need matplotlib: .venv/bin/pip install -e '.[bench]' "
                         "(make bench and make bench-testbed do it)")
