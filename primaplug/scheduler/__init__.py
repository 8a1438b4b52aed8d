"""Where each layer runs: Halda (prima.cpp's scheduler) and two heuristic baselines over the latency model.

Pure: imports only primaplug.core, numpy and (lazily, when a plan is solved) highspy.
"""

from primaplug.scheduler.latency import DEFAULT_SLOW_DISK_BPS, DeviceSet, Prediction, predict_latency
from primaplug.scheduler.plan import DevicePlan, DroppedDevice, Plan
from primaplug.scheduler.solve import SCHEDULERS, Scheduler, solve

__all__ = [
    "DEFAULT_SLOW_DISK_BPS",
    "SCHEDULERS",
    "DevicePlan",
    "DeviceSet",
    "DroppedDevice",
    "Plan",
    "Prediction",
    "Scheduler",
    "predict_latency",
    "solve",
]
