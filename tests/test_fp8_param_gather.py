"""FP8 param all-gather ([Note: FP8 param gather] in aligndp/runtime/gather_codec.py).

The reference is one process training the same net with torch's own optimizers, its converted
layers running the same ``fp8-tensor`` recipe: each forward quantises the full-precision
weight itself (``max|w| / 448`` over the whole tensor), which is exactly what the gathered FP8
bytes and scale must be, so params, masters and losses agree bit for bit:

- the reduced gradient is exact: at dp 2 each rank's gradient is halved (exact) and the two
  halves are added once (one rounding, the same in any order); at dp 3 every rank trains on
  the same micro-batch, so the three thirds are equal and their sum does not depend on the
  order either;
- the optimizer update is elementwise (AdamW) or whole-matrix on one owner (Muon), the same
  torch arithmetic on the same values; dims are multiples of 64, so every owned piece starts
  and ends where the whole tensor's vectorised loops would (no scalar tail elsewhere);
- the by-hand quantisation below gives the bytes and scale the gather must deliver.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import aligndp
from aligndp.lowp import convert_to_mxfp8, recipe_fp8_tensor
from aligndp.lowp.recipe_fp8_tensor import AMAX_FLOOR, E4M3_MAX
from tests._dist import case, make_tests
from tests.models import ckpt

DIM, HIDDEN, CLASSES, TOKENS = 64, 128, 16, 32
LR = 1e-2
STEPS = 3
CONVERTED = ("fc1.weight", "fc2.weight")
"""The weights of the converted layers (the head, the last Linear, stays nn.Linear)."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))


def make_net(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return convert_to_mxfp8(Net().to(dtype), backend="fp8-tensor", layers="all")


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, DIM, generator=g), torch.randint(0, CLASSES, (TOKENS,), generator=g)


def data_rank(rank: int, ws: int) -> int:
    """Whose micro-batch rank trains on: its own at dp 2, rank 0's at dp 3 (see the docstring)."""
    return rank if ws == 2 else 0


def by_hand(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor E4M3 of ``w``, written out: ``(bytes, scale)``."""
    scale = w.float().abs().max().clamp(min=AMAX_FLOOR) / E4M3_MAX
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def wrap(optimizer: str, **kwargs):
    return aligndp.parallelize(
        make_net(kwargs.pop("dtype", torch.float32)),
        optimizer=optimizer,
        sharding="zero1",
        wgrad="fp8-tensor",
        fp8_param_gather=kwargs.pop("fp8_param_gather", True),
        lr=LR,
        **kwargs,
    )


def reference_optimizers(net: nn.Module, optimizer: str, routing) -> list[torch.optim.Optimizer]:
    named = dict(net.named_parameters())
    if optimizer == "adamw":
        return [torch.optim.AdamW(net.parameters(), lr=LR)]
    return [
        torch.optim.Muon([named[n] for n in routing.whole], lr=LR, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW([named[n] for n in routing.adamw], lr=LR),
    ]


def masters(opt, names) -> dict[str, torch.Tensor]:
    """Every param's full-precision value (flat), assembled from every rank's owned pieces."""
    sd = opt.model_space_state_dict()
    mine = {n: sd[f"param.{n}"] for n in names if f"param.{n}" in sd}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, mine)
    full = {}
    for name in names:
        pieces = [g[name] for g in gathered if name in g]
        flat = torch.full((pieces[0].numel,), float("nan"))
        for piece in pieces:
            flat[piece.offset : piece.offset + piece.tensor.numel()] = piece.tensor
        full[name] = flat
    return full


def check_gathered(model, ref: nn.Module, what: str) -> None:
    """Each converted weight's layer holds the by-hand FP8 bytes and scale of the reference's
    weight, and the param shows their decoded value; every other param the reference's value."""
    params = dict(model.module.named_parameters())
    for n, p in ref.named_parameters():
        if n not in CONVERTED:  # gathered as it is
            assert torch.equal(params[n].detach(), p.detach()), f"{what}: {n}"
            continue
        data, scale = by_hand(p.detach())
        layer = model.module.get_submodule(n.removesuffix(".weight"))
        with counting_weight_quantises(model) as calls:
            operand = layer.quantised_weight()  # the gathered one: nothing is quantised
        assert not calls, f"{what}: {n} was quantised again instead of taken as gathered"
        assert torch.equal(operand.scale, scale), f"{what}: scale of {n}"
        assert torch.equal(operand.data.view(torch.uint8), data.view(torch.uint8)), f"{what}: {n}"
        assert torch.equal(  # the dgrad GEMM's operand
            operand.data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8)
        ), f"{what}: transposed {n}"
        assert torch.equal(params[n].detach(), data.float() * scale), f"{what}: decoded {n}"


