"""The torch-optimizer face shared by aligndp's optimizers.

aligndp's optimizers drive one or more torch optimizers over buffer views and must still
look like a single ``torch.optim.Optimizer`` to user code: ``step``/``zero_grad``,
``param_groups`` whose edits (lr schedulers) reach the inner optimizers, ``state_dict`` /
``load_state_dict``. ``param_groups`` is the concatenation of the inner optimizers' own group
dicts — the same dict objects, so writing ``group["lr"]`` changes the inner optimizer
directly. It is read afresh on every access: ``Optimizer.load_state_dict`` replaces an inner
optimizer's group dicts, and a list captured at construction would then point at dead dicts.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aligndp.runtime.collectives import Collectives
from aligndp.runtime.ddp import DataParallel

__all__ = [
    "DataParallelOptimizer",
    "ELEMENTWISE_OPTIMIZERS",
    "check_max_grad_norm",
    "resolve_optimizer_class",
    "is_elementwise",
    "check_options",
    "global_grad_norm",
]

ELEMENTWISE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": torch.optim.SGD,
    "rmsprop": torch.optim.RMSprop,
    "adagrad": torch.optim.Adagrad,
    "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam,
    "radam": torch.optim.RAdam,
    "adadelta": torch.optim.Adadelta,
    "rprop": torch.optim.Rprop,
}
"""torch optimizers selectable by name. Each also passes :func:`is_elementwise`, the test
ZeRO-1 applies to any optimizer class it is given."""

_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def check_max_grad_norm(max_grad_norm: object) -> None:
    """Refuse a clipping threshold that is not > 0 (None: no clipping)."""
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")


def resolve_optimizer_class(name: str | type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    if isinstance(name, type) and issubclass(name, torch.optim.Optimizer):
        return name
    if isinstance(name, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer= takes a torch optimizer class or a name, got an instance of "
            f"{type(name).__name__}: pass {type(name).__name__} itself (aligndp builds it over the "
            "buffers) and its options as keyword arguments"
        )
    try:
        return ELEMENTWISE_OPTIMIZERS[str(name).lower()]
    except KeyError:
        raise ValueError(
            f"unknown elementwise optimizer {name!r}: choose one of "
            f"{sorted(ELEMENTWISE_OPTIMIZERS)} or pass a torch.optim.Optimizer subclass"
        ) from None


def _probe_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k not in _IMPL_KEYS}


def check_options(opt_class: type[torch.optim.Optimizer], options: dict) -> None:
    """Build ``opt_class`` with ``options`` over a 4x6 tensor, so that what torch refuses
    (an unknown keyword, a negative lr) is raised as torch raises it, before anything is
    wrapped. Implementation flags (``fused``, ``foreach``, ...) are left to the real build."""
    opt_class([torch.zeros(4, 6, requires_grad=True)], **_probe_options(options))


def is_elementwise(opt_class: type[torch.optim.Optimizer], options: dict) -> bool:
    """Whether ``opt_class`` with ``options`` updates each element from that element's history
    alone.

    How it is decided: a probe. The optimizer steps a 4x6 tensor three times, and separately
    two flat pieces of it cut at element 7 (how ZeRO-1 cuts params) with the same gradients;
    elementwise optimizers give the same values (1e-6). This refuses per-tensor statistics
    (Muon, Adafactor's factored moments, LAMB's trust ratio). Building and stepping the
    optimizer over the whole tensor is the user's call: what torch raises there (a misspelt
    keyword) is raised as it is. A ``step()`` that fails without arguments (a keyword that
    ``opt.step(**kwargs)`` passes on, as ZeroRedundancyOptimizer takes) is probed as the torch
    optimizer it derives from (AdamW, Adam, SGD: the subclass adds keywords, not maths), or else
    is a TypeError saying so (LBFGS's closure), never read as "not elementwise".
    """
    options = _probe_options(options)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=gen)
    grads = [torch.randn(4, 6, generator=gen) for _ in range(3)]
    whole = start.clone().requires_grad_(True)
    opt_whole = opt_class([whole], **options)  # the user's options: their errors propagate
    try:
        whole.grad = grads[0].clone()
        opt_whole.step()
    except NotImplementedError:  # no step of its own: nothing elementwise about it
        return False
    except Exception as e:  # a step() that needs a closure (LBFGS) or keywords
        parent = next(
            (c for c in opt_class.__mro__[1:] if c in ELEMENTWISE_OPTIMIZERS.values()), None
        )
        if parent is not None:  # a torch optimizer's maths with step keywords added: probe that
            return is_elementwise(parent, options)
        name = getattr(opt_class, "__name__", repr(opt_class))
        raise TypeError(
            f"{name}.step() raised {type(e).__name__}: {str(e)[:120]!r} when aligndp stepped a "
            "4x6 tensor without arguments to check that it is elementwise (sharding='zero1' "
            "steps slices); make its step() run without arguments, or use sharding='none'"
        ) from e
    try:
        pieces = [
            start.reshape(-1)[:7].clone().requires_grad_(True),
            start.reshape(-1)[7:].clone().requires_grad_(True),
        ]
        opt_pieces = opt_class(pieces, **options)
        for i, g in enumerate(grads):
            if i:
                whole.grad = g.clone()
                opt_whole.step()
            pieces[0].grad, pieces[1].grad = g.reshape(-1)[:7].clone(), g.reshape(-1)[7:].clone()
            opt_pieces.step()
    except Exception:  # stepping flat pieces (Muon: 2-D only)
        return False
    return torch.allclose(
        whole.detach().reshape(-1), torch.cat([p.detach() for p in pieces]), rtol=1e-6, atol=1e-7
    )


def global_grad_norm(
    local_sq_sums: Iterable[torch.Tensor], *, collectives: Collectives
) -> torch.Tensor:
    """Global gradient 2-norm from each rank's sums of squares of the real elements it owns.

    One all-reduce for any mix of buffers: callers pass one partial sum per part and must
    together cover every element exactly once.
    """
    sums = list(local_sq_sums)
    total = torch.stack([s.float() for s in sums]).sum() if sums else torch.zeros(())
    if collectives.dp_size > 1:  # one copy of each piece: the shard group, not the replicas
        collectives.all_reduce_owned_sum(total)
    return total.sqrt()


class DataParallelOptimizer(torch.optim.Optimizer):
    """Base class: wraps inner torch optimizers and the :class:`DataParallel` they serve.

    Subclasses implement :meth:`step` and :meth:`zero_grad` (the composite, which one step
    enters anyway). ``torch.optim.Optimizer.__init__`` runs (hooks, step patching, defaults)
    over the inner optimizers' own groups, which it does not copy: the inner optimizers own
    the params, groups and state; this object only forwards to them.
    """

    def __init__(self, model: DataParallel, inner: list[torch.optim.Optimizer]) -> None:
        self.model = model
        self.inner = inner
        self._constructing = True  # torch's __init__ adds our groups: they are the inner ones
        super().__init__(self.param_groups, dict(inner[0].defaults) if inner else {})
        self._constructing = False

    @property
    def param_groups(self) -> list[dict]:  # type: ignore[override]
        if not self._constructing:
            self._show_grads()
        return [g for opt in self.inner for g in opt.param_groups]

    def _show_grads(self) -> None:
        """Give what the inner optimizers step the ``.grad`` torch code reading
        :attr:`param_groups` may see (a subclass's choice; nothing here)."""

    @param_groups.setter
    def param_groups(self, value) -> None:
        if getattr(self, "_constructing", False) and value == []:
            return  # Optimizer.__init__ starts from an empty list; the inner groups are ours
        raise AttributeError(
            "param_groups belong to the inner torch optimizers; edit the group dicts instead"
        )

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged: dict = {}
        for opt in self.inner:
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer internals may assign; the inner ones own it
        pass

    def add_param_group(self, param_group: dict) -> None:
        if self._constructing:
            return  # Optimizer.__init__ registering an inner optimizer's own group
        raise ValueError(
            "aligndp plans its buffers for the module's params when it wraps them, so groups "
            "cannot be added "
            "later: pass every group to aligndp.parallelize(..., param_groups=[{'params': [...], "
            "**options}, ...]); "
            "to train a param later, keep it trainable from the start (a param without gradient "
            "is not stepped)"
        )

    # ---- torch's optimizer state dict, rank-local ----
    def _fingerprint(self) -> dict:
        return {
            "dp_size": self.model.dp_size,
            "rank": self.model.rank,
            "shapes": [
                [[tuple(p.shape) for p in g["params"]] for g in opt.param_groups]
                for opt in self.inner
            ],
        }

    def state_dict(self) -> dict:
        """torch's format, over every inner optimizer: ``state`` keyed by one running param index
        and ``param_groups`` concatenated. Rank-local (a sharded optimizer holds this rank's
        slices): load it on the same rank of the same layout; ``aligndp.save``/``load`` reshard."""
        state: dict[int, dict] = {}
        groups: list[dict] = []
        offset = 0
        for opt in self.inner:
            sd = opt.state_dict()
            for i, s in sd["state"].items():
                state[i + offset] = s
            for g in sd["param_groups"]:
                groups.append({**g, "params": [i + offset for i in g["params"]]})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups, "aligndp": self._fingerprint()}

    def load_state_dict(self, state_dict: dict) -> None:
        mine = self._fingerprint()
        theirs = state_dict.get("aligndp")
        if theirs != mine:

            def describe(fp):
                if not fp:
                    return "a plain torch optimizer"
                groups = sum(len(o) for o in fp["shapes"])
                return f"rank {fp['rank']} of dp size {fp['dp_size']}, {groups} group(s)"

            raise ValueError(
                f"this optimizer state dict was saved by {describe(theirs)} with another layout "
                f"of the optimizer's tensors than this optimizer's ({describe(mine)}): "
                "opt.state_dict() is rank-local; load it on the same rank with the same dp "
                "size, bucket size and param groups, or use aligndp.save()/aligndp.load(), "
                "which reshard"
            )
        offset = 0
        groups = list(state_dict["param_groups"])
        for opt in self.inner:
            count = len(opt.param_groups)
            mine_groups, groups = groups[:count], groups[count:]
            numel = sum(len(g["params"]) for g in mine_groups)
            sub_state = {
                i - offset: s
                for i, s in state_dict["state"].items()
                if offset <= i < offset + numel
            }
            opt.load_state_dict(
                {
                    "state": sub_state,
                    "param_groups": [
                        {**g, "params": [i - offset for i in g["params"]]} for g in mine_groups
                    ],
                }
            )
            offset += numel

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self.inner)
        return f"{type(self).__name__}({inner}; {len(self.param_groups)} param group(s))"
