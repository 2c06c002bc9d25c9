"""The training loop of ``aligndp train``: one rank's view of the job.

Each rank builds the same model (same seed), wraps it with :func:`aligndp.parallelize`, and
reads its own rows of every global batch (see [Note: batches are functions of (seed, step)]
in ``data.py``). The logged loss is the mean over all ranks and micro-batches, i.e. the loss
of the global batch, so it does not depend on how many ranks share the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

import aligndp
from aligndp.app.data import BatchSpec, TokenData
from aligndp.app.metric_sinks import MetricSinks
from aligndp.app.run_checkpoints import StopRequest, checkpoint_dir, resume_point
from aligndp.app.schedule import warmup_cosine
from aligndp.app.train_config import TrainConfig, compiles, describe_mesh
from aligndp.app.train_report import (
    MetricsLog,
    Progress,
    Summary,
    finish_report,
    params_hash,
    peak_memory_bytes,
)
from aligndp.lowp.recipe import Recipe
from aligndp.models.gpt import GPT, PRESETS
from aligndp.state.checkpoint import prune_checkpoints

__all__ = [
    "train_worker",
    "launched_worker",
    "load_data",
    "wgrad_backend",
    "EVAL_BATCHES",
]

EVAL_BATCHES = 4
"""Global batches of the held-out split in one evaluation (the same ones every time)."""


def load_data(config: TrainConfig) -> TokenData:
    return TokenData.from_file(config.data) if config.data else TokenData.synthetic()


def wgrad_backend(config: TrainConfig) -> str | None:
    """The GEMM backend that runs ``--wgrad`` on ``--device``: the registered recipe's default
    there (mxfp8: the reference backend on CPU, Triton kernels on CUDA); None for a recipe
    that converts no layer (``none``)."""
    from aligndp.lowp.recipes import get_recipe, recipe_names

    recipe = get_recipe(config.wgrad)
    if not recipe.backends:
        return None
    backend = recipe.default_backend(config.device)
    if backend is None:
        devices = sorted({d for b in recipe.backends for d in b.devices})
        others = [n for n in recipe_names() if get_recipe(n).default_backend(config.device)]
        instead = f", or --wgrad {' or '.join(others)} (which runs on {config.device})"
        raise ValueError(
            f"--wgrad {recipe.name} runs {recipe.runs}; use --device {' or '.join(devices)}"
            + (instead if others else "")
        )
    return backend.name


def _device(config: TrainConfig) -> torch.device:
    if config.device == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def launched_worker(config: TrainConfig, recipe: Recipe | None = None) -> dict:
    """Entry point of a rank started by the elastic launcher: one thread per rank's share of cores.

    ``recipe``: the ``--wgrad`` recipe as the launching process has it, registered here when
    this fresh interpreter does not know it (one registered at runtime by the caller).
    Ctrl-C reaches every rank too: a rank leaves quietly with status 130 and the launching
    process prints the one line.
    """
    from aligndp.lowp.recipes import recipe_names, register_recipe

    if recipe is not None and recipe.name not in recipe_names():
        register_recipe(recipe)
    if config.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.nproc))
    try:
        return train_worker(config)
    except KeyboardInterrupt:
        sys.stdout.flush()
        os._exit(130)


def train_worker(config: TrainConfig) -> dict:
    """Train on the default process group, starting one from the environment (torchrun, the
    launcher) or, for a single rank, in this process, when none exists yet."""
    owns_group = not dist.is_initialized()
    if owns_group:
        backend = "nccl" if config.device == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=config.timeout)  # not torch's 10/30 minutes: --timeout
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    try:
        return _train(config)
    finally:
        if owns_group:
            dist.destroy_process_group()


@dataclasses.dataclass
class _Job:
    """What one rank holds while it trains."""

    config: TrainConfig
    model: torch.nn.Module
    optimizer: object
    data: TokenData
    spec: BatchSpec
    device: torch.device
    rank: int
    dp_size: int
    peak_lrs: list[float]
    """Each optimizer param group's lr as built (see schedule.warmup_cosine)."""
    forward: Callable
    """``model``, or ``torch.compile(model)`` (TrainConfig.compile): what batches go through."""

    @property
    def replicas(self) -> int:
        """Replicas as the model built its groups: the world over its shard group's size."""
        return self.dp_size // self.model.dp_size

    def autocast(self):
        if self.config.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def global_mean(self, value: torch.Tensor, *, stop: bool = False) -> tuple[float, bool]:
        """Mean of a scalar over all ranks, and whether any rank asked to stop (Ctrl-C: see
        run_checkpoints.StopRequest), in one all-reduce."""
        both = torch.stack([value.detach().float().reshape(()).cpu(), torch.tensor(float(stop))])
        both = both.to(self.device)
        dist.all_reduce(both)
        return both[0].item() / self.dp_size, bool(both[1].item() > 0)


