"""primaplug: run large GGUF models on the devices you have at home, pooled into a pipelined ring.

Importing this package has no side effects: no logging set-up, no environment reads, no native library loads.
"""

__version__ = "0.1.0"
