"""What a low-precision wgrad recipe is: one frozen :class:`Recipe` per recipe.

[Note: wgrad recipes]
A recipe says everything the rest of aligndp branches on: the layout requirements its fused
wgrad GEMM puts on every param start ([Note: alignment contract]), its quantisation block and
scale format (what the kernels specialise on), which ``nn.Linear`` layers it converts, and
which GEMM backend runs it on which device. Backends are named by import path and imported on
first use, so declaring a recipe imports no kernel (and no Triton). Each recipe is declared
in its own module (``recipe_<name>.py``: ``RECIPE = Recipe(...)``, and, if it likes, its CPU
reference backend, a :class:`~aligndp.lowp.backends.WgradBackend` subclass) and registered
from the one list in :mod:`aligndp.lowp.recipes`; ``parallelize(wgrad=)``, ``aligndp train
--wgrad``, ``aligndp layout --wgrad``, ``get_backend`` and ``MXLinear`` read that registry.
GPU backends and kernels live in their own modules, imported only when a backend is built.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib

import torch.nn as nn

from aligndp.lowp.layer_rule import GainRule
from aligndp.plan.spec import Requirement

__all__ = ["ScaleFormat", "BackendRef", "Recipe"]


class ScaleFormat(enum.Enum):
    """How a quantisation block's shared scale is stored; the kernels specialise on it."""

    E8M0 = "e8m0"
    """OCP MX: a power of two stored as a biased 8-bit exponent ([Note: MXFP8 format])."""
    FP32 = "fp32"
    """A float32 ``amax / fp8_max`` per block (blockwise FP8)."""


