"""`primaplug serve` as users start it: a config file in llama-cpp-python's shape with the ring's own settings, an
API key and HTTPS, local nodes; the official openai client against it; Ctrl-C stops it and its nodes."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.server_helpers import openai_client

pytestmark = pytest.mark.multiproc
pytest.importorskip("fastapi", reason="needs primaplug[server]")
pytest.importorskip("openai", reason="needs the openai client (the test extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return key, cert


class _Lines:
    """A process's stderr, line by line, read by a thread: select() on the pipe would miss lines that a readline
    has already pulled into Python's buffer (two lines written at once)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        self.proc, self.queue, self.seen = proc, queue.Queue[str | None](), list[str]()
        threading.Thread(target=self._pump, args=(proc.stderr,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.queue.put(line)
        self.queue.put(None)

    def wait_for(self, pattern: str, seconds: float) -> tuple[str, list[str]]:
        """The first line from here containing `pattern`, and every line before it."""
        seen: list[str] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            seen.append(line)
            if pattern in line:
                return line, seen
        self.proc.kill()
        raise AssertionError(f"serve never said {pattern!r}:\n{''.join(seen)}")


def test_serve_from_a_config_file_over_https_with_a_key(gemma_path: Path, tmp_path: Path) -> None:
    import httpx

    key, cert = _self_signed(tmp_path)
    port = _free_port()
    config = {"port": 9, "api_key": "sekrit", "ssl_keyfile": str(key), "ssl_certfile": str(cert),
              "local-nodes": 2, "scheduler": "even", "node_threads": 1, "parallel": 2,
              "models": [{"model": str(gemma_path), "model_alias": "gemma", "n_ctx": 512, "n_batch": 64}]}
    (tmp_path / "serve.json").write_text(json.dumps(config))
    # the command line wins over the file: the port
    proc = subprocess.Popen([sys.executable, "-m", "primaplug", "serve", "--config_file", str(tmp_path / "serve.json"),
                             "--port", str(port), "-t", "1"], stderr=subprocess.PIPE, text=True)
    try:
        lines = _Lines(proc)
        line, seen = lines.wait_for("serving gemma at", 180)
        assert f"https://127.0.0.1:{port}/v1 (2 requests at once)" in line, line
        # the bundled Gemma is a base model's file, without a chat template: serve says what a chat goes through
        assert any("chat completions use the gemma format (the file has no chat template; its tokenizer has "
                   "<start_of_turn>" in s and "/v1/completions" in s for s in seen), "".join(seen)
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=60) as http:
            base = f"https://127.0.0.1:{port}"
            assert http.get(f"{base}/health").json()["n_parallel"] == 2
            assert http.get(f"{base}/v1/models").status_code == 401
            client = openai_client(base, api_key="sekrit", http_client=http)
            assert [m.id for m in client.models.list()] == ["gemma"]
            r = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0.0)
            assert r.choices[0].message.content and r.usage.completion_tokens > 0
        proc.send_signal(signal.SIGINT)
        lines.wait_for("stopped the 2 local nodes", 60)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
