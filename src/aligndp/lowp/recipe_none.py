"""The ``none`` wgrad recipe: plain autograd copies each gradient into the buffer."""

from aligndp.lowp.recipe import Recipe

RECIPE = Recipe(name="none", runs="plain autograd (no low-precision layer)")
"""No requirement beyond the default alignment; converts no layer."""
