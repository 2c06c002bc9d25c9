"""Checkpoints through ``torch.distributed.checkpoint`` (DCP) that reshard across dp sizes.

[Note: model-space state]
A checkpoint never mentions buffers, buckets or ranks: every entry is keyed by param name in
model space, and per-element tensors are stored flattened to 1-D with the param's full numel:

    model.<name>                fp32 param values (the fp32 masters where they exist)
    optim.state.<name>.<key>    per-element state (exp_avg, momentum_buffer, ...): (numel,);
                                other state (step): its own shape, e.g. a 0-dim tensor
    optim.param_groups          hyper-parameters of each group (no params, no impl flags)
    buffers.<name>              the module's persistent non-param buffers
    aligndp.json                step, param shapes, dp_size of the writer (a sidecar file)

An optimizer takes part through three methods (ShardedOptimizer and CompositeOptimizer have
them; a bare torch optimizer, or none, gets them from an adapter here):
``owned_range(name) -> (lo, hi)`` of the flattened param this rank holds values and state
for; ``model_space_state_dict()`` -> ``{"param.<name>": FlatPiece, "state.<name>.<key>":
FlatPiece | Tensor, "param_groups": [...]}``; ``load_model_space_state_dict(sd)`` (same
keys, pieces cut to this rank's current ``owned_range``).

Writes are sharded: a piece that is not the whole tensor becomes one shard of a 1-D
``ShardedTensor`` (global metadata computed from one ``all_gather_object`` of piece extents,
no per-tensor collective), so each rank writes only the elements it owns and DCP's
load planner reads any other cut of them. Whole tensors (replicated params, scalars) are
plain tensors that DCP deduplicates to one writer.

Atomicity: everything is written into ``<path>.partial``; after every rank has finished
(barrier) rank 0 moves the old ``path`` aside, renames the new one into place and deletes
the old one. A save that raises part-way leaves ``path`` untouched.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from aligndp.ddp import DataParallel

__all__ = ["FlatPiece", "ParamGroups", "save", "load", "torch_state_to_model_space", "model_space_to_torch_state"]

FORMAT = 1
META_FILE = "aligndp.json"
_IMPL_FLAGS = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
"""param_group keys that describe the implementation, not the maths: never restored."""


@dataclasses.dataclass(frozen=True)
class FlatPiece:
    """This rank's part ``[offset, offset + tensor.numel())`` of a model-space tensor of ``numel`` elements, flattened."""

    tensor: torch.Tensor
    offset: int
    numel: int

    def __post_init__(self) -> None:
        assert self.tensor.dim() == 1 and 0 <= self.offset <= self.offset + self.tensor.numel() <= self.numel


@dataclasses.dataclass
class ParamGroups:
    """Hyper-parameters of the optimizer's groups; one opaque DCP entry (DCP would flatten a bare list)."""

    groups: list[dict]


def torch_state_to_model_space(
    inner: torch.optim.Optimizer, names: list[str], extents: dict[str, tuple[int, int]]
) -> dict[str, object]:
    """Model-space entries of a torch optimizer whose i-th param is the owned part of ``names[i]``.

    ``extents[name] = (offset, full numel)``. Tensors with the param's numel become pieces.
    """
    params = [p for g in inner.param_groups for p in g["params"]][: len(names)]
    sd: dict[str, object] = {}
    for name, p in zip(names, params):
        offset, numel = extents[name]
        for key, value in inner.state.get(p, {}).items():
            if not isinstance(value, torch.Tensor):
                continue  # e.g. SGD's momentum_buffer=None before it exists
            if value.dim() >= 1 and value.numel() == p.numel():
                sd[f"state.{name}.{key}"] = FlatPiece(value.detach().reshape(-1), offset=offset, numel=numel)
            else:
                sd[f"state.{name}.{key}"] = value.detach()
    sd["param_groups"] = [{k: v for k, v in g.items() if k not in _IMPL_FLAGS} for g in inner.param_groups]
    return sd


def model_space_to_torch_state(inner: torch.optim.Optimizer, names: list[str], sd: dict[str, object]) -> None:
    """Load ``sd`` (pieces already cut to this rank) into ``inner`` through its own ``load_state_dict``."""
    params = [p for g in inner.param_groups for p in g["params"]]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, (name, p) in enumerate(zip(names, params)):
        prefix = f"state.{name}."
        entry = {}
        for key, value in sd.items():
            if key.startswith(prefix) and "." not in key[len(prefix):]:
                entry[key[len(prefix):]] = value.tensor.view(p.shape) if isinstance(value, FlatPiece) else value
        if entry:
            state[i] = entry
    current = inner.state_dict()["param_groups"]
    saved = sd.get("param_groups", [])
    if len(saved) != len(current):
        raise ValueError(f"the checkpoint has {len(saved)} optimizer param group(s) but this optimizer has "
                         f"{len(current)}: build the optimizer with the same groups as the run that saved it")
    groups = [{**cur, **{k: v for k, v in old.items() if k not in _IMPL_FLAGS}} for cur, old in zip(current, saved)]
    # torch replaces the group dicts; aligndp's optimizers read ``inner.param_groups`` live
    # (aligndp/optim/base.py), so lr schedulers keep reaching the loaded groups
    inner.load_state_dict({"state": state, "param_groups": groups})