def replica_mesh(replicas: int, device: torch.device) -> object | None:
    """--replicas R: the (R, world / R) mesh, row-major, so a replica is consecutive ranks (one
    node under torchrun); one replica passes no mesh, so the flat path stays as it was."""
    return aligndp.replica_mesh(replicas, device.type) if replicas > 1 else None


def _setup(config: TrainConfig) -> _Job:
    rank, dp_size = dist.get_rank(), dist.get_world_size()
    device = _device(config)
    model_cfg = PRESETS[config.preset]
    data = load_data(config)
    data.check(seq_len=model_cfg.seq_len, vocab_size=model_cfg.vocab_size)
    spec = BatchSpec(config.batch_size, model_cfg.seq_len, dp_size, config.micro_batches)
    torch.manual_seed(config.seed)
    module = GPT(model_cfg).to(device)
    backend = wgrad_backend(config)
    if backend is not None:
        from aligndp.lowp import convert_to_mxfp8
        from aligndp.lowp.layer_rule import describe_plan
        from aligndp.lowp.linear import conversion_plan

        with warnings.catch_warnings():  # the no-fast-path warning: rank 0's only
            if rank:
                warnings.simplefilter("ignore")
            plan = conversion_plan(module, config.wgrad, layers=config.wgrad_layers)
            convert_to_mxfp8(module, backend=backend, layers=config.wgrad_layers)
        if rank == 0:
            print(describe_plan(config.wgrad, plan), flush=True)
    mesh = replica_mesh(config.replicas, device)
    model, optimizer = aligndp.parallelize(
        module,
        optimizer=config.optimizer,
        sharding=config.sharding,
        lr=config.lr,
        wgrad=config.wgrad,
        fp8_param_gather=config.fp8_param_gather,
        mesh=mesh,
    )
    # the wrapper is compiled for the forward calls only: no_sync, checkpoints and the
    # optimizer keep the DataParallel itself (its state-dict keys have no _orig_mod prefix)
    forward = torch.compile(model) if compiles(config) else model
    peak_lrs = [group["lr"] for group in getattr(optimizer, "param_groups", ())]
    return _Job(config, model, optimizer, data, spec, device, rank, dp_size, peak_lrs, forward)


def _train_step(job: _Job, step: int, stop: StopRequest) -> tuple[float, bool]:
    """One optimizer step on global batch ``step``; returns the global batch's mean loss and
    whether any rank was asked to stop."""
    micro_batches = job.spec.micro_batches
    loss_sum = torch.zeros((), device=job.device)
    for micro_batch in range(micro_batches):
        x, y = job.data.batch(
            step, job.spec, seed=job.config.seed, rank=job.rank, micro_batch=micro_batch
        )
        last = micro_batch == micro_batches - 1
        with contextlib.nullcontext() if last else job.model.no_sync():
            with job.autocast():
                loss = job.forward(x.to(job.device), y.to(job.device))
            (loss / micro_batches).backward()
        loss_sum += loss.detach()
    job.optimizer.step()
    job.optimizer.zero_grad()
    return job.global_mean(loss_sum / micro_batches, stop=stop.requested)


@torch.no_grad()
def _evaluate(job: _Job) -> float:
    """Mean loss over the first :data:`EVAL_BATCHES` global batches of the held-out split."""
    spec = dataclasses.replace(job.spec, micro_batches=1)
    total = torch.zeros((), device=job.device)
    for index in range(EVAL_BATCHES):
        x, y = job.data.batch(index, spec, seed=0, rank=job.rank, split="eval")
        with job.autocast():
            total += job.forward(x.to(job.device), y.to(job.device)).float()
    return job.global_mean(total / EVAL_BATCHES)[0]


def _checkpoint(job: _Job, step: int) -> str:
    path = checkpoint_dir(job.config.checkpoint_path, step)
    aligndp.save(path, job.model, job.optimizer, step=step, timeout=job.config.timeout)
    if job.config.keep_last and job.rank == 0:
        prune_checkpoints(job.config.checkpoint_path, job.config.keep_last)
    return path


