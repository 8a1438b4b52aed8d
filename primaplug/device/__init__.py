"""What a device does with its windows, the same on a node and on the head: size a memory plan for them (budget,
stream or resident, repack or not), load them, and drive the prefetcher round each window's computation.

    windows = DeviceWindows.load(path, layout, ranges, context=ContextSettings(...), memory=MemorySettings())
    out = windows.compute(r, inputs, pos0)   # round r's window, after the prefetcher's "started" hook
    windows.done(r)                          # its output has gone on: its streamed weights can go
"""

from primaplug.device.memory import MemoryPlan, MemorySettings, plan_memory, reserved_bytes, weights_budget
from primaplug.device.windows import DeviceWindows

__all__ = ["DeviceWindows", "MemoryPlan", "MemorySettings", "plan_memory", "reserved_bytes", "weights_budget"]