class _ReplicatedView:
    """Model-space face of an optimizer whose torch optimizer steps the model's params directly."""

    def __init__(self, model: DataParallel, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self.named = [(model.param_names[p], p) for p in model.param_names]

    def owned_range(self, name: str) -> tuple[int, int]:
        return 0, dict(self.named)[name].numel()

    def _inner(self):
        inner = getattr(self.optimizer, "inner", [self.optimizer])
        assert len(inner) == 1, "the replicated adapter drives one torch optimizer"
        params = [p for g in inner[0].param_groups for p in g["params"]]
        return inner[0], [self.model.param_names[p] for p in params]

    def model_space_state_dict(self) -> dict[str, object]:
        sd: dict[str, object] = {f"param.{n}": FlatPiece(p.detach().float().reshape(-1), 0, p.numel()) for n, p in self.named}
        if self.optimizer is not None:
            inner, names = self._inner()
            sd.update(torch_state_to_model_space(inner, names, {n: (0, p.numel()) for n, p in self.named}))
        return sd

    @torch.no_grad()
    def load_model_space_state_dict(self, sd: dict[str, object]) -> None:
        for n, p in self.named:
            p.copy_(sd[f"param.{n}"].tensor.view(p.shape))
        if self.optimizer is not None:
            model_space_to_torch_state(*self._inner(), sd)


def _view(model: DataParallel, optimizer):
    if not isinstance(model, DataParallel):
        raise TypeError(f"save/load take the model returned by aligndp.parallelize(), got {type(model).__name__}")
    return optimizer if hasattr(optimizer, "model_space_state_dict") else _ReplicatedView(model, optimizer)


def _to_dcp(entries: dict[str, object], group: dist.ProcessGroup | None) -> dict[str, object]:
    """Turn FlatPieces into plain tensors (whole) or 1-D ShardedTensors (parts); one collective."""
    mine = {k: (v.offset, v.tensor.numel(), v.numel, str(v.tensor.dtype), str(v.tensor.device))
            for k, v in entries.items() if isinstance(v, FlatPiece)}
    everyone: list[dict] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=group)
    out = {k: v for k, v in entries.items() if not isinstance(v, FlatPiece)}
    keys = sorted({k for d in everyone for k in d})
    for key in keys:
        shards = [(r, d[key]) for r, d in enumerate(everyone) if key in d and d[key][1] > 0]
        local = entries.get(key)
        if any(length == numel for _, (_, length, numel, _, _) in shards):
            if local is not None and local.tensor.numel() == local.numel:
                out[key] = local.tensor  # whole on every holder: DCP deduplicates
            continue
        out[key] = _sharded_tensor(key, shards, local, group)
    return out


def _sharded_tensor(key: str, shards: list, local: FlatPiece | None, group) -> ShardedTensor:
    """A 1-D ShardedTensor whose shards are the ranks' pieces, built without communication."""
    def global_rank(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    metas = {r: ShardMetadata([off], [length], placement=f"rank:{global_rank(r)}/{device}")
             for r, (off, length, _, _, device) in shards}
    numel, dtype = shards[0][1][2], getattr(torch, shards[0][1][3].removeprefix("torch."))
    props = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False,
                             memory_format=torch.contiguous_format, pin_memory=False)
    md = ShardedTensorMetadata(list(metas.values()), torch.Size([numel]), props)
    rank = dist.get_rank(group)
    local_shards = [Shard(local.tensor, metas[rank])] if local is not None and rank in metas else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor is deprecated in favour of DTensor, which cannot cut at arbitrary offsets
        return ShardedTensor._init_from_local_shards_and_global_metadata(local_shards, md, process_group=group)


def _entries(model: DataParallel, view) -> dict[str, object]:
    """The checkpoint's keys ([Note: model-space state]) from an optimizer's model-space dict."""
    out: dict[str, object] = {}
    for key, value in view.model_space_state_dict().items():
        if key == "param_groups":
            out["optim.param_groups"] = ParamGroups(value)
        elif key.startswith("param."):
            out["model." + key.removeprefix("param.")] = value
        else:
            out["optim." + key] = value
    for name, t in _other_tensors(model).items():
        out[f"buffers.{name}"] = t
    return out


