"""The numbers a node's memory plan is built on, shared by the node that plans with them and the scheduler that
predicts the plan (scheduler/ring.py)."""

MARGIN = 0.05  # of total memory, left out of a node's budget for the OS and the apps people use
MAX_KEEP = 0.95  # the largest fraction of every streamed layer a node keeps resident (memory/policy.py)
