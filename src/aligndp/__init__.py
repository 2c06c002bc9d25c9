"""aligndp: data-parallel training for PyTorch where alignment is a contract."""
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

__all__ = [
    "BufferLayout",
    "BucketSlot",
    "Mode",
    "ParamSlot",
    "ParamSpec",
    "Requirement",
    "plan_buffers",
    "plan_layout",
    "validate",
]
