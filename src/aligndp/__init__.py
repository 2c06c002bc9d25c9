"""aligndp: data-parallel training for PyTorch where alignment is a contract."""

from aligndp.parallelize import parallelize
from aligndp.plan.layout import (
    BucketSlot,
    BufferLayout,
    Mode,
    ParamSlot,
    ParamSpec,
    Requirement,
    plan_buffers,
    plan_layout,
    validate,
)
from aligndp.plan.routing import Routing, route_params
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.state.checkpoint import load, save

__all__ = [
    "BufferLayout",
    "BucketSlot",
    "DataParallel",
    "DDPConfig",
    "Mode",
    "ParamSlot",
    "ParamSpec",
    "Requirement",
    "Routing",
    "parallelize",
    "route_params",
    "load",
    "save",
    "plan_buffers",
    "plan_layout",
    "validate",
]
