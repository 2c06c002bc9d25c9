"""Param groups as torch users write them, resolved once into names + options.

``parallelize(model, param_groups=...)`` takes either torch's form — a list of
``{"params": [...], **options}`` whose params are tensors of the module or their names — or
a callable ``(name, param) -> dict`` of options, whose distinct answers become groups in the
order they first appear. Every trainable param must be in exactly one group (torch would
silently never step a param left out; aligndp refuses instead). The result is plain data
each optimizer part cuts by the params it steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn as nn

__all__ = ["ParamGroup", "resolve_param_groups", "ParamGroupsArg"]

ParamGroupsArg = Sequence[dict] | Callable[[str, nn.Parameter], dict] | None


@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """One group: the trainable params it holds (by name, in registration order) and its options."""

    names: tuple[str, ...]
    options: dict


def resolve_param_groups(model: nn.Module, param_groups: ParamGroupsArg) -> list[ParamGroup]:
    """``param_groups`` as :class:`ParamGroup` s over the trainable params of ``model`` (one group
    if None)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if param_groups is None:
        return [ParamGroup(tuple(n for n, _ in named), {})]
    if callable(param_groups):
        keys: list[tuple] = []
        members: dict[tuple, list[str]] = {}
        for n, p in named:
            options = param_groups(n, p)
            if not isinstance(options, dict):
                raise TypeError(
                    f"param_groups callable returned {type(options).__name__} for {n!r}: return "
                    "a dict of optimizer options, e.g. {'weight_decay': 0.0}"
                )
            key = tuple(sorted(options.items(), key=lambda kv: kv[0]))
            if key not in members:
                keys.append(key)
                members[key] = []
            members[key].append(n)
        return [ParamGroup(tuple(members[k]), dict(k)) for k in keys]
    if isinstance(param_groups, torch.Tensor) or not isinstance(param_groups, Iterable):
        raise TypeError(  # torch.optim's type for params that are not an iterable of them
            "param_groups takes an iterable of params (or names) or of dicts with a 'params' "
            f"key, as torch's optimizers take, or a callable; got {type(param_groups).__name__}"
        )
    param_groups = list(param_groups)
    if param_groups and not any(isinstance(g, dict) for g in param_groups):
        param_groups = [{"params": param_groups}]  # torch: an iterable of params is one group
    name_of = {id(p): n for n, p in named}
    trainable = set(name_of.values())
    all_names = {n for n, _ in model.named_parameters()}
    seen: dict[str, int] = {}
    groups = []
    for i, group in enumerate(param_groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"param group {i} must be a dict with a 'params' key, like torch's optimizers "
                f"take, got {group!r:.80}"
            )
        params = group["params"]
        params = [params] if isinstance(params, (str, nn.Parameter)) else list(params)
        names = []
        for p in params:
            if not isinstance(p, (str, torch.Tensor)):  # torch.optim's TypeError, aligndp's words
                raise TypeError(
                    f"param group {i} holds {p!r:.40} ({type(p).__name__}): optimizers can only "
                    "optimize Tensors; list the module's params (or their names)"
                )
            n = p if isinstance(p, str) else name_of.get(id(p))
            if n is None or n not in trainable:
                what = repr(p) if isinstance(p, str) else f"a tensor of shape {tuple(p.shape)}"
                why = (
                    "a frozen param (requires_grad=False)"
                    if isinstance(p, str) and p in all_names
                    else "not a trainable param of the wrapped module"
                )
                raise ValueError(
                    f"param group {i} holds {what:.80}: {why}; list the module's own trainable "
                    "params"
                )
            if n in seen:
                raise ValueError(
                    f"param {n!r} is in param groups {seen[n]} and {i}: put it in one group only"
                )
            seen[n] = i
            names.append(n)
        groups.append(ParamGroup(tuple(names), {k: v for k, v in group.items() if k != "params"}))
    missing = [n for n, _ in named if n not in seen]
    if missing:
        raise ValueError(
            f"trainable params {missing[:5]}{' ...' if len(missing) > 5 else ''} are in no "
            "param group: add them to a group (torch would never step them) or set "
            "requires_grad_(False) before wrapping"
        )
    return groups
