"""Low-precision training: wgrad recipes and their registry, the MXFP8 format, a drop-in
``nn.Linear`` and its GEMM backends.

A recipe is one frozen :class:`Recipe` ([Note: wgrad recipes] in ``recipe.py``), declared in
its own ``recipe_<name>.py`` and registered from the list in ``recipes.py``. Importing this
package never imports Triton; the GPU backends load it on first use.
"""

from aligndp.lowp.backends import WgradBackend
from aligndp.lowp.linear import MXLinear, convert_to_mxfp8
from aligndp.lowp.mx_format import MXTensor, dequantize_mxfp8, quantize_mxfp8
from aligndp.lowp.recipe import BackendRef, Recipe, ScaleFormat
from aligndp.lowp.recipes import (
    get_backend,
    get_recipe,
    recipe_names,
    register_recipe,
    registered_recipe,
    unregister_recipe,
)

__all__ = [
    "MXTensor",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "MXLinear",
    "convert_to_mxfp8",
    "WgradBackend",
    "get_backend",
    "Recipe",
    "BackendRef",
    "ScaleFormat",
    "register_recipe",
    "unregister_recipe",
    "registered_recipe",
    "get_recipe",
    "recipe_names",
]
