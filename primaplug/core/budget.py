"""The numbers a node's memory plan is built on, shared by the node that plans with them and the scheduler that
predicts the plan (scheduler/ring.py)."""

MARGIN = 0.05  # of total memory, left out of a node's budget for the OS and the apps people use
MAX_KEEP = 0.95  # the largest fraction of every streamed layer a node keeps resident (memory/policy.py)
# the memory pressure (paper, Sec. 4.3) a node may add by copying weights out of the file mapping: windows that fit
# are repacked for llama.cpp's faster CPU kernels only when the copy, with the KV cache and compute buffers,
# stays under it (memory/policy.py, repack_allowed)
MAX_PRESSURE = 0.06
