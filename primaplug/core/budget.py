"""The numbers a node's memory plan is built on, shared by the node that plans with them and the scheduler that
predicts the plan (scheduler/ring.py)."""

MARGIN = 0.05  # of total memory, left out of a node's budget for the OS and the apps people use
# a streaming mixture of experts keeps room for this many layers' worth of one token's chosen experts beside its
# hot set: the layer computing, and the next one's predicted choice (memory/experts.py)
EXPERT_WORKING_LAYERS = 2
MAX_KEEP = 0.95  # the largest fraction of every streamed layer a node keeps resident (memory/policy.py)
# a prefetch that leaves at most this much of its window to fault in still reads ahead (a window a few MiB over
# the room, as the scheduler's windows often are, then streams at the disk's rate instead of page by page)
READ_AHEAD_SLACK = 16 << 20
# the least room a streaming node leaves beside the kept part of every layer: what else its memory holds (its
# runtime's growth, its libraries' pages, the kernel's) must fit there, or it pushes kept and prefetched pages out and
# they fault back in page by page. Measured on the emulated cluster with twice the memory, k = 4: d1 keeping 90% of
# its one-layer windows (12 MiB of room) ran 2.8 s in 5 of 7 runs (its prefetched windows reclaimed before use) and
# 1.95 s in 2; with this room, 1.95 s in 3 of 3. With room for two 4 MiB streamed layers, d3 at k = 2 faulted in
# 60 MB a token
ROOM_SLACK = 32 << 20
ROOM_SLACK_SHARE = 8  # of a budget under 256 MiB, the room instead (a small budget still keeps most of every layer)


def room_slack(budget_bytes: float) -> float:
    """The least room beside what a node keeps: ROOM_SLACK, or a ROOM_SLACK_SHARE-th of a smaller budget."""
    return min(ROOM_SLACK, budget_bytes / ROOM_SLACK_SHARE)


def kept_fraction(budget_bytes: float, total_bytes: float, unit_bytes: float, slots: float) -> float:
    """The largest fraction of every streamed unit (window or layer) a node keeps that leaves room for `slots`
    units' streamed parts beside it (f * total + slots * (1 - f) * unit <= budget), at most MAX_KEEP."""
    room, need = budget_bytes - slots * unit_bytes, total_bytes - slots * unit_bytes
    return max(0.0, min(MAX_KEEP, room / need)) if need > 0 and room > 0 else 0.0


def slack_fraction(budget_bytes: float, total_bytes: float) -> float:
    """The largest fraction of `total_bytes` a node keeps that still leaves room_slack beside it."""
    return max(0.0, (budget_bytes - room_slack(budget_bytes)) / total_bytes)
