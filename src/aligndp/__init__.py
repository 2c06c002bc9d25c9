"""aligndp: data-parallel training for PyTorch where alignment is a contract.

Three registries are the extension points (DESIGN.md, "Where the next thing goes"):
:func:`register_recipe` (a low-precision wgrad recipe), :func:`register_collectives` (a
collective backend) and :func:`register_whole_matrix` (a whole-matrix optimizer).

The public names are imported when first used (PEP 562 module ``__getattr__``): ``import
aligndp`` and ``aligndp --help`` do not pay for importing torch.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

_WHERE = {
    "register_recipe": "aligndp.lowp.recipes",
    "register_whole_matrix": "aligndp.optim.registry",
    "WholeMatrixSpec": "aligndp.optim.whole_matrix",
    "parallelize": "aligndp.parallelize",
    "plan_request": "aligndp.parallelize",
    "plan_layout": "aligndp.plan.layout",
    "PlanRequest": "aligndp.plan.request",
    "plan_buffers": "aligndp.plan.request",
    "Routing": "aligndp.plan.routing",
    "route_params": "aligndp.plan.routing",
    "BucketSlot": "aligndp.plan.slots",
    "BufferLayout": "aligndp.plan.slots",
    "ParamSlot": "aligndp.plan.slots",
    "Mode": "aligndp.plan.spec",
    "ParamSpec": "aligndp.plan.spec",
    "Requirement": "aligndp.plan.spec",
    "MatrixSplit": "aligndp.plan.split",
    "SplitPolicy": "aligndp.plan.split",
    "validate": "aligndp.plan.validate",
    "register_collectives": "aligndp.runtime.collective_backends",
    "DataParallel": "aligndp.runtime.ddp",
    "DDPConfig": "aligndp.runtime.ddp",
    "replica_mesh": "aligndp.runtime.mesh",
    "load": "aligndp.state.checkpoint",
    "save": "aligndp.state.checkpoint",
}
"""Each public name and the module that defines it."""

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, eagerly
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


class _Package(types.ModuleType):
    """``aligndp.parallelize`` is the function, although a submodule has the same name:
    importing the submodule binds the package attribute to it (after this package is
    initialised, so no import order here can prevent it); this puts the function back."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "parallelize" and isinstance(value, types.ModuleType):
            value = value.parallelize
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    raise AttributeError(f"module 'aligndp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
