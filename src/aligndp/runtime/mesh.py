"""Data parallelism over a 2-D ``DeviceMesh``: replicas of a sharded job.

[Note: replicate x shard mesh]
``parallelize(model, mesh=m)`` takes a torch ``DeviceMesh`` over every rank of the job: 1-D is
today's flat group (the same as ``process_group=m.get_group()``); 2-D names its dims
``("replicate", "shard")`` (torchtitan's ``"dp_replicate"``/``"dp_shard"`` are accepted too,
in either order). The plan is made for the *shard* group: its size is the layout's
``dp_size``, owners are shard ranks, and every replica holds the same layout, so the alignment
contract and ``validate()`` are those of a flat job of that size. :class:`DataParallelGroups`
holds the three groups a job uses:

- ``world``, every rank: the flat all-reduce of replicated buffers, the end-of-backward
  agreement, ``join()``, the broadcasts from rank 0, the wrap-time checks and the
  checkpoints' barriers;
- ``shard``: reduce-scatter and all-gather of sharded and layer-wise buckets, and the global
  gradient norm (each shard group holds one copy of every owned piece, and replicas hold
  bit-identical shards, so every shard group computes the same norm);
- ``replicate``: the all-reduce of each owned shard across the replicas.

:class:`MeshCollectives` wraps the shard group's backend ([Note: collectives seam]) with these.
A sharded bucket's ``Work`` is a chain: the reduce-scatter in the shard group, then the
owned shard all-reduced across replicas. gloo has no streams, and a collective launched from
a completion callback could reach the replicate group in another order on another rank, so
the replica all-reduces are launched on the calling thread strictly in bucket order: each new
reduce-scatter first launches those whose reduce-scatter has completed, and waiting for a
chain launches every earlier one. (NCCL could start it at once on a side stream that waits
for the reduce-scatter's event; not built: there is no multi-GPU machine to measure it on.)
Under ``no_sync()`` nothing is launched, so the replica all-reduce runs once per step, after
the last micro-batch.

Means are over every rank: on NCCL ``AVG`` in both collectives (1/S, then 1/R); on gloo the
reduce-scatter pre-divides by S as today and the owned shard by R before its ``SUM``
all-reduce (one pass over a 1/S of the bucket). Replicated buffers use one flat all-reduce
over ``world``: a hierarchical RS(shard) + AR(replicate) + AG(shard) moves fewer bytes across
the slow links but only a multi-node measurement can say when it wins, and there is none.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.distributed as dist

from aligndp.runtime.collectives import Collectives, TorchCollectives, Work, shard_of

__all__ = [
    "REPLICATE_DIM_NAMES",
    "SHARD_DIM_NAMES",
    "DataParallelGroups",
    "MeshCollectives",
    "data_parallel_groups",
    "replica_mesh",
]

REPLICATE_DIM_NAMES = ("replicate", "dp_replicate")
"""Accepted names of a 2-D mesh's replicate dim."""
SHARD_DIM_NAMES = ("shard", "dp_shard")
"""Accepted names of a 2-D mesh's shard dim."""


@dataclasses.dataclass(frozen=True)
class DataParallelGroups:
    """The process groups of one data-parallel job ([Note: replicate x shard mesh])."""

    world: dist.ProcessGroup | None
    """Every rank of the job (None: the default group)."""
    shard: dist.ProcessGroup | None
    """The ranks that share out the optimizer (the plan's ``dp_size``); ``world`` when flat."""
    replicate: dist.ProcessGroup | None
    """The ranks holding this rank's shard; None when there is one replica."""
    replicas: int = 1
    """Size of the replicate group (1: flat)."""


def data_parallel_groups(
    process_group: dist.ProcessGroup | None, mesh: object | None
) -> DataParallelGroups:
    """The job's groups from ``parallelize``'s ``process_group=`` or ``mesh=``; a mesh that is
    not a 1-D or a named 2-D ``DeviceMesh`` over every rank is refused (ValueError/TypeError,
    the same on every rank: each sees the same mesh)."""
    if mesh is None:
        return DataParallelGroups(process_group, process_group, None)
    from torch.distributed.device_mesh import DeviceMesh

    if process_group is not None:
        raise ValueError("pass process_group= or mesh=, not both: a mesh carries its groups")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"mesh= takes a torch DeviceMesh (init_device_mesh), got {type(mesh).__name__}"
        )
    world = dist.get_world_size()
    ranks = sorted(mesh.mesh.flatten().tolist())
    if ranks != list(range(world)):
        raise ValueError(
            f"mesh= must hold every rank of the job once: a mesh of shape {tuple(mesh.shape)} "
            f"(ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''}) on a job of {world} ranks; "
            f"build it with init_device_mesh(device, (R, S), mesh_dim_names=('replicate', "
            f"'shard')) with R * S = {world}"
        )
    if mesh.ndim == 1:
        group = mesh.get_group()
        return DataParallelGroups(group, group, None)
    names = mesh.mesh_dim_names
    accepted = f"one of {REPLICATE_DIM_NAMES} and one of {SHARD_DIM_NAMES}"
    if mesh.ndim != 2:
        raise ValueError(
            f"mesh= must be 1-D (flat) or 2-D (replicate x shard), got {mesh.ndim} dims "
            f"{names}: build the data-parallel mesh alone, or pass its 2-D submesh"
        )
    rep = [n for n in names or () if n in REPLICATE_DIM_NAMES]
    shard = [n for n in names or () if n in SHARD_DIM_NAMES]
    if len(rep) != 1 or len(shard) != 1:
        raise ValueError(
            f"a 2-D mesh= needs named dims, {accepted}; got mesh_dim_names={names}: "
            "init_device_mesh(device, (R, S), mesh_dim_names=('replicate', 'shard'))"
        )
    replicas = mesh.size(list(names).index(rep[0]))
    replicate = mesh.get_group(rep[0]) if replicas > 1 else None
    return DataParallelGroups(None, mesh.get_group(shard[0]), replicate, replicas)


