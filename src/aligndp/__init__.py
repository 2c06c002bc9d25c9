"""aligndp: data-parallel training for PyTorch where alignment is a contract."""

from aligndp.optim.registry import register_whole_matrix
from aligndp.optim.whole_matrix import WholeMatrixSpec
from aligndp.parallelize import parallelize, plan_request
from aligndp.plan.layout import (
    BucketSlot,
    BufferLayout,
    Mode,
    ParamSlot,
    ParamSpec,
    Requirement,
    plan_layout,
    validate,
)
from aligndp.plan.request import PlanRequest, plan_buffers
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
    "PlanRequest",
    "Requirement",
    "Routing",
    "WholeMatrixSpec",
    "parallelize",
    "plan_request",
    "register_whole_matrix",
    "route_params",
    "load",
    "save",
    "plan_buffers",
    "plan_layout",
    "validate",
]
