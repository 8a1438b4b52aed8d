"""`primaplug health`, the Docker image's health check, against a real node process: exit 0 with what the node
says, 1 and why where no node answers (the slow rung runs it in containers, tests/test_docker.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from primaplug.cli import main

pytestmark = pytest.mark.multiproc


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_health_is_0_for_a_node_that_answers_and_1_for_none(gemma_path: Path, tmp_path: Path, capsys) -> None:
    from primaplug.head.launch import LocalNodes

    with LocalNodes(gemma_path, 1, log_dir=tmp_path / "logs") as local:
        assert main(["health", local.addresses[0]]) == 0
        out = capsys.readouterr().out
        assert f"node {local.names[0]} at {local.addresses[0]} answers: primaplug" in out and gemma_path.name in out

    port = _unused_port()
    assert main(["health", f"127.0.0.1:{port}", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("primaplug: unhealthy: ") and str(port) in err, err