def replica_mesh(replicas: int, device_type: str = "cuda") -> object:
    """The ``(replicas, world / replicas)`` mesh over every rank, dims named
    ``("replicate", "shard")`` (what ``aligndp train --replicas R`` needs); a collective. A
    ``replicas`` that does not divide the number of ranks is refused on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    if world % replicas:
        raise ValueError(
            f"{replicas} replicas do not divide the {world} ranks: pick a divisor of {world} "
            f"(each replica shards over {world} / replicas ranks)"
        )
    shape = (replicas, world // replicas)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))


class _ReplicaChain:
    """The ``Work`` of a sharded bucket on a mesh: the shard group's reduce-scatter, then the
    owned shard's all-reduce across the replicas ([Note: replicate x shard mesh])."""

    def __init__(self, owner: MeshCollectives, first: Work, shard: torch.Tensor) -> None:
        self.owner, self.first, self.shard = owner, first, shard
        self.second: Work | None = None

    def first_done(self) -> bool:
        done = getattr(self.first, "is_completed", None)
        return bool(done()) if done is not None else False

    def launch(self) -> None:
        self.first.wait()
        self.second = self.owner.replica_all_reduce(self.shard)

    def wait(self) -> object:
        self.owner.launch_through(self)
        assert self.second is not None
        return self.second.wait()


class MeshCollectives:
    """``inner`` (the backend bound to the shard group) with the replicate group behind it:
    sharded buckets are all-reduced across replicas after their reduce-scatter, replicated
    buckets and the small sums go over every rank. Allocation, the all-gather and the
    norm's sum are ``inner``'s."""

    def __init__(self, inner: Collectives, groups: DataParallelGroups) -> None:
        self.inner, self.groups = inner, groups
        self.name, self.group = inner.name, inner.group
        self.rank, self.dp_size = inner.rank, inner.dp_size
        self.replicas = groups.replicas
        self._flat = TorchCollectives(groups.world)
        self._avg = dist.get_backend(groups.replicate) == "nccl"
        self._unlaunched: collections.deque[_ReplicaChain] = collections.deque()

    def allocate(self, numel: int, *, dtype, device, align_bytes: int) -> torch.Tensor:
        return self.inner.allocate(numel, dtype=dtype, device=device, align_bytes=align_bytes)

    def all_reduce_mean(self, bucket: torch.Tensor) -> Work:
        return self._flat.all_reduce_mean(bucket)

    def reduce_scatter_mean(self, bucket: torch.Tensor) -> Work:
        self._launch_completed()
        shard = shard_of(bucket, rank=self.rank, dp_size=self.dp_size)
        if self.dp_size == 1:  # an R x 1 mesh: nothing to scatter
            return self.replica_all_reduce(shard)
        chain = _ReplicaChain(self, self.inner.reduce_scatter_mean(bucket), shard)
        self._unlaunched.append(chain)
        return chain

    def replica_all_reduce(self, shard: torch.Tensor) -> Work:
        """Start averaging an owned shard (already averaged in its shard group) over the
        replicas."""
        if self._avg:
            op = dist.ReduceOp.AVG
        else:
            shard.div_(self.replicas)
            op = dist.ReduceOp.SUM
        return dist.all_reduce(shard, op=op, group=self.groups.replicate, async_op=True)

    def _launch_completed(self) -> None:
        while self._unlaunched and self._unlaunched[0].first_done():
            self._unlaunched.popleft().launch()

    def launch_through(self, chain: _ReplicaChain) -> None:
        """Launch the replica all-reduce of ``chain`` and of every chain before it, in order."""
        while chain.second is None:
            self._unlaunched.popleft().launch()

    def all_gather_shards(self, bucket: torch.Tensor) -> Work:
        return self.inner.all_gather_shards(bucket)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._flat.all_reduce_sum(tensor)

    def all_reduce_owned_sum(self, tensor: torch.Tensor) -> None:
        self.inner.all_reduce_owned_sum(tensor)
