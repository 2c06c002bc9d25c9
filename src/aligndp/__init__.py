"""aligndp: data-parallel training for PyTorch where alignment is a contract."""
from aligndp.ddp import DataParallel, DDPConfig
from aligndp.layout import (
    BufferLayout,
    BucketSlot,
    Mode,
    ParamSlot,
    ParamSpec,
    Requirement,
    plan_buffers,
    plan_layout,
    validate,
)
from aligndp.checkpoint import load, save
from aligndp.parallelize import parallelize
from aligndp.routing import Routing, route_params

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