@contextlib.contextmanager
def counting_weight_quantises(model):
    """The shapes of the converted weights quantised inside (a gathered weight needs none)."""
    shapes = {tuple(model.module.get_parameter(n).shape) for n in CONVERTED}
    calls = []
    original = recipe_fp8_tensor.quantize_tensor

    def counting(t, **kwargs):
        if tuple(t.shape) in shapes:
            calls.append(tuple(t.shape))
        return original(t, **kwargs)

    recipe_fp8_tensor.quantize_tensor = counting
    try:
        yield calls
    finally:
        recipe_fp8_tensor.quantize_tensor = original


def weight_quantises(model, x) -> int:
    """How many weights a forward quantises."""
    with counting_weight_quantises(model) as calls, torch.no_grad():
        model(x)
    return len(calls)


def check_equals_one_process(rank: int, ws: int, optimizer: str, **kwargs) -> None:
    model, opt = wrap(optimizer, **kwargs)
    ref = make_net()
    ref_opts = reference_optimizers(ref, optimizer, opt.routing)
    names = [n for n, _ in ref.named_parameters()]
    check_gathered(model, ref, "after parallelize")  # the first forward reads gathered weights
    for step in range(STEPS):
        x, y = batch(data_rank(rank, ws), step)
        loss = F.cross_entropy(model(x), y)
        grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        for r in range(ws):
            ref_x, ref_y = batch(data_rank(r, ws), step)
            ref_loss = F.cross_entropy(ref(ref_x), ref_y)
            ref_loss.backward()
            for n, p in ref.named_parameters():
                grads[n] += p.grad / ws
                p.grad = None
            if r == rank:
                assert torch.equal(loss, ref_loss), f"step {step}: loss {loss} != {ref_loss}"
        for n, p in ref.named_parameters():
            p.grad = grads[n]
        loss.backward()
        # the reference steps first: any torch.optim step drops the layers' quantised-weight
        # caches ([Note: weights once per step]), the gathered bytes included
        for o in ref_opts:
            o.step()
            o.zero_grad()
        opt.step()
        opt.zero_grad()
        mine = masters(opt, names)
        for n, p in ref.named_parameters():
            assert torch.equal(mine[n], p.detach().flatten()), f"step {step}: master of {n}"
        check_gathered(model, ref, f"step {step}")
        assert weight_quantises(model, x) == 0, f"step {step}: a gathered weight was quantised"
        # a read through .data (an EMA would do it) marks the param for a master refresh: the
        # masters keep their values, since the param still holds what the gather wrote
        model.module.fc1.weight.data.abs().max()
    with torch.no_grad():  # a user's write moves the version: the layer quantises it again
        model.module.fc2.weight.mul_(1.0)
    assert weight_quantises(model, x) == 1


@case(2, 3)
def case_adamw_equals_one_process(rank, ws):
    check_equals_one_process(rank, ws, "adamw", bucket_numel=6000)


@case(2, 3)
def case_muon_equals_one_process(rank, ws):
    check_equals_one_process(rank, ws, "muon")


@case(2)
def case_overlapped_gather_equals_one_process(rank, ws):
    """Gathers left in flight after the step (decoded when a forward pre-hook or a read waits);
    layer-wise Muon with a bucket per matrix, each gather started as soon as it is stepped."""
    check_equals_one_process(rank, ws, "adamw", bucket_numel=6000, overlap_param_gather=True)
    check_equals_one_process(rank, ws, "muon", bucket_numel=6000, overlap_param_gather=True)


def gather_bytes(model, opt, x, y) -> dict[torch.dtype, int]:
    """Bytes each rank's all-gathers move in one step, by dtype (float32: the amaxes)."""
    moved: dict[torch.dtype, int] = {}
    collectives = model.param_gather.collectives
    original = collectives.all_gather_shards

    def counting(bucket):
        moved[bucket.dtype] = moved.get(bucket.dtype, 0) + bucket.numel() * bucket.element_size()
        return original(bucket)

    collectives.all_gather_shards = counting
    try:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    finally:
        del collectives.all_gather_shards
    return moved


