"""The wgrad recipe seam: a recipe registered through the public API reaches every consumer.

[Note: wgrad recipes] in aligndp/lowp/recipe.py: a recipe is one frozen ``Recipe`` in the
registry, and ``parallelize(wgrad=)``, ``aligndp layout --wgrad``, the converter and the
backends' pointer checks read it from there. These tests register a recipe that exists only
here (a 256-element start requirement nothing else asks for, run by a reference backend defined
here and loaded by path) and check that each consumer plans for it, then that it is gone again.
"""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import aligndp
from aligndp.app import cli
from aligndp.app.layout_cli import add_arguments
from aligndp.lowp import (
    BackendRef,
    MXLinear,
    Recipe,
    ScaleFormat,
    convert_to_mxfp8,
    get_backend,
    get_recipe,
    recipe_names,
    register_recipe,
    registered_recipe,
)
from aligndp.lowp.backends import ReferenceBackend
from aligndp.plan.spec import Requirement
from aligndp.runtime.buffer import aligned_empty
from tests.models import assert_close, order_tolerance

FAKE_ALIGNMENT = 256  # elements; the defaults (64, 1) never produce it by chance below


class FakeBackend(ReferenceBackend):
    """The test recipe's backend, loaded by path as any recipe's is: the reference numerics,
    and a count of the fused wgrads it accumulated into ``main_grad`` views."""

    def __init__(self, recipe=None, *, name=None):
        super().__init__(recipe, name=name)
        self.fused_wgrads = 0

    def wgrad_into(self, grad_out, x, target):
        self.fused_wgrads += 1
        super().wgrad_into(grad_out, x, target)


def fake_recipe(name: str = "test-fake", backend: str = "fake-reference") -> Recipe:
    return Recipe(
        name=name,
        runs="a test-only recipe on the CPU reference backend",
        requirements=(Requirement("fake wgrad (test)", start_elements=FAKE_ALIGNMENT),),
        block=32,
        scale_format=ScaleFormat.E8M0,
        layer_dim_multiple=32,
        backends=(BackendRef(backend, f"{__name__}:FakeBackend", devices=("cpu",)),),
    )


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group for this module only (other modules start their own)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def fake():
    with registered_recipe(fake_recipe()) as recipe:
        yield recipe
    assert "test-fake" not in recipe_names()


