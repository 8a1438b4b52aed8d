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
