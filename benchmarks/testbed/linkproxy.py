"""Emulated Wi-Fi links: a user-space TCP forwarder that adds latency and caps bandwidth (this kernel has no
netem). Each link listens on a loopback port and forwards to one target; bytes are delivered after they have
been "transmitted" at the link's rate and then travelled for its latency, in both directions.

Run as a process controlled through stdin, one command a line (the first line it prints is the endpoint that takes
the same commands from other processes):
    add HOST PORT LATENCY_MS MBIT [LISTEN_PORT [SENDER]]
                                                  ->  prints "tcp://127.0.0.1:LISTEN_PORT" for the link to that
                                                      target (any free port unless LISTEN_PORT is given, 0: any), or
                                                      "error: ..." when that port cannot be had; SENDER names the
                                                      device that sends on it in its trace (TRACE_ENV), as
                                                      "A" or "A>B" (B: the target's device, which answers)
    quit
`LinkProxy` in this module starts and drives such a process; `RemoteLinks` (linkclient.py) drives it from another
process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

CHUNK = 64 << 10
# a folder where each pipe writes when every chunk came in, was due and went out (peers.py's per-hop breakdown);
# the times are kept in memory and written when the connection closes, so tracing adds no I/O to a token's path
TRACE_ENV = "PRIMAPLUG_LINK_TRACE"


class _Pipe:
    """One direction of one connection: schedules every chunk by the link's rate, then its latency."""

    def __init__(self, latency_s: float, bytes_per_s: float, name: str = "") -> None:
        self.latency_s, self.bytes_per_s, self.name = latency_s, bytes_per_s, name
        self.free_at = 0.0  # when the emulated radio has sent what it was given
        self.trace: list[tuple[float, float, float, int]] | None = [] if os.environ.get(TRACE_ENV) else None

    def _write_trace(self) -> None:
        if not self.trace:
            return
        path = os.path.join(os.environ[TRACE_ENV], f"{self.name}-{os.getpid()}-{id(self):x}.tsv")
        with open(path, "w") as f:
            f.write("".join(f"{t_in:.6f}\t{due:.6f}\t{t_out:.6f}\t{n}\n" for t_in, due, t_out, n in self.trace))

    async def run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                t_in, due, data = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if self.trace is not None:  # stamped before the write: the receiver may run before we stamp after it
                    self.trace.append((t_in, due, loop.time(), len(data)))  # loop.time() is time.monotonic()
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(deliver())
        try:
            while data := await reader.read(CHUNK):
                now = loop.time()
                self.free_at = max(now, self.free_at) + len(data) / self.bytes_per_s
                queue.put_nowait((now, self.free_at + self.latency_s, data))
        except ConnectionError:
            pass
        finally:
            queue.put_nowait(None)
            try:
                with contextlib.suppress(ConnectionError):
                    await sender
            finally:  # also when the proxy is told to quit and its tasks are cancelled
                writer.close()
                self._write_trace()


async def _link(target: tuple[str, int], latency_s: float, bytes_per_s: float, listen_port: int = 0,
                sender: str = "") -> int:
    async def handle(r_in: asyncio.StreamReader, w_in: asyncio.StreamWriter) -> None:
        try:
            r_out, w_out = await asyncio.open_connection(*target)
        except OSError:
            w_in.close()
            return
        # a trace's name: who sends on it (the connecting side, then the answering one) and the target's port
        there, _, back = sender.partition(">")
        with contextlib.suppress(asyncio.CancelledError):  # the proxy told to quit with connections open
            await asyncio.gather(_Pipe(latency_s, bytes_per_s, f"{there}~to{target[1]}").run(r_in, w_out),
                                 _Pipe(latency_s, bytes_per_s, f"{back}~from{target[1]}").run(r_out, w_in))

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    return server.sockets[0].getsockname()[1]


async def _command(line: list[str]) -> str:
    host, port, latency_ms, mbit = line[1], int(line[2]), float(line[3]), float(line[4])
    try:
        listen = await _link((host, port), latency_ms / 1000, mbit * 1e6 / 8, int(line[5]) if len(line) > 5 else 0,
                             line[6] if len(line) > 6 else "")
    except OSError as e:  # the fixed port is taken
        return f"error: {e}"
    return f"tcp://127.0.0.1:{listen}"


async def _control(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """The same commands from another process (one that has no stdin of this one: a head started apart)."""
    while line := (await r.readline()).decode().split():
        w.write((await _command(line) + "\n").encode())
        await w.drain()
    w.close()


async def _serve() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    control = await asyncio.start_server(_control, "127.0.0.1", 0)
    print(f"control tcp://127.0.0.1:{control.sockets[0].getsockname()[1]}", flush=True)
    while line := (await reader.readline()).decode().split():
        if line[0] == "quit":
            return
        print(await _command(line), flush=True)


class LinkProxy:
    """A proxy process; `route(endpoint, latency_ms, mbit)` returns the endpoint to connect to instead. With
    `trace_dir`, its links record every chunk there (TRACE_ENV)."""

    def __init__(self, trace_dir: str | os.PathLike[str] | None = None) -> None:
        env = os.environ | {TRACE_ENV: os.fspath(trace_dir)} if trace_dir is not None else None
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.testbed.linkproxy"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        # where another process asks for links (RemoteLinks)
        self.control = self.proc.stdout.readline().strip().removeprefix("control ")

    def route(self, endpoint: str, latency_ms: float, mbit: float, listen_port: int = 0, sender: str = "") -> str:
        """The endpoint to connect to instead of `endpoint`: on `listen_port` of 127.0.0.1 if given (a peer that
        derives its ports from its own, prima.cpp's ranks), else on any free one. `sender` names the sending device
        in the link's trace."""
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"add {host.strip('[]')} {port} {latency_ms} {mbit} {listen_port} {sender}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().strip()
        if not line.startswith("tcp://"):
            raise RuntimeError(f"the link proxy did not start a link to {endpoint} (exit code {self.proc.poll()})")
        return line

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _measure_rtt(endpoint: str, n: int = 20) -> float:
    """Median round trip of one small message through `endpoint` to an echo server behind it (for checks)."""
    import socket
    import statistics

    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    times = []
    with socket.create_connection((host, int(port))) as s:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    asyncio.run(_serve())
