"""aligndp: data-parallel training for PyTorch where alignment is a contract.

Three registries are the extension points (DESIGN.md, "Where the next thing goes"):
:func:`register_recipe` (a low-precision wgrad recipe), :func:`register_collectives` (a
collective backend) and :func:`register_whole_matrix` (a whole-matrix optimizer).
"""

from aligndp.lowp.recipes import register_recipe
from aligndp.optim.registry import register_whole_matrix
from aligndp.optim.whole_matrix import WholeMatrixSpec
from aligndp.parallelize import parallelize, plan_request
from aligndp.plan.layout import plan_layout
from aligndp.plan.request import PlanRequest, plan_buffers
from aligndp.plan.routing import Routing, route_params
from aligndp.plan.slots import BucketSlot, BufferLayout, ParamSlot
from aligndp.plan.spec import Mode, ParamSpec, Requirement
from aligndp.plan.split import MatrixSplit, SplitPolicy
from aligndp.plan.validate import validate
from aligndp.runtime.collective_backends import register_collectives
from aligndp.runtime.ddp import DataParallel, DDPConfig
from aligndp.runtime.mesh import replica_mesh
from aligndp.state.checkpoint import load, save

__all__ = [
    "BufferLayout",
    "BucketSlot",
    "DataParallel",
    "DDPConfig",
    "MatrixSplit",
    "Mode",
    "ParamSlot",
    "ParamSpec",
    "PlanRequest",
    "Requirement",
    "Routing",
    "SplitPolicy",
    "WholeMatrixSpec",
    "parallelize",
    "plan_request",
    "register_collectives",
    "register_recipe",
    "register_whole_matrix",
    "replica_mesh",
    "route_params",
    "load",
    "save",
    "plan_buffers",
    "plan_layout",
    "validate",
]
