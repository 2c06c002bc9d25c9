"""``torch.save(model)`` of a wrapped model, as torch DDP's pickling works.

torch DDP pickles its module and settings, not its reducer or process group, and builds a
new reducer over the default process group when it is loaded. A :class:`DataParallel` does the
same: it pickles the module (its params' values, gathers waited for first) with its
``DDPConfig`` and plan request, and loading wraps that module again over the default group
(``torch.distributed`` initialised, on every rank, as torch DDP's loading needs). The
optimizer is not part of the model: build it again (``aligndp.parallelize`` or the
checkpoint's ``load``). A model over another group or a mesh is refused, as torch refuses a
non-default group, with a ``RuntimeError``.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["reduce_wrapper"]


def reduce_wrapper(model) -> tuple:
    """``model.__reduce_ex__``: a picklable recipe that wraps the module again on load."""
    every = list(range(dist.get_world_size()))
    if dist.get_process_group_ranks(model.process_group) != every or model.collectives.replicas > 1:
        raise RuntimeError(
            "torch.save of a DataParallel works only over the default process group (as torch "
            "DDP's pickling); save model.module, or its state_dict(), instead"
        )
    if model.param_gather.coded is not None:
        raise RuntimeError(
            "torch.save of a DataParallel with fp8_param_gather=True is not supported: save "
            "model.module.state_dict() (or an aligndp checkpoint) instead"
        )
    model.param_gather.wait_all()  # the params hold this step's values
    return _rewrap, (type(model), model.module, model.config, model.plan_request)


def _rewrap(cls, module, config, plan):
    return cls(module, config=config, plan=plan)
