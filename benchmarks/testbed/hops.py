"""Where a token's wall time goes, read off the link proxy's traces (linkproxy.TRACE_ENV): each device's time between
receiving a message and sending the next one, and the links' time. The same for every system, since every message
between devices crosses the proxy; nothing inside a system is instrumented.

One sequence decoding greedily keeps one message in flight at a time (a ring passes the hidden state on; a star
asks one server, then the next), so the decode's wall time splits exactly: walking the messages in the order they were
sent, the time before a message is sent, since the previous one was delivered, is its sender's (computing, or its
runtime's overhead), and the time from its sending to its delivery is the link's: the emulated transfer (latency,
bandwidth) and what the proxy adds past it (its own scheduling, about a millisecond a message on a busy 2-core
machine, paid by every system for each message it sends).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

GAP_S = 0.0005  # chunks of one direction closer than this in arrival are one message


def _messages(trace_dir: Path) -> list[tuple[float, float, float, str]]:
    """(sent, due, delivered, sender) of every message, from each pipe's trace (`{sender}~...tsv`)."""
    out = []
    for f in trace_dir.glob("*.tsv"):
        sender = f.name.split("~", 1)[0] or "?"
        msg: list[float] | None = None
        for line in f.read_text().splitlines():
            t_in, due, t_out, _ = (float(x) for x in line.split())
            if msg is not None and t_in - msg[0] < GAP_S:
                msg[1], msg[2] = max(msg[1], due), max(msg[2], t_out)
                continue
            if msg is not None:
                out.append((msg[0], msg[1], msg[2], sender))
            msg = [t_in, due, t_out]
        if msg is not None:
            out.append((msg[0], msg[1], msg[2], sender))
    return sorted(out)


def breakdown(trace_dir: Path, start: float, end: float, steps: int) -> dict[str, Any]:
    """Per decoding step, in ms, over the messages sent in [start, end] (time.monotonic(): the first and the last
    generated token): each sending device's time, the links' emulated time and the proxy's lateness past it."""
    devices: dict[str, float] = {}
    link = late = 0.0
    n = 0
    cursor = start
    for sent, due, delivered, sender in _messages(trace_dir):
        if sent < start or sent > end:
            continue
        n += 1
        devices[sender] = devices.get(sender, 0.0) + max(0.0, sent - cursor)
        begin = max(sent, cursor)
        link += max(0.0, min(due, delivered) - begin)
        late += max(0.0, delivered - max(due, begin))
        cursor = max(cursor, delivered)
    per = 1000 / max(1, steps)
    return {"messages_per_step": round(n / max(1, steps), 2),
            "device_ms": {d: round(t * per, 2) for d, t in sorted(devices.items())},
            "link_ms": round(link * per, 2), "proxy_late_ms": round(late * per, 2),
            "wall_ms": round((end - start) * per, 2)}
