"""The vocabulary of optimizer state in model space: what checkpoints and optimizers share.

[Note: model-space state]
A checkpoint never mentions buffers, buckets or ranks: every entry is keyed by param name in
model space, at the param's full shape ([Note: checkpoint format] in DESIGN.md):

    model.<key>                     every key of the module's state_dict(): fp32 param values
                                    (the fp32 masters where they exist), buffers
    optim.state.<name>.<key>        per-element state (exp_avg, ...): the param's shape; whole
                                    state (step, a preconditioner, a whole-matrix optimizer's
                                    momentum): its own shape
    optim.param_groups.<i>.<opt>    every option of each torch group; params: their names
    aligndp.json                    format, step, param shapes, writer dp_size, CRC-32 per file

An optimizer takes part through three methods (ShardedOptimizer and CompositeOptimizer have
them; a bare torch optimizer, or none, gets them from an adapter in checkpoint.py):
``owned_range(name) -> (lo, hi)`` of the flattened param this rank holds values and state
for; ``model_space_state_dict()`` -> ``{"param.<name>": FlatPiece, "state.<name>.<key>":
FlatPiece | Tensor, "param_groups": [...]}``; ``load_model_space_state_dict(sd)`` (same
keys, pieces cut to this rank's current ``owned_range``).

Which state is per-element is declared by the optimizer part, never guessed from a numel
(an 8×8 preconditioner of an 8×8 weight has the weight's numel and is not per-element):
an *elementwise* part's state tensors shaped like the param are per-element, everything
else is whole; a *whole-matrix* part's state tensors are all whole, held by the param's owner.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["FlatPiece", "torch_state_to_model_space", "model_space_to_torch_state"]

_IMPL_FLAGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
"""param_group keys that describe the implementation, not the maths: saved (torch's own loaders
expect every key) but never restored."""


@dataclasses.dataclass(frozen=True)
class FlatPiece:
    """This rank's part ``[offset, offset + tensor.numel())`` of a model-space tensor of ``numel``
    elements, flattened."""

    tensor: torch.Tensor
    offset: int
    numel: int

    def __post_init__(self) -> None:
        assert (
            self.tensor.dim() == 1
            and 0 <= self.offset <= self.offset + self.tensor.numel() <= self.numel
        )


def torch_state_to_model_space(
    inner: torch.optim.Optimizer,
    names: list[str | None],
    extents: dict[str, tuple[int, int]],
    *,
    elementwise: bool,
    group_names: list[list[str]] | None = None,
) -> dict[str, object]:
    """Model-space entries of a torch optimizer whose i-th param is the owned part of ``names[i]``.

    ``extents[name] = (offset, full numel)``. ``elementwise``: the part declares its state
    per-element, so tensors shaped like the (owned part of the) param become pieces; otherwise
    every state tensor is whole. ``param_groups`` are torch's, every option included, with
    ``params`` the names of each group's params on every rank (``group_names``; by default
    ``names`` in ``inner``'s order, right when ``inner`` holds every param), as
    ``get_optimizer_state_dict`` writes them.
    """
    params = [p for g in inner.param_groups for p in g["params"]][: len(names)]
    sd: dict[str, object] = {}
    for name, p in zip(names, params):
        if name is None:  # a placeholder param (a group this rank owns nothing of)
            continue
        offset, numel = extents[name]
        for key, value in inner.state.get(p, {}).items():
            if value is None:
                continue  # e.g. SGD's momentum_buffer before it exists
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"{type(inner).__name__} keeps state {key!r} of param {name!r} as a "
                    f"{type(value).__name__}; aligndp checkpoints hold tensor state only and "
                    "would lose it: keep that state in tensors, or save with the optimizer's "
                    "own state_dict() (rank-local)"
                )
            if elementwise and value.dim() >= 1 and value.shape == p.shape:
                sd[f"state.{name}.{key}"] = FlatPiece(
                    value.detach().reshape(-1), offset=offset, numel=numel
                )
            else:
                sd[f"state.{name}.{key}"] = value.detach()
    if group_names is None:
        it = iter(names)
        group_names = [[next(it) for _ in g["params"]] for g in inner.param_groups]
    sd["param_groups"] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(group)}
        for g, group in zip(inner.param_groups, group_names)
    ]
    return sd


def model_space_to_torch_state(
    inner: torch.optim.Optimizer, names: list[str | None], sd: dict[str, object]
) -> None:
    """Load ``sd`` (pieces already cut to this rank) into ``inner`` through its own
    ``load_state_dict``."""
    params = [p for g in inner.param_groups for p in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, p) in enumerate(zip(names, params)):
        if name is None:
            continue
        prefix = f"state.{name}."
        entry = {}
        for key, value in sd.items():
            if key.startswith(prefix) and "." not in key[len(prefix) :]:
                entry[key[len(prefix) :]] = (
                    value.tensor.view(p.shape) if isinstance(value, FlatPiece) else value
                )
        if entry:
            state[i] = entry
    current = inner.state_dict()["param_groups"]
    saved = sd.get("param_groups", [])
    if len(saved) != len(current):
        raise ValueError(
            f"the checkpoint has {len(saved)} optimizer param group(s) but this optimizer has "
            f"{len(current)}: build the optimizer with the same groups as the run that saved it"
        )
    groups = [
        {**cur, **{k: v for k, v in old.items() if k not in _IMPL_FLAGS}}
        for cur, old in zip(current, saved)
    ]
    # torch replaces the group dicts; aligndp's optimizers read ``inner.param_groups`` live
    # (aligndp/optim/base.py), so lr schedulers keep reaching the loaded groups
    inner.load_state_dict({"state": state, "param_groups": groups})
