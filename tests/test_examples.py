"""Every script in examples/ runs as a user would run it, on the bundled Gemma, and says what it shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# what each prints when it worked
EXPECTED = {
    "split_model.py": ["largest logit difference: 0.0", "next token:"],
    "llama_over_nodes.py": ["completion:", "chat:", "stream:"],
    "openai_client.py": ["chat:", "stream:", "tool call: get_weather {'city': ", "structured: country="],
    "cluster_with_keys.py": ["node0 keeps", "node1 keeps"],
    "speculative.py": ["drafted tokens kept", "the same tokens: True"],
}


def test_every_example_is_tested() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(EXPECTED)


@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_example_runs(script: str, gemma_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / script), str(gemma_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    for text in EXPECTED[script]:
        assert text in out.stdout, (text, out.stdout[-2000:])
