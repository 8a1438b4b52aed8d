"""The systems `benchmarks/peers.py` runs side by side on the same emulated devices: primaplug and the peers a home
user would run instead (prima.cpp, llama.cpp's RPC backend, distributed-llama, exo).

`rig.py` holds the emulated devices of one run (cgroups, their view of memory, the link proxy, a process spawner
that logs and timestamps each process's output); each other module drives one system through its own command
line, as its users start it, and reads back what it printed. No peer's code is here: peers are built from their
public sources, outside this repository (docs/peers.md).
"""
