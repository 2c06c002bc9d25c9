"""FlatBuffer: views at layout offsets, real pointer alignment, param values preserved."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aligndp.plan.layout import plan_layout
from aligndp.plan.spec import Mode, ParamSpec, Requirement
from aligndp.runtime.buffer import FlatBuffer, aligned_empty

ODD_SHAPES = [(97,), (103, 5), (7, 13), (1,), (300,), (33, 3)]
MXFP8 = Requirement("MXFP8 wgrad", start_elements=64)


def params_of(shapes, dtype):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize(
    "dtype,grad_dtype,align_bytes",
    [
        (torch.bfloat16, torch.bfloat16, 128),
        (torch.float32, torch.float32, 256),
        (torch.bfloat16, torch.float32, 256),
    ],
)
def test_regression_layerwise_mxfp8_main_grad_pointers_aligned(
    mode, dtype, grad_dtype, align_bytes
):
    """Regression for the bug this project exists for.

    Megatron-LM's layer-wise optimizer path packed params back to back; a param's main_grad
    view then started at an element offset that was not a multiple of 64, and cuBLASLt refused
    the MXFP8 wgrad GEMM (CUBLAS_STATUS_NOT_SUPPORTED) on the first step. Here every mode,
    layer-wise included, with sizes that are not multiples of 64 and the user asking for no
    alignment at all, must still give 64-element starts and 128 B (bf16) / 256 B (fp32)
    aligned main_grad addresses — base pointer included.
    """
    shapes = ODD_SHAPES
    specs = [ParamSpec(f"p{i}", s, dtype) for i, s in enumerate(shapes)]
    layout = plan_layout(
        specs,
        dp_size=3,
        mode=mode,
        bucket_numel=400,
        requirements=[MXFP8],
        start_alignment=1,
        grad_dtype=grad_dtype,
    )
    params = params_of(shapes, dtype)
    values = [p.detach().clone() for p in params]
    buf = FlatBuffer(layout, params, with_param_data=mode is not Mode.REPLICATED)
    for p, v, s in zip(params, values, buf.slots):
        assert s.start % 64 == 0
        assert p.main_grad.data_ptr() % align_bytes == 0
        assert p.main_grad.data_ptr() - buf.grad_data.data_ptr() == s.start * grad_dtype.itemsize
        assert p.main_grad.shape == p.shape and p.main_grad.dtype == grad_dtype
        assert torch.equal(p.detach(), v), "param values must survive rebinding"
        if buf.param_data is not None:
            assert p.data_ptr() - buf.param_data.data_ptr() == s.start * dtype.itemsize
            assert p.data_ptr() % (64 * dtype.itemsize) == 0


def test_views_alias_the_buffer_and_padding_stays_zero():
    specs = [ParamSpec(f"p{i}", s) for i, s in enumerate(ODD_SHAPES)]
    layout = plan_layout(specs, bucket_numel=200)
    params = params_of(ODD_SHAPES, torch.float32)
    buf = FlatBuffer(layout, params)
    for p in params:
        p.main_grad.fill_(1.0)
    assert buf.grad_data.sum().item() == layout.numel
    buf.zero_grad()
    assert buf.grad_data.abs().sum().item() == 0


def test_hand_made_misaligned_layout_is_refused_naming_the_param():
    specs = [ParamSpec("a", (97,)), ParamSpec("blocks.0.fc.weight", (103,))]
    layout = plan_layout(specs)
    slot = layout.param("a")
    shifted = dataclasses.replace(slot, start=slot.start + 10, end=slot.end + 10)
    broken = dataclasses.replace(
        layout, params=tuple(shifted if p.name == "a" else p for p in layout.params)
    )
    with pytest.raises(ValueError, match=r"param 'a' starts at element 138 \(552 B"):
        FlatBuffer(broken, params_of([(97,), (103,)], torch.float32))


def test_aligned_empty_beats_the_allocator_alignment():
    for align in (128, 256, 512, 4096):
        for n in (1, 63, 1000):
            t = aligned_empty(n, dtype=torch.float32, device=torch.device("cpu"), align_bytes=align)
            assert t.numel() == n and t.data_ptr() % align == 0 and t.abs().sum() == 0


def test_shape_or_dtype_mismatch_is_refused():
    layout = plan_layout([ParamSpec("a", (4, 4))])
    with pytest.raises(ValueError, match="plan the layout from this module"):
        FlatBuffer(layout, [torch.nn.Parameter(torch.zeros(4, 5))])
    with pytest.raises(ValueError, match="plan the layout from this module"):
        FlatBuffer(layout, [torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))])


class OffsetAllocator:
    """Hands out storage one element past an aligned address (a broken allocation hook)."""

    name = "offset"

    def allocate(self, numel, *, dtype, device, align_bytes):
        return aligned_empty(numel + 1, dtype=dtype, device=device, align_bytes=align_bytes)[1:]


def test_an_allocator_that_breaks_the_alignment_is_refused_naming_it():
    """[Note: alignment contract] holds whatever allocates the storage: the buffer checks the
    real address the hook returned (fp32 with 64-element starts: 256 B; one element off: 4 B)."""
    layout = plan_layout([ParamSpec("a", (97,)), ParamSpec("b", (5,))])
    with pytest.raises(
        ValueError,
        match=r"backend 'offset' allocated a buffer at address 0x[0-9a-f]+, 4 B past a "
        r"256-byte boundary",
    ):
        FlatBuffer(layout, params_of([(97,), (5,)], torch.float32), allocator=OffsetAllocator())
