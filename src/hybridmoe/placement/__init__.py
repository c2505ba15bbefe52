"""Tensor placement: which device holds each tensor, and how many bytes each device needs."""

from hybridmoe.placement.fit import check_fits, make_plan
from hybridmoe.placement.plan import DeviceUsage, Plan, PlacementOptions, RamSide, TensorPlacement
from hybridmoe.placement.rules import PlacementError

__all__ = ["DeviceUsage", "Plan", "PlacementError", "PlacementOptions", "RamSide",
           "TensorPlacement", "check_fits", "make_plan"]
