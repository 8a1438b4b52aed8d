"""The Docker image (Dockerfile, docs/docker.md), as people run it: built on a Debian base made here
(docker/local-base.sh) with this machine's CA bundle as the extra certificate, three node containers with the
cluster key on a network of their own, and a head container that runs a prompt through them and gets the text
plain llama-cpp-python gives on the host. The slow rung: a cold build compiles the engine (minutes).

Needs a Docker daemon: one that answers, or dockerd started here (as root); otherwise the tests are skipped and
say why. Containers, the network and the key volume are removed whatever happens; the image stays, for the layer
cache of the next run."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parent.parent
BASE = "local/debian:bookworm"
IMAGE = "primaplug-test:local"
PROMPT = "The three primary colors are"
N_PREDICT = 16
NODES = ("n1", "n2", "n3")
BUILD_TIMEOUT_S = 3600  # a cold build on 2 busy cores: the engine alone takes several minutes


def docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}"
                             f"{out.stderr[-3000:]}")
    return out


def daemon_answers() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=30, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A Docker daemon that answers: the one running, or dockerd started here and stopped after."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH (apt-get install docker.io)")
    if daemon_answers():
        yield
        return
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker daemon answers, and this test starts one only as root with dockerd installed "
                    "(apt-get install docker.io)")
    log_path = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not daemon_answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip("dockerd, started by this test, did not come up; the end of its log:\n"
                            + log_path.read_text()[-2000:])
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def image(daemon: None, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The image, built from this checkout on the local Debian base, with this machine's CA bundle as the extra
    certificate (HTTPS here may be re-signed by a CA only the host trusts)."""
    if docker("image", "inspect", BASE, check=False).returncode != 0 and (
            shutil.which("debootstrap") is None or os.geteuid() != 0):
        pytest.skip(f"no {BASE} image, and docker/local-base.sh makes one only as root with debootstrap installed "
                    "(apt-get install debootstrap)")
    made = subprocess.run([str(ROOT / "docker" / "local-base.sh"), BASE], capture_output=True, text=True,
                          timeout=1800)
    assert made.returncode == 0, f"docker/local-base.sh failed:\n{made.stdout}{made.stderr}"

    context = tmp_path_factory.mktemp("context") / "primaplug"  # a copy, so that the certificate stays out of the tree
    shutil.copytree(ROOT, context, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info",
                                                                 ".pytest_cache", ".ruff_cache", "build", "dist"))
    paths = ssl.get_default_verify_paths()
    bundle = next((Path(p) for p in (paths.cafile, paths.openssl_cafile) if p and Path(p).is_file()), None)
    if bundle is not None:
        shutil.copyfile(bundle, context / "docker" / "certs" / "test-host-bundle.crt")

    before = docker("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False).stdout.strip()
    log = context.parent / "build.log"
    with open(log, "w") as f:
        built = subprocess.run(["docker", "build", "-t", IMAGE, "--build-arg", f"BASE={BASE}", str(context)],
                               stdout=f, stderr=subprocess.STDOUT, timeout=BUILD_TIMEOUT_S)
    assert built.returncode == 0, "docker build failed; the end of its log:\n" + log.read_text()[-5000:]
    after = docker("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()
    if before and before != after:  # the previous build of this tag: drop it rather than let them pile up
        docker("rmi", before, check=False)
    return IMAGE


@pytest.fixture(scope="module")
def cluster(image: str, gemma_path: Path) -> Iterator[dict[str, str]]:
    """Three healthy node containers (the image's default command) on a network of their own, sharing a cluster
    key made by `primaplug keygen` in a volume, each with a cache volume. Yields what a head container needs: the
    network, the key volume, the model and the nodes' container names."""
    tag = uuid.uuid4().hex[:8]
    net, keys = f"primaplug-test-{tag}", f"primaplug-test-keys-{tag}"
    names = {n: f"primaplug-test-{tag}-{n}" for n in NODES}
    caches = [f"primaplug-test-cache-{tag}-{n}" for n in NODES]  # as docs/docker.md keeps each node's caches
    try:
        docker("network", "create", net)
        docker("volume", "create", keys)
        docker("run", "--rm", "-v", f"{keys}:/keys", image, "keygen", "/keys/cluster.key")
        for (n, name), cache in zip(names.items(), caches, strict=True):
            docker("run", "-d", "--name", name, "--hostname", n, "--network", net, "--network-alias", n,
                   "--health-interval", "2s", "-v", f"{keys}:/keys:ro", "-v", f"{cache}:/home/primaplug/.cache",
                   "-v", f"{gemma_path}:/models/model.gguf:ro", image)
        for name in names.values():
            wait_healthy(name)
        yield {"network": net, "keys": keys, "model": str(gemma_path), **names}
    finally:
        for name in names.values():
            docker("rm", "-f", "-v", name, check=False)
        docker("network", "rm", net, check=False)
        docker("volume", "rm", keys, *caches, check=False)


def wait_healthy(name: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        state = docker("inspect", "--format", "{{.State.Status}} {{.State.Health.Status}}", name).stdout.split()
        if state == ["running", "healthy"]:
            return
        if state[0] != "running" or time.monotonic() > deadline:
            logs = docker("logs", "--tail", "30", name, check=False)
            health = docker("inspect", "--format", "{{json .State.Health}}", name, check=False).stdout
            raise AssertionError(f"{name} is {' '.join(state)}, not healthy; its log:\n{logs.stdout}{logs.stderr}"
                                 f"\nits health checks: {health[-1500:]}")
        time.sleep(1)


def test_the_image_runs_unprivileged_without_compilers(image: str) -> None:
    config = docker("image", "inspect", "--format", "{{.Config.User}} {{json .Config.Entrypoint}} {{json .Config.Cmd}}",
                    image).stdout
    assert config.startswith('primaplug ["primaplug"] ["node",')
    shell = docker("run", "--rm", "--entrypoint", "sh", image, "-c",
                   "id -u; for c in cc gcc g++ c++ cmake; do command -v $c; done; echo end")
    assert shell.stdout.split() == ["1000", "end"], f"root, or a compiler in the runtime image:\n{shell.stdout}"


def test_a_ring_of_node_containers_gives_plain_llamas_text(cluster: dict[str, str]) -> None:
    import llama_cpp

    nodes = ",".join(f"{n}:7000" for n in NODES)
    # --listen 0.0.0.0: the head tells the last node its address on the containers' network
    head = docker("run", "--rm", "--network", cluster["network"], "--no-healthcheck",
                  "-v", f"{cluster['keys']}:/keys:ro", "-v", f"{cluster['model']}:/models/model.gguf:ro", IMAGE,
                  "run", "--nodes", nodes, "-m", "/models/model.gguf", "--keys", "/keys/cluster.key",
                  "--listen", "0.0.0.0", "--scheduler", "even", "-p", PROMPT, "-n", str(N_PREDICT), "--temp", "0",
                  "--verify", check=False)
    assert head.returncode == 0, f"the head container failed:\n{head.stdout}\n{head.stderr[-4000:]}"
    assert "gave the same" in head.stderr and "the same logits" in head.stderr  # --verify, in the head container

    llm = llama_cpp.Llama(cluster["model"], n_ctx=4096, n_batch=512, n_ubatch=512, verbose=False)
    try:
        plain = llm(PROMPT, max_tokens=N_PREDICT, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    assert head.stdout == PROMPT + plain + "\n"


def test_the_health_check_asks_the_node(cluster: dict[str, str]) -> None:
    name = cluster["n1"]
    ok = docker("exec", name, "primaplug", "health", "--keys", "/keys/cluster.key")
    assert ok.stdout.startswith("node n1 at 127.0.0.1:7000 answers: primaplug"), ok.stdout
    # without the key the CurveZMQ handshake never completes: no answer, exit 1 (Docker's "unhealthy")
    refused = docker("exec", name, "primaplug", "health", "--timeout", "2", check=False)
    assert refused.returncode == 1 and "unhealthy" in refused.stderr, refused