@case(2, 3)
def case_gather_moves_one_byte_per_converted_element(rank, ws):
    """bf16 params: the converted weights' buckets move 1 byte per planned element (uint8)
    plus one float32 amax per weight and rank — half the 2 bytes per element of a bf16
    gather, up to those scales; the other params' buckets move bf16, as every bucket does
    without the flag."""
    x, y = batch(rank, 0)
    x = x.bfloat16()
    fp8_model, fp8_opt = wrap("adamw", dtype=torch.bfloat16, bucket_numel=6000)
    plain_model, plain_opt = wrap("adamw", dtype=torch.bfloat16, fp8_param_gather=False)
    fp8, plain = gather_bytes(fp8_model, fp8_opt, x, y), gather_bytes(plain_model, plain_opt, x, y)
    coded = [b.layout for b in fp8_model.flat_buffers if b.gather_data is not None]
    other = [b.layout for b in fp8_model.flat_buffers if b.gather_data is None]
    assert {p for lo in coded for p in (s.name for s in lo.params)} == set(CONVERTED)
    weights = sum(len(lo.params_in_bucket(b.index)) for lo in coded for b in lo.buckets)
    assert fp8[torch.uint8] == sum(lo.padded_numel for lo in coded)
    assert fp8[torch.float32] == 4 * ws * weights
    assert fp8[torch.bfloat16] == 2 * sum(lo.padded_numel for lo in other)
    assert plain == {
        torch.bfloat16: 2 * sum(b.layout.padded_numel for b in plain_model.flat_buffers)
    }


@case(2)
def case_checkpoint_saves_fp32_masters(rank, ws):
    """Train, save: the checkpoint holds the fp32 masters, not the decoded FP8 values."""
    model, opt = wrap("adamw", bucket_numel=6000)
    for step in range(2):
        F.cross_entropy(model(batch(rank, step)[0]), batch(rank, step)[1]).backward()
        opt.step()
        opt.zero_grad()
    aligndp.save(ckpt("fp8-gather"), model, opt, step=2)
    full = masters(opt, [n for n, _ in model.module.named_parameters()])
    for n in CONVERTED:  # the masters are not what the params show
        assert not torch.equal(full[n], model.module.get_parameter(n).detach().flatten()), n
    if rank == 0:
        torch.save(full, ckpt("fp8-gather-masters.pt"))


@case(3, after=(2,))
def case_checkpoint_loads_at_another_dp_size(rank, ws):
    """The dp 2 checkpoint loads at dp 3: the masters are the saved fp32 values, the params
    their gathered FP8 value; plain DCP reads the fp32 masters into a bare module."""
    saved = torch.load(ckpt("fp8-gather-masters.pt"))
    model, opt = wrap("adamw", bucket_numel=6000)
    assert aligndp.load(ckpt("fp8-gather"), model, opt) == 2
    loaded = masters(opt, list(saved))
    for n, values in saved.items():
        assert torch.equal(loaded[n], values), f"master of {n}"
    ref = make_net()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(saved[n].view(p.shape))
    check_gathered(model, ref, "after load at dp 3")
    if rank == 0:
        bare = Net()
        dcp.load({"model": bare.state_dict()}, checkpoint_id=ckpt("fp8-gather"), no_dist=True)
        for n, p in bare.named_parameters():
            assert torch.equal(p.detach().flatten(), saved[n]), f"plain DCP read of {n}"


def train_losses(fp8_param_gather: bool, device: str) -> tuple[list[torch.Tensor], nn.Module]:
    torch.manual_seed(0)
    net = convert_to_mxfp8(Net().to(device), backend="fp8-tensor", layers="all")
    model, opt = aligndp.parallelize(
        net, sharding="zero1", wgrad="fp8-tensor", fp8_param_gather=fp8_param_gather, lr=LR
    )
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(0, step))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, model.module


if torch.cuda.is_available():

    @case(1)
    def case_cuda_step_equals_the_full_precision_gather(rank, ws):
        """On the GPU (Triton quantise, cuBLASLt GEMMs on the gathered operand): fp32 params,
        so the operand equals what the layer's own quantise of the master gives, and losses
        and params agree with the run without the flag to the bit."""
        check_one_rank_equals_the_full_precision_gather("cuda")