def small_model() -> nn.Module:
    """Param sizes 35, 7, 21, 3 (reverse order in the buffer: 3, 21, 7, 35): with no
    requirement and start_alignment=1 they start at 0, 3, 24, 31."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))


def param_starts(model) -> list[int]:
    return [p.start for layout in model.layouts for p in layout.params]


def test_parallelize_plans_the_registered_requirement(group, fake):
    model, _ = aligndp.parallelize(small_model(), wgrad="test-fake", start_alignment=1)
    starts = param_starts(model)
    assert len(starts) == 4 and all(s % FAKE_ALIGNMENT == 0 for s in starts), starts
    assert all(layout.start_alignment == FAKE_ALIGNMENT for layout in model.layouts)
    for p in model.module.parameters():  # the real views, not only the plan
        assert p.main_grad.data_ptr() % (FAKE_ALIGNMENT * p.main_grad.element_size()) == 0
    # control: the same call without the recipe packs the params tighter, so the check above
    # could fail
    plain, _ = aligndp.parallelize(small_model(), wgrad="none", start_alignment=1)
    assert param_starts(plain) == [0, 3, 24, 31]


def test_converted_layers_carry_the_recipe_into_the_fused_wgrad(group, fake):
    """The converter picks the recipe's layers, the wrapper plans its requirement from the
    layers alone, and the fused wgrad (reference numerics: same block and scales as mxfp8)
    equals the mxfp8 reference backend's gradient in one process."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.Linear(64, 10))
    ours = convert_to_mxfp8(copy.deepcopy(base), backend="fake-reference", layers="all")
    ref = convert_to_mxfp8(copy.deepcopy(base), backend="reference", layers="all")
    assert [type(m) for m in ours] == [MXLinear, nn.GELU, MXLinear, nn.Linear]  # head kept
    backend = ours[0].backend
    assert type(backend) is FakeBackend and ours[2].backend is backend
    assert backend.recipe is fake and backend.name == "fake-reference"
    assert ours[0].wgrad_requirements() == list(fake.requirements)
    model, _ = aligndp.parallelize(ours, start_alignment=1)  # no wgrad=: the layers declare it
    assert all(s % FAKE_ALIGNMENT == 0 for s in param_starts(model))
    x = torch.randn(48, 64)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert backend.fused_wgrads == 2  # both converted layers wrote into their main_grad views
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        # the same quantised operands and GEMM; the fused one accumulates into a zeroed view:
        # the 48 token rows' sums in (at most) another order
        assert_close(p.grad, q.grad, name, order_tolerance(terms=48))
    # the backend's pointer check quotes the registered rule: a view 128 elements (512 B) past
    # a 1024 B aligned address meets mxfp8's 64-element rule but not this one
    storage = aligned_empty(
        FAKE_ALIGNMENT + 96 * 64, dtype=torch.float32, device=torch.device("cpu"), align_bytes=1024
    )
    misplaced = storage[FAKE_ALIGNMENT // 2 :][: 96 * 64].view(96, 64)
    get_backend("reference").check_main_grad(misplaced, shape=(96, 64), device=misplaced.device)
    with pytest.raises(ValueError, match=r"fake wgrad \(test\) needs 256-element starts"):
        ours[0].backend.check_main_grad(misplaced, shape=(96, 64), device=misplaced.device)


def test_layout_cli_lists_and_accepts_it(fake, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    code = cli.main(
        ["layout", "--shapes", "97,103", "--wgrad", "test-fake", "--start-alignment", "1", "--json"]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    (buffer,) = json.loads(out)["buffers"]
    assert buffer["start_alignment"] == FAKE_ALIGNMENT
    assert [p["start"] for p in buffer["params"]] == [0, FAKE_ALIGNMENT]


def test_unknown_names_list_the_registered_recipes(group, fake):
    message = (
        r"unknown wgrad recipe 'nvfp4': choose one of none, fp8, mxfp8, fp8-tensor, bf16, test-fake"
    )
    with pytest.raises(ValueError, match=message):
        aligndp.parallelize(small_model(), wgrad="nvfp4")
    with pytest.raises(ValueError, match=message):
        get_recipe("nvfp4")
    with pytest.raises(
        ValueError, match="choose one of fp8, reference, triton, fp8-tensor, bf16, fake-reference"
    ):
        get_backend("nvfp4-reference")


def test_unregistered_recipe_is_gone(group):
    with registered_recipe(fake_recipe()):
        assert recipe_names()[-1] == "test-fake"
        assert get_backend("fake-reference").recipe.name == "test-fake"
    assert recipe_names() == ("none", "fp8", "mxfp8", "fp8-tensor", "bf16")
    with pytest.raises(ValueError, match="unknown wgrad recipe 'test-fake'"):
        aligndp.parallelize(small_model(), wgrad="test-fake")
    with pytest.raises(ValueError, match="unknown MX backend 'fake-reference'"):
        get_backend("fake-reference")


def test_registry_refuses_clashes_and_incomplete_recipes(fake):
    with pytest.raises(ValueError, match="'test-fake' is already registered"):
        register_recipe(fake_recipe())
    with pytest.raises(ValueError, match="fake-reference are taken"):
        register_recipe(fake_recipe(name="test-other"))
    assert "test-other" not in recipe_names()
    with pytest.raises(ValueError, match="needs layer_dim_multiple > 0"):
        Recipe(name="half", runs="x", backends=fake.backends)
    with pytest.raises(ValueError, match="either a block > 0 with a scale_format"):
        Recipe(name="half", runs="x", backends=fake.backends, layer_dim_multiple=32, block=32)
    with pytest.raises(ValueError, match="either a block > 0 with a scale_format"):
        Recipe(
            name="half",
            runs="x",
            backends=fake.backends,
            layer_dim_multiple=32,
            scale_format=ScaleFormat.E8M0,
        )
    assert Recipe(name="half", runs="x", backends=fake.backends, layer_dim_multiple=1).block == 0
    with pytest.raises(TypeError, match="Recipe"):
        register_recipe("test-fake")
    with pytest.raises(ValueError, match="implements"):  # E8M0-only reference vs fp32 scales
        get_backend("fake-reference").__class__(get_recipe("fp8"))
    with pytest.raises(TypeError, match="is built for a Recipe, got 'mxfp8'.*get_backend"):
        ReferenceBackend("mxfp8")  # backends know no registry: a name is resolved by get_backend
