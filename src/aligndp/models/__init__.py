"""Models aligndp trains in its CLI and tests. ``GPT`` needs torch and is imported when first
asked for; ``GPTConfig`` and ``PRESETS`` do not (the CLI reads them without torch)."""

from aligndp.models.presets import PRESETS, GPTConfig

__all__ = ["GPT", "GPTConfig", "PRESETS"]


def __getattr__(name: str):
    if name == "GPT":
        from aligndp.models.gpt import GPT

        return GPT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