@dataclasses.dataclass(frozen=True)
class BackendRef:
    """One GEMM backend of a recipe, named by import path (imported only by :meth:`load`)."""

    name: str
    """What ``get_backend`` and ``MXLinear(backend=)`` accept, e.g. ``"reference"``; unique
    over all registered recipes."""
    path: str
    """``"package.module:ClassName"`` of a :class:`~aligndp.lowp.backends.WgradBackend`
    subclass, built as ``ClassName(recipe, name=name)``."""
    devices: tuple[str, ...] = ()
    """Device types (``"cpu"``, ``"cuda"``) it is the recipe's default backend on, as
    ``aligndp train --device`` picks it."""
    needs_cuda: bool = False
    """It launches GPU kernels: refused, before its module is imported, without CUDA."""

    def __post_init__(self) -> None:
        module, _, cls = self.path.partition(":")
        if not (self.name and module and cls):
            raise ValueError(
                f"backend {self.name!r}: path {self.path!r} must read 'package.module:ClassName' "
                "and the name must be non-empty"
            )

    def load(self, recipe: Recipe) -> object:
        """Import the backend's module and build it for ``recipe``: a
        :class:`~aligndp.lowp.backends.WgradBackend` (not imported here, which would be a
        cycle)."""
        module, _, cls = self.path.partition(":")
        return getattr(importlib.import_module(module), cls)(recipe, name=self.name)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A low-precision wgrad recipe; see [Note: wgrad recipes]."""

    name: str
    """Registry key: ``parallelize(wgrad=name)``, ``--wgrad name``."""
    runs: str
    """What it runs and where, quoted in messages, e.g. ``"blockwise FP8 kernels on a Hopper
    GPU"``."""
    requirements: tuple[Requirement, ...] = ()
    """What its fused wgrad GEMM needs of every param start in the grad buffers."""
    block: int = 0
    """Elements per quantisation block along a GEMM's contraction dim (0: no quantisation,
    as ``bf16``'s, which only fuses the wgrad)."""
    scale_format: ScaleFormat | enum.Enum | None = None
    """How a block's scale is stored (None: no quantisation). Backends refuse a format they do
    not implement; a recipe whose scales the built-in kernels do not know may use its own
    module's enum member."""
    layer_dim_multiple: int = 0
    """``in_features`` and ``out_features`` of a layer it converts must be multiples of this
    (0: it converts no layer)."""
    backends: tuple[BackendRef, ...] = ()
    """GEMM backends that run it, in order of preference."""
    spares_head: bool = True
    """Keep the model's last ``nn.Linear`` (the output head, whose logits are the most
    precision-sensitive GEMM) unconverted; False for a recipe that lowers no precision."""
    gain: GainRule | None = None
    """Where its GEMMs beat bf16 ([Note: layers that pay] in layer_rule.py): what
    ``convert_to_mxfp8(layers="pays")`` converts. None: every layer it can run."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"a recipe needs a non-empty name, got {self.name!r}")
        if not all(isinstance(r, Requirement) for r in self.requirements):
            raise TypeError(
                f"recipe {self.name!r}: requirements must be a tuple of Requirement, "
                f"got {self.requirements!r}"
            )
        names = [b.name for b in self.backends]
        if len(set(names)) != len(names):
            raise ValueError(f"recipe {self.name!r} names a backend twice: {names}")
        quantises = self.block > 0 or self.scale_format is not None
        if self.backends and not (
            self.layer_dim_multiple > 0
            and (not quantises or (self.block > 0 and self.scale_format is not None))
        ):
            raise ValueError(
                f"recipe {self.name!r} has backends, so it needs layer_dim_multiple > 0 and "
                "either a block > 0 with a scale_format (it quantises) or neither; got "
                f"block={self.block}, scale_format={self.scale_format}, "
                f"layer_dim_multiple={self.layer_dim_multiple}"
            )

    def backend(self, name: str) -> BackendRef | None:
        """The backend called ``name``, if this recipe has one."""
        return next((b for b in self.backends if b.name == name), None)

    def default_backend(self, device_type: str) -> BackendRef | None:
        """The backend it runs on ``device_type`` by default, if any."""
        return next((b for b in self.backends if device_type in b.devices), None)

    def converts(
        self,
        name: str,
        module: nn.Linear,
        *,
        last_linear: str = "",
        shared: frozenset = frozenset(),
    ) -> bool:
        """Whether this recipe converts ``module`` (called ``name``): not unless both of its
        dims are multiples of :attr:`layer_dim_multiple`; not the model's last ``nn.Linear``
        in registration order unless :attr:`spares_head` is False (the output head, whose
        logits are the most precision-sensitive GEMM; torchao and TE recipes keep it high
        precision too); not a layer whose weight
        another module shares (tied embeddings: the fused wgrad would bypass the other user's
        autograd path)."""
        if not self.layer_dim_multiple:
            return False
        dims_ok = not (
            module.in_features % self.layer_dim_multiple
            or module.out_features % self.layer_dim_multiple
        )
        head = self.spares_head and name == last_linear
        return dims_ok and not head and name not in shared

    def why_not(
        self,
        name: str,
        module: nn.Linear,
        *,
        last_linear: str = "",
        shared: frozenset = frozenset(),
        layers: str = "pays",
        capability: tuple[int, int] | None = None,
    ) -> str:
        """Why this recipe keeps ``module`` an ``nn.Linear`` ("" when it converts it):
        :meth:`converts`, and with ``layers="pays"`` its :attr:`gain` rule on a device of
        ``capability`` (None: a CPU)."""
        if layers not in ("pays", "all"):
            raise ValueError(f"layers must be 'pays' or 'all', got {layers!r}")
        if not self.converts(name, module, last_linear=last_linear, shared=shared):
            if not self.layer_dim_multiple:
                return "recipe converts no layer"
            if self.spares_head and name == last_linear:
                return "the model's last Linear (output head)"
            if name in shared:
                return "its weight is shared with another module"
            return f"dims not multiples of {self.layer_dim_multiple}"
        if layers == "all" or self.gain is None:
            return ""
        if not self.gain.fast_on(capability):
            return "no fast path on this device"
        if not self.gain.gains(module.in_features, module.out_features):
            return f"too small to gain ({self.gain.source})"
        return ""
