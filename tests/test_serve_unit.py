"""`primaplug serve` without a model: its defaults against llama-cpp-python's server, its flags and config file, the
off-loopback rule, and the text of /metrics."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.server_helpers import parse_prometheus, value

pytestmark = pytest.mark.unit


def serve_args(*argv: str) -> argparse.Namespace:
    """serve's settings for a command line, as main() sees them (nothing loaded)."""
    from primaplug.cli import build_parser
    from primaplug.cli.serve import settings

    return settings(build_parser().parse_args(["serve", *argv]))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "primaplug", *args], capture_output=True, text=True, timeout=120)


def test_defaults_are_llama_cpp_pythons_where_it_has_them() -> None:
    pytest.importorskip("llama_cpp.server.settings", reason="needs primaplug[server]")
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from primaplug.cli.serve import MODEL_KEYS

    theirs_server, theirs_model = ServerSettings.model_fields, ModelSettings.model_fields
    args = serve_args()
    assert args.port == theirs_server["port"].default == 8000
    assert args.ctx_size == theirs_model["n_ctx"].default == 2048  # not `run`'s 4096
    assert args.batch_size == theirs_model["n_batch"].default and args.ubatch_size == theirs_model["n_ubatch"].default
    assert args.api_key is theirs_server["api_key"].default is None
    assert args.ssl_keyfile is None and args.ssl_certfile is None
    # the two differences, on purpose (primaplug/server/settings.py)
    assert args.host == "127.0.0.1" and theirs_server["host"].default == "localhost"
    assert args.interrupt_requests is False and theirs_server["interrupt_requests"].default is True
    assert args.parallel == 4 and args.alias is None
    # every config key serve takes under llama-cpp-python's name is one of llama-cpp-python's
    assert set(MODEL_KEYS) <= set(theirs_model)
    assert {"host", "port", "api_key", "ssl_keyfile", "ssl_certfile", "interrupt_requests"} <= set(theirs_server)


def test_run_keeps_its_own_context_default() -> None:
    from primaplug.cli import build_parser

    assert build_parser().parse_args(["run"]).ctx_size == 4096


@pytest.mark.parametrize(("argv", "want"), [
    ([], False), (["--interrupt_requests"], True), (["--interrupt_requests", "true"], True),
    (["--interrupt_requests", "false"], False), (["--interrupt_requests", "off"], False),
    (["--interrupt_requests", "--no-interrupt_requests"], False), (["--no-interrupt_requests"], False)])
def test_interrupt_requests_reads_as_llama_cpp_pythons_booleans(argv: list[str], want: bool) -> None:
    assert serve_args(*argv).interrupt_requests is want


def test_a_bad_boolean_says_what_it_takes() -> None:
    out = run_cli("serve", "--interrupt_requests", "maybe")
    assert out.returncode == 2 and "expected true or false" in out.stderr and "'maybe'" in out.stderr, out.stderr


def test_parallel_flag() -> None:
    assert serve_args("-np", "8").parallel == 8 and serve_args("--parallel", "2").parallel == 2


