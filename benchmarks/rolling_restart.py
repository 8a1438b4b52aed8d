#!/usr/bin/env python3
"""A rolling restart under load: `serve`'s app over N local nodes while clients keep asking, and every node in turn
stopped (SIGTERM, or SIGKILL with --kill) and started again on its port. Every answer must be the text the ring gave
before the first restart (greedy), and no request may fail.

    .venv/bin/python benchmarks/rolling_restart.py [--nodes 3] [--clients 2] [--kill] [--tokens 32]

Prints each restart, the re-formings the head made (what was lost or joined, survey, plan and load seconds), the
requests served and any that failed or differed; exits 1 if one did. Appends nothing to the results: a check to
rerun by hand (the `serve` tests run one restart, tests/test_serve_faults.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from primaplug.cli.common import default_model

ASK = dict(model="gemma", messages=[{"role": "user", "content": "Tell me about the history of the ring."}],
           temperature=0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kill", action="store_true", help="SIGKILL each node instead of SIGTERM")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import primaplug
    from primaplug.head.launch import LocalNodes
    from primaplug.server import create_app
    from tests.server_helpers import ThreadedServer, openai_client

    model = default_model()
    ask = dict(ASK, max_tokens=a.tokens, extra_body={"min_tokens": a.tokens})
    with tempfile.TemporaryDirectory(prefix="rolling-") as logs, \
            LocalNodes(model, a.nodes, log_dir=logs) as local:
        llm = primaplug.Llama(model, nodes=local.addresses, scheduler="even", node_threads=1,
                              n_parallel=a.clients, chat_format="gemma", timeout_s=2.0, n_ctx=512, n_batch=64,
                              n_ubatch=32, n_threads=1, verbose=False)
        try:
            with ThreadedServer(create_app(llm, alias="gemma")) as server:
                client = openai_client(server.url)
                expected = client.chat.completions.create(**ask).choices[0].message.content
                served, wrong, failed = [0], [], []
                stop = threading.Event()

                def keep_asking() -> None:
                    while not stop.is_set():
                        try:
                            got = client.chat.completions.create(**ask).choices[0].message.content
                        except Exception as e:  # noqa: BLE001 - counted and reported
                            failed.append(repr(e))
                            continue
                        served[0] += 1
                        if got != expected:
                            wrong.append(got)

                workers = [threading.Thread(target=keep_asking) for _ in range(a.clients)]
                for w in workers:
                    w.start()
                t0 = time.monotonic()
                for i, node in enumerate(list(local.nodes)):
                    time.sleep(2.0)
                    os.kill(node.pid, signal.SIGKILL if a.kill else signal.SIGTERM)
                    node.proc.wait(10)
                    n_before = len(llm.reforms)
                    print(f"{time.monotonic() - t0:6.1f} s  stopped {node.name}", flush=True)
                    time.sleep(1.0)
                    again = LocalNodes(model, 1, log_dir=Path(logs) / f"again{i}", names=[node.name],
                                       node_args=[["--listen", node.address]])
                    again.start()
                    local._spawned += again._spawned  # stopped with the others
                    deadline = time.monotonic() + 60
                    while not any(node.name in r.joined for r in llm.reforms[n_before:]):
                        if time.monotonic() > deadline:
                            print(f"{node.name} did not rejoin within 60 s", flush=True)
                            failed.append(f"{node.name} did not rejoin")
                            break
                        time.sleep(0.1)
                    print(f"{time.monotonic() - t0:6.1f} s  {node.name} back in the ring", flush=True)
                time.sleep(2.0)
                stop.set()
                for w in workers:
                    w.join(120)
                for r in llm.reforms:
                    print(f"  re-formed in {r.seconds:.2f} s (survey {r.survey_s:.2f}, plan {r.plan_s:.2f}, load "
                          f"{r.load_s:.2f}): {r.why}")
                print(f"{served[0]} requests served, {len(wrong)} with other text, {len(failed)} failed"
                      + (f": {failed[:3]}" if failed else ""))
                return 1 if wrong or failed else 0
        finally:
            llm.close()


if __name__ == "__main__":
    sys.exit(main())
