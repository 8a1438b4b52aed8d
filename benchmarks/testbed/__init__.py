"""An emulated home cluster on one machine, for the benchmarks and the memory tests (needs root for cgroups).

- `cgroups`: real memory, disk-read and CPU caps per emulated device (cgroup v1 or v2)
- `linkproxy`: emulated Wi-Fi links (latency and bandwidth) in a user-space forwarder
- `devices`: device files and presets (the prima.cpp paper's D1-D4, scaled down)
- `cluster.Testbed`: nodes in their cgroups with their own model copies, joined by emulated links
- `plain`: plain llama-cpp-python in a capped cgroup (the single-device baseline)

`python -m benchmarks.testbed --help` runs it by hand.
"""
