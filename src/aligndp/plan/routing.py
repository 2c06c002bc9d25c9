"""Which params a whole-matrix optimizer (Muon) steps, and which go to AdamW.

[Note: Muon routing]
Muon orthogonalises the update of a hidden 2-D weight matrix. It is the wrong tool for
embeddings (rows are looked up, not multiplied), the output head (a tied head *is* the
embedding), norms, biases and anything not 2-D; those go to AdamW. :func:`route_params`
decides once, from the module tree, and returns a frozen, printable :class:`Routing` — an
explicit mapping owned by one object; nothing is stored on ``nn.Parameter``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence

import torch.nn as nn

__all__ = ["Routing", "route_params", "HEAD_NAMES", "MuonFilter"]

HEAD_NAMES = frozenset({"head", "lm_head", "output", "classifier"})
"""Last component of a module name that marks the output head (``model.lm_head``)."""

MuonFilter = Callable[[str, nn.Parameter, nn.Module], bool] | str | Sequence[str]
"""A predicate ``(name, param, module) -> bool``, or fnmatch name pattern(s) such as
``"blocks.*.weight"``: the params that go to Muon (all others go to AdamW)."""


@dataclasses.dataclass(frozen=True)
class Routing:
    """The params each optimizer steps, by fully qualified name in registration order."""

    whole: tuple[str, ...]
    """2-D hidden matrices, stepped whole by the whole-matrix optimizer (Muon by default)."""
    adamw: tuple[str, ...]
    """Everything else: embeddings, output head, norms, biases, non-2-D params."""
    reasons: tuple[tuple[str, str], ...] = ()
    """``(name, why)`` for every AdamW param, e.g. ``("tok.weight", "embedding")``."""
    optimizer: str = "muon"
    """Name of the whole-matrix optimizer that steps :attr:`whole` (as ``parallelize`` took it)."""

    def __post_init__(self) -> None:
        both = set(self.whole) & set(self.adamw)
        if both:
            raise ValueError(
                f"params routed to both {self.optimizer} and AdamW: {sorted(both)}; route each "
                "param once"
            )

    def optimizer_of(self, name: str) -> str:
        """:attr:`optimizer` (e.g. ``"muon"``) or ``"adamw"``."""
        if name in self.whole:
            return self.optimizer
        if name in self.adamw:
            return "adamw"
        raise KeyError(f"param {name!r} is not routed (frozen or not a param of the routed model)")

    def __str__(self) -> str:
        why = dict(self.reasons)
        lines = [f"{self.optimizer} ({len(self.whole)} matrices):"]
        lines += [f"  {n}" for n in self.whole]
        lines += [f"AdamW ({len(self.adamw)} params):"] + [
            f"  {n}  [{why.get(n, 'filter')}]" for n in self.adamw
        ]
        return "\n".join(lines)


def _owners(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """id(param) -> every (module name, module) holding it directly (a tied param has several)."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append((mod_name, mod))
    return owners


def _default_reason(p: nn.Parameter, owners: list[tuple[str, nn.Module]]) -> str | None:
    """Why ``p`` does not go to Muon by default, or None if it is a hidden matrix."""
    if p.ndim != 2:
        return f"{p.ndim}-D"
    if any(isinstance(mod, nn.Embedding) for _, mod in owners):
        return "embedding"  # also catches a head tied to it: the same tensor
    if any(mod_name.rsplit(".", 1)[-1] in HEAD_NAMES for mod_name, _ in owners):
        return "output head"
    return None


def _as_predicate(muon_filter: MuonFilter) -> Callable[[str, nn.Parameter, nn.Module], bool]:
    if callable(muon_filter):
        return muon_filter
    patterns = (muon_filter,) if isinstance(muon_filter, str) else muon_filter
    if (
        not isinstance(patterns, (tuple, list))
        or not patterns
        or not all(isinstance(pat, str) for pat in patterns)
    ):
        raise TypeError(
            f"muon_filter must be a predicate (name, param, module) -> bool or name pattern(s), "
            f"got {muon_filter!r}"
        )
    return lambda name, p, m: any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def route_params(
    model: nn.Module, *, muon_filter: MuonFilter | None = None, optimizer: str = "muon"
) -> Routing:
    """Route every trainable param of ``model`` to the whole-matrix ``optimizer`` (Muon by
    default) or AdamW. See [Note: Muon routing].

    Default: a param goes to Muon iff it is 2-D, not a param of an ``nn.Embedding`` (a tied
    head is the embedding's own tensor, caught by identity), and not a param of a module
    whose last name component is in :data:`HEAD_NAMES`. ``muon_filter`` replaces that rule
    (it must still select only 2-D params: Muon orthogonalises matrices).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"route_params takes an nn.Module, got {type(model).__name__}")
    owners = _owners(model)
    predicate = None if muon_filter is None else _as_predicate(muon_filter)
    muon, adamw, reasons = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if predicate is None:
            reason = _default_reason(p, owners[id(p)])
        else:
            reason = None if predicate(name, p, owners[id(p)][0][1]) else "filter"
            if reason is None and p.ndim != 2:
                raise ValueError(
                    f"muon_filter selected param {name!r} of shape {tuple(p.shape)}, but Muon "
                    "steps 2-D matrices only; exclude it from the filter (it will go to AdamW)"
                )
        if reason is None:
            muon.append(name)
        else:
            adamw.append(name)
            reasons.append((name, reason))
    return Routing(tuple(muon), tuple(adamw), tuple(reasons), optimizer)