def _train(config: TrainConfig) -> dict:
    wall_started = time.perf_counter()
    try:
        job = _setup(config)
        start_step = 0
        if config.resume:
            start_step = aligndp.load(
                resume_point(config), job.model, job.optimizer, timeout=config.timeout
            )
    except NotImplementedError as e:
        # Raised alike on every rank (it depends on the options only): one line, exit 2.
        return {"error": f"not implemented yet: {e}"}
    except (ValueError, TypeError) as e:
        return {"error": str(e)}
    if job.rank == 0:
        os.makedirs(config.out, exist_ok=True)
        _print_header(job, start_step)
    scheduler = warmup_cosine(
        job.optimizer, steps=config.steps, peak_lrs=job.peak_lrs, start_step=start_step
    )
    metrics = MetricsLog(
        os.path.join(config.out, "metrics.jsonl"),
        start_step=start_step,
        enabled=job.rank == 0,
        sinks=MetricSinks(config, enabled=job.rank == 0),
    )
    tokens_per_step = config.batch_size * job.spec.seq_len
    progress = Progress(total=config.steps, initial=start_step, enabled=job.rank == 0)
    timed_tokens, timed_seconds = 0, 0.0
    # a run resumed from its last checkpoint has no step left: report what metrics.jsonl holds
    train_loss = metrics.records[-1]["loss"] if metrics.records else None
    eval_loss = next((r["eval_loss"] for r in reversed(metrics.records) if "eval_loss" in r), None)
    saved = resume_point(config) if config.resume else None  # the newest checkpoint
    with StopRequest() if config.final_checkpoint else contextlib.nullcontext() as stop:
        stop = stop or StopRequest()
        for step in range(start_step, config.steps):
            lr = scheduler.get_last_lr()[0]
            started = time.perf_counter()
            train_loss, stopping = _train_step(job, step, stop)
            scheduler.step()
            seconds = time.perf_counter() - started
            if step > start_step:  # the first step pays for warm-up; leave it out of the rate
                timed_tokens += tokens_per_step
                timed_seconds += seconds
            record = {
                "step": step,
                "loss": train_loss,
                "lr": lr,
                "tokens_per_s": tokens_per_step / seconds,
                "step_s": seconds,
            }
            done = step + 1
            if (config.eval_every and done % config.eval_every == 0) or done == config.steps:
                eval_loss = record["eval_loss"] = _evaluate(job)
            final = done == config.steps or stopping
            if (config.checkpoint_every and done % config.checkpoint_every == 0) or (
                final and config.final_checkpoint
            ):
                try:
                    saved = _checkpoint(job, done)
                except (ValueError, OSError) as e:  # alike on every rank: [Note: checkpoint safety]
                    progress.close()
                    metrics.close()
                    return {"error": str(e)}
            metrics.write(record)
            progress.update(record)
            if stopping:
                progress.close()
                metrics.close()
                if job.rank == 0:
                    print(
                        f"stopped after step {done}: saved {saved} (--resume goes on)", flush=True
                    )
                raise KeyboardInterrupt
    progress.close()
    metrics.close()
    in_sync = _replicas_in_sync(job)
    summary = Summary(
        steps=config.steps,
        start_step=start_step,
        dp_size=job.dp_size,
        replicas=job.replicas,
        vocab_size=PRESETS[config.preset].vocab_size,
        train_loss=train_loss,
        eval_loss=eval_loss,
        first_loss=metrics.first_loss,
        tokens_per_s=timed_tokens / timed_seconds if timed_seconds else None,
        replicas_in_sync=in_sync,
        peak_memory_bytes=_max_over_ranks(job, peak_memory_bytes(job.device)),
        wall_s=time.perf_counter() - wall_started,
        checkpoint=saved,
    )
    return finish_report(summary, job.model, out=config.out, metrics=metrics, enabled=job.rank == 0)


def _print_header(job: _Job, start_step: int) -> None:
    config, cfg = job.config, PRESETS[job.config.preset]
    numel = sum(p.numel() for p in job.model.module.parameters())
    backend = dist.get_backend()
    resumed = f", resuming at step {start_step}" if start_step else ""
    print(
        f"aligndp train: preset {config.preset} ({numel:,} params) on {job.dp_size} {backend} "
        f"rank(s){describe_mesh(job.replicas, job.dp_size)}, {config.optimizer}, sharding "
        f"{config.sharding}; global batch "
        f"{config.batch_size} x {cfg.seq_len} tokens in {config.micro_batches} micro-batch(es); "
        f"data: {job.data.name} ({len(job.data):,} tokens); {config.steps} steps{resumed}",
        flush=True,
    )


def _max_over_ranks(job: _Job, value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=job.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def _replicas_in_sync(job: _Job) -> bool:
    """Whether every rank holds bit-identical params (one hash per rank, all-gathered)."""
    mine = torch.tensor([params_hash(job.model.module)], dtype=torch.int64, device=job.device)
    hashes = [torch.zeros_like(mine) for _ in range(job.dp_size)]
    dist.all_gather(hashes, mine)
    return len({int(h.item()) for h in hashes}) == 1