def check_one_rank_equals_the_full_precision_gather(device: str) -> None:
    fp8_losses, fp8_net = train_losses(True, device)
    plain_losses, plain_net = train_losses(False, device)
    assert torch.equal(torch.stack(fp8_losses), torch.stack(plain_losses))
    for (n, a), b in zip(fp8_net.named_parameters(), plain_net.parameters()):
        if n in CONVERTED:  # the decoded value of the layer's own quantise of the master
            q = recipe_fp8_tensor.quantize_tensor(b.detach())
            assert torch.equal(a.detach(), q.data.float() * q.scale), n
        else:
            assert torch.equal(a, b), n


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(wgrad="fp8"), "needs wgrad='fp8-tensor'"),
        (dict(sharding="none"), "use sharding='zero1'"),
        (dict(master_weights=False), "leave master_weights at None or True"),
        (dict(fp8_param_gather="yes"), "takes True or False"),
    ],
)
def test_refused_combinations_name_the_alternative(kwargs, match):
    options = dict(sharding="zero1", wgrad="fp8-tensor", fp8_param_gather=True) | kwargs
    error = TypeError if kwargs.get("fp8_param_gather") == "yes" else ValueError
    with pytest.raises(error, match=match):
        aligndp.parallelize(make_net(), **options)


def test_a_model_without_fp8_tensor_layers_is_refused():
    with pytest.raises(ValueError, match="no trainable weight of the model is in a layer"):
        aligndp.parallelize(Net(), sharding="zero1", wgrad="fp8-tensor", fp8_param_gather=True)


def test_a_plan_with_fp8_gathers_needs_the_codec():
    from aligndp.parallelize import plan_request
    from aligndp.plan.request import plan_buffers
    from aligndp.runtime.gather_codec import check_codec

    request, _ = plan_request(
        make_net(), sharding="zero1", dp_size=2, wgrad="fp8-tensor", fp8_param_gather=True
    )
    layouts = plan_buffers(request)
    assert [lo.gather_dtype for lo in layouts] == [torch.float8_e4m3fn, None]
    with pytest.raises(ValueError, match="gather codec is missing"):
        check_codec(layouts, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the codec's Triton kernels")
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_equal_the_torch_ops(param_dtype):
    """[Note: one launch per bucket]: one encode and one decode launch over weights of odd
    shapes (tiles cut at the edges) and pieces of odd lengths and offsets give the bytes, the
    decoded values, the transposes and the scales of the torch ops a weight at a time."""
    from aligndp.lowp import fp8_gather_kernels as kernels

    g = torch.Generator().manual_seed(0)
    shapes = [(64, 128), (200, 72), (1, 3), (130, 64)]
    masters = [torch.randn(r * c, generator=g) * 10 ** (i - 2) for i, (r, c) in enumerate(shapes)]
    pieces = [m[lo:hi] for m, (lo, hi) in zip(masters, [(0, 8192), (37, 9001), (0, 3), (5, 6)])]
    # scales below the amax for two weights: their largest values saturate at 448
    scales = torch.stack([m.abs().max() / E4M3_MAX * f for m, f in zip(masters, (1, 0.5, 1, 0.25))])
    index = [0, 1, 2, 3]
    cuda = [p.cuda() for p in pieces]
    outs = [torch.zeros(p.numel(), dtype=torch.float8_e4m3fn, device="cuda") for p in pieces]
    kernels.encode(cuda, scales.cuda(), index, outs)
    for p, s, out in zip(pieces, scales, outs):
        want = recipe_fp8_tensor.cast_e4m3(p, s)
        assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))

    datas = [kernels_input(m, s, shape) for m, s, shape in zip(masters, scales, shapes)]
    values = [torch.zeros(shape, dtype=param_dtype, device="cuda") for shape in shapes]
    transposes = [
        torch.empty(shape[::-1], dtype=torch.float8_e4m3fn, device="cuda") for shape in shapes
    ]
    slots = torch.zeros(len(shapes) * kernels.SCALE_STRIDE, device="cuda")
    kernels.decode([d.cuda() for d in datas], scales.cuda(), values, transposes, slots)
    for i, (d, s) in enumerate(zip(datas, scales)):
        assert torch.equal(values[i].cpu(), torch.mul(d.float(), s).to(param_dtype)), shapes[i]
        assert torch.equal(
            transposes[i].cpu().view(torch.uint8), d.t().contiguous().view(torch.uint8)
        )
        assert slots[i * kernels.SCALE_STRIDE].item() == s.item()


def kernels_input(master: torch.Tensor, scale: torch.Tensor, shape) -> torch.Tensor:
    """The E4M3 bytes of ``master`` at ``scale``, in the weight's shape."""
    return recipe_fp8_tensor.cast_e4m3(master, scale).view(shape)


make_tests(globals())