CONFIG = {
    "host": "0.0.0.0", "port": 8123, "api_key": "-sekrit", "interrupt_requests": True,
    "nodes": ["127.0.0.1:7000", "127.0.0.1:7010"], "layers": [6, 6, 6], "node-threads": 1, "parallel": 2,
    "insecure": False,
    "models": [{"model": "models/gemma.gguf", "model_alias": "gem", "n_ctx": 512, "chat_format": "gemma",
                "embedding": True}],
}


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_config_file_in_llama_cpp_pythons_shape(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"serve{suffix}"
    if suffix == ".yaml":
        yaml = pytest.importorskip("yaml")
        path.write_text(yaml.safe_dump(CONFIG))
    else:
        path.write_text(json.dumps(CONFIG))
    args = serve_args("--config_file", str(path))
    assert (args.host, args.port, args.api_key, args.interrupt_requests) == ("0.0.0.0", 8123, "-sekrit", True)
    assert args.nodes == ["127.0.0.1:7000", "127.0.0.1:7010"] and args.layers == [6, 6, 6]
    assert (args.node_threads, args.parallel, args.insecure) == (1, 2, False)
    assert (args.model, args.alias, args.ctx_size, args.chat_format, args.embedding) == (
        "models/gemma.gguf", "gem", 512, "gemma", True)
    assert args.batch_size == 512 and args.scheduler == "halda"  # not in the file: the defaults

    # the command line wins, even where it gives a flag's default
    args = serve_args("--config_file", str(path), "--port", "8000", "-c", "1024", "--no-interrupt_requests",
                      "--nodes", "127.0.0.1:7100", "--alias", "other")
    assert (args.port, args.ctx_size, args.interrupt_requests, args.nodes, args.alias) == (
        8000, 1024, False, ["127.0.0.1:7100"], "other")
    assert args.api_key == "-sekrit" and args.layers == [6, 6, 6]


@pytest.mark.parametrize(("config", "says"), [
    ({"prot": 8000, "models": [{"model": "m.gguf", "n_gpu_layers": -1, "n_ctxx": 5}]},
     ["llama-cpp-python settings that primaplug serve does not take: models[0].n_gpu_layers",
      "unknown keys: prot, models[0].n_ctxx"]),
    ({"root_path": "/api"}, ["llama-cpp-python settings that primaplug serve does not take: root_path"]),
    ({"models": [{"model": "a.gguf"}, {"model": "b.gguf"}]}, ["a list of one model"]),
    ({"port": "eighty"}, ["port: invalid int value: 'eighty'"]),
    ({"nodes": ["nohostport"]}, ["nodes: --nodes takes HOST:PORT"]),
    ({"insecure": "yes"}, ["insecure is true or false, got 'yes'"]),
    ({"ctx-size": 512, "models": [{"n_ctx": 1024}]}, ["ctx-size and models[0].n_ctx set the same thing"]),
    ({"config_file": "other.json"}, ["unknown keys: config_file"]),
])
def test_config_file_errors_name_the_key(tmp_path: Path, config: dict[str, Any], says: list[str]) -> None:
    pytest.importorskip("llama_cpp.server.settings", reason="needs primaplug[server]")
    from primaplug.core import ConfigError

    path = tmp_path / "serve.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        serve_args("--config_file", str(path))
    for s in says:
        assert s in str(e.value), str(e.value)


def test_config_file_that_does_not_parse(tmp_path: Path) -> None:
    from primaplug.core import ConfigError

    bad = tmp_path / "serve.json"
    bad.write_text("{host: 1")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        serve_args("--config_file", str(bad))
    with pytest.raises(ConfigError, match="No such file"):
        serve_args("--config_file", str(tmp_path / "missing.yaml"))
    listed = tmp_path / "serve.yaml"
    listed.write_text("- host\n")
    pytest.importorskip("yaml")
    with pytest.raises(ConfigError, match="expected a mapping of settings, got list"):
        serve_args("--config_file", str(listed))


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.10", False), ("myhost.local", False)])
def test_loopback(host: str, loopback: bool) -> None:
    from primaplug.cli.serve import is_loopback

    assert is_loopback(host) is loopback


def test_off_loopback_without_a_key_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """The refusal comes first: no model is read, no node started. With --insecure or --api_key, serve goes on
    (to the missing model here, which is the next thing it reads)."""
    missing = str(tmp_path / "missing.gguf")
    out = run_cli("serve", "--host", "0.0.0.0", "-m", missing)
    assert out.returncode == 2, out.stderr
    assert "--host 0.0.0.0 is off this machine's loopback and no --api_key is set" in out.stderr
    assert "Pass --api_key KEY" in out.stderr and "--insecure" in out.stderr and "missing.gguf" not in out.stderr
    for extra in (["--insecure"], ["--api_key", "k"]):
        out = run_cli("serve", "--host", "0.0.0.0", "-m", missing, *extra)
        assert out.returncode == 2, out.stderr
        assert "missing.gguf: cannot open" in out.stderr and "api_key" not in out.stderr, out.stderr
    out = run_cli("serve", "--host", "127.0.0.1", "-m", missing)
    assert out.returncode == 2 and "api_key" not in out.stderr, out.stderr


def test_a_port_in_use_fails_before_the_ring_is_deployed(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("serve", "--port", str(port), "-m", str(tmp_path / "missing.gguf"))
    assert out.returncode == 2, out.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in out.stderr and "choose another --port" in out.stderr, out.stderr


def test_ssl_and_key_checks(tmp_path: Path) -> None:
    from primaplug.cli.serve import check, url
    from primaplug.core import ConfigError

    cert = tmp_path / "cert.pem"
    cert.write_text("not checked here: uvicorn reads it")
    with pytest.raises(ConfigError, match="--ssl_keyfile needs --ssl_certfile"):
        check(serve_args("--ssl_keyfile", str(cert)))
    with pytest.raises(ConfigError, match="no such file"):
        check(serve_args("--ssl_certfile", str(tmp_path / "nope.pem")))
    with pytest.raises(ConfigError, match="--api_key is empty"):
        check(serve_args("--api_key", ""))
    with pytest.raises(ConfigError, match="add --parallel 1"):  # before any node starts
        check(serve_args("--model-draft", str(cert)))
    check(serve_args("--model-draft", str(cert), "--parallel", "1"))
    assert url(serve_args("--ssl_certfile", str(cert))) == "https://127.0.0.1:8000/v1"
    assert url(serve_args("--host", "::1", "--port", "9")) == "http://[::1]:9/v1"


def test_metrics_text_parses_and_adds_up() -> None:
    from primaplug.server.metrics import Metrics, NodeFigures, RingFigures
    from primaplug.wire import Status

    status = Status(node="node2", state="ready", memory_pressure=0.25, resident_bytes=3 << 20,
                    memory_budget_bytes=8 << 20, major_faults_per_token=1.5)

    m = Metrics()
    streamed = m.start("chat_completions", stream=True)
    for _ in range(5):
        m.chunk(streamed)
    m.end(streamed)
    plain = m.start("completions", stream=False)
    m.usage(plain, 7)
    m.end(plain)
    m.end(plain, "error")  # a request is recorded once
    m.end(m.start("completions", stream=True), "unavailable")
    ring = RingFigures(n_parallel=4, running=1, waiting=2, ready=True, prompt_tokens=40,
                       nodes=(NodeFigures('node "1"', "loading"), NodeFigures("node2", "ready", status)))
    m.render(ring)
    ring = RingFigures(n_parallel=4, running=1, waiting=2, ready=False, prompt_tokens=40,
                       nodes=(NodeFigures('node "1"', "ready"), NodeFigures("node2", "failed", status)))
    s = parse_prometheus(m.render(ring))
    assert value(s, "primaplug_requests_total", endpoint="chat_completions", outcome="ok") == 1
    assert value(s, "primaplug_requests_total", endpoint="completions", outcome="ok") == 1
    assert value(s, "primaplug_requests_total", endpoint="completions", outcome="unavailable") == 1
    assert value(s, "primaplug_requests_total", endpoint="completions", outcome="error") == 0
    assert value(s, "primaplug_generated_tokens_total") == 12 and value(s, "primaplug_prompt_tokens_total") == 40
    assert value(s, "primaplug_requests_in_flight") == 0 and value(s, "primaplug_requests_waiting") == 2
    assert value(s, "primaplug_time_to_first_token_seconds_count") == 1
    assert value(s, "primaplug_time_per_output_token_seconds_count") == 1
    assert value(s, "primaplug_request_duration_seconds_count", stream="true") == 2
    assert value(s, "primaplug_tokens_per_second") > 0 and value(s, "primaplug_ring_ready") == 0
    # a gauge per node and state: 1 for the state it is in, 0 for the ones it was in
    assert value(s, "primaplug_node_state", node='node \\"1\\"', state="ready") == 1
    assert value(s, "primaplug_node_state", node='node \\"1\\"', state="loading") == 0
    assert value(s, "primaplug_node_state", node="node2", state="failed") == 1
    assert value(s, "primaplug_node_memory_pressure_ratio", node="node2") == 0.25
    assert value(s, "primaplug_node_resident_bytes", node="node2") == 3 << 20
    assert "primaplug_node_resident_bytes" in s and frozenset({("node", 'node \\"1\\"')}) not in s[
        "primaplug_node_resident_bytes"]  # no status from it yet: no figure rather than a zero
