"""Where each layer runs: Halda (prima.cpp's scheduler) and two heuristic baselines, over the paper's latency model
or the ring's (ring.py).

Pure: imports only primaplug.core, numpy and (lazily, when a plan is solved) highspy.
"""

from primaplug.scheduler.latency import DEFAULT_SLOW_DISK_BPS, DeviceSet, Prediction, predict_latency
from primaplug.scheduler.plan import DevicePlan, DroppedDevice, Fetch, Plan
from primaplug.scheduler.ring import RingPrediction, predict_ring
from primaplug.scheduler.solve import (
    LATENCY_MODELS,
    SCHEDULERS,
    LatencyModel,
    Scheduler,
    alternatives,
    check_gpu_layers,
    placement,
    solve,
)

__all__ = [
    "DEFAULT_SLOW_DISK_BPS",
    "LATENCY_MODELS",
    "SCHEDULERS",
    "DevicePlan",
    "DeviceSet",
    "DroppedDevice",
    "Fetch",
    "LatencyModel",
    "Plan",
    "Prediction",
    "RingPrediction",
    "Scheduler",
    "alternatives",
    "check_gpu_layers",
    "placement",
    "predict_latency",
    "predict_ring",
    "solve",
]