def _other_tensors(model: DataParallel) -> dict[str, torch.Tensor]:
    """The module's state that aligndp does not train (buffers, frozen params), as detached aliases.

    A trained param reachable under a second name (tied weights) is saved once, as ``model.<name>``.
    """
    trained = {id(p) for p in model.param_names}
    return {n: t.detach() for n, t in model.module.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and id(t) not in trained}


def save(path: str | os.PathLike, model: DataParallel, optimizer=None, *, step: int = 0) -> None:
    """Write a reshardable checkpoint of ``model`` (and ``optimizer``) at ``path``, atomically."""
    path = os.fspath(path)
    group = model.process_group
    view = _view(model, optimizer)
    partial = path + ".partial"
    if dist.get_rank(group) == 0 and os.path.exists(partial):
        shutil.rmtree(partial)  # left by a save that failed
    dist.barrier(group=group)
    state = _to_dcp(_entries(model, view), group)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=group)
    except CheckpointException as e:  # a BaseException: `except Exception` in user code would miss it
        raise RuntimeError(f"saving checkpoint {path!r} failed on ranks {sorted(e.failures)}; the previous "
                           f"checkpoint there (if any) is intact: {e}") from e
    if dist.get_rank(group) == 0:
        meta = {"format": FORMAT, "step": int(step), "dp_size": dist.get_world_size(group),
                "shapes": {n: list(p.shape) for n, p in _named(model)}}
        with open(os.path.join(partial, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)  # only a save that died between the renames leaves one
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=group)


def _named(model: DataParallel) -> list[tuple[str, torch.nn.Parameter]]:
    return [(model.param_names[p], p) for p in model.param_names]


def _check_shapes(path: str, saved: dict[str, list[int]], model: DataParallel) -> None:
    have = {n: list(p.shape) for n, p in _named(model)}
    missing = sorted(set(have) - set(saved))
    unexpected = sorted(set(saved) - set(have))
    mismatched = [f"{n}: checkpoint {saved[n]} vs model {have[n]}" for n in sorted(set(have) & set(saved))
                  if saved[n] != have[n]]
    if missing or unexpected or mismatched:
        raise ValueError(
            f"checkpoint {path!r} does not fit this model: missing (in the model, not the checkpoint) {missing}; "
            f"unexpected (in the checkpoint, not the model) {unexpected}; shape mismatches {mismatched}. "
            "Load it into the model that wrote it"
        )


def _templates(model: DataParallel, view, metadata) -> dict[str, object]:
    """Zeroed entries cut to this rank's current ownership, for every saved key we read."""
    numels = {n: p.numel() for n, p in _named(model)}
    out: dict[str, object] = {}
    for key, md in metadata.items():
        if key.startswith("model.") or key.startswith("optim.state."):
            if key.startswith("model."):
                name = key.removeprefix("model.")
            else:
                name = key.removeprefix("optim.state.").rsplit(".", 1)[0]
            lo, hi = view.owned_range(name)
            if hi <= lo:
                continue
            size = tuple(md.size)
            if size == (numels[name],):
                out[key] = FlatPiece(torch.zeros(hi - lo, dtype=md.properties.dtype, device=model.device), lo, size[0])
            else:
                out[key] = torch.zeros(size, dtype=md.properties.dtype)
        elif key == "optim.param_groups":
            out[key] = ParamGroups([])
    for name, t in _other_tensors(model).items():
        if f"buffers.{name}" in metadata:
            out[f"buffers.{name}"] = t
    return out


def load(path: str | os.PathLike, model: DataParallel, optimizer=None) -> int:
    """Load a checkpoint written by :func:`save` at any dp size and bucket size; returns its step."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, META_FILE)) and os.path.exists(os.path.join(path + ".old", META_FILE)):
        path += ".old"  # a save died between its two renames
    try:
        with open(os.path.join(path, META_FILE)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"no aligndp checkpoint at {path!r} ({META_FILE} is missing): pass the path given to save()") from None
    _check_shapes(path, meta["shapes"], model)
    group = model.process_group
    view = _view(model, optimizer)
    if hasattr(view, "gather"):
        view.gather.wait_all()
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    entries = _templates(model, view, metadata)
    state = _to_dcp(entries, group)
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=group)
    except CheckpointException as e:
        raise RuntimeError(f"loading checkpoint {path!r} failed on ranks {sorted(e.failures)}: {e}") from e
    sd: dict[str, object] = {}
    for key, value in entries.items():
        if key.startswith("model."):
            sd["param." + key.removeprefix("model.")] = value
        elif key.startswith("optim."):
            sd[key.removeprefix("optim.")] = state[key].groups if key == "optim.param_groups" else value
    if optimizer is None:
        sd.pop("param_groups", None)
    view.load_model_space_state_dict(sd)
    return int(meta["step"])
