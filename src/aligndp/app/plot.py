"""Draw buffer layouts: one horizontal bar per buffer (used by ``aligndp layout --png`` and train).

Reading the picture: grey hatching is padding; coloured spans are params (one colour per
owner rank in layerwise mode, alternating shades otherwise); thick black lines are bucket
boundaries, dashed lines shard boundaries. Only spans wide enough to hold text get a label,
so a 200-param model stays readable.
"""

from __future__ import annotations

from collections.abc import Sequence

from aligndp.plan.slots import BufferLayout
from aligndp.plan.spec import Mode

__all__ = ["draw_layout"]

MIN_LABEL_FRACTION = 0.04
"""A span gets a text label only if it covers at least this fraction of its buffer."""


def _short_name(name: str, *, parts: int = 2) -> str:
    """``blocks.3.mlp.fc.weight`` -> ``fc.weight``: the tail that tells params apart."""
    return ".".join(name.split(".")[-parts:])


def _title(layout: BufferLayout) -> str:
    dtype = str(layout.grad_dtype).removeprefix("torch.")
    title = (
        f"{layout.mode.value} buffer, {dtype} grads, dp_size={layout.dp_size}: "
        f"{layout.numel:,} real + {layout.padding_numel:,} padding elements "
        f"({100 * layout.padding_fraction:.2f}% padding), {len(layout.buckets)} bucket(s)"
    )
    if layout.mode is Mode.LAYERWISE:
        title += f", Newton–Schulz imbalance {layout.imbalance:.3f}"
    return title


def _draw_one(ax, layout: BufferLayout, cmap) -> list:
    """Draw one buffer on ``ax``; returns legend handles."""
    from matplotlib.patches import Patch

    total = max(layout.padded_numel, 1)
    ax.barh(0, total, left=0, height=0.8, color="0.85", hatch="////", edgecolor="0.6", linewidth=0)
    handles = [Patch(facecolor="0.85", hatch="////", edgecolor="0.6", label="padding")]
    layerwise = layout.mode is Mode.LAYERWISE
    for p in layout.params:
        color = cmap(p.owner % cmap.N) if layerwise else ("tab:blue", "tab:cyan")[p.index % 2]
        ax.barh(0, p.numel, left=p.start, height=0.8, color=color, edgecolor="white", linewidth=0.3)
        if p.numel >= MIN_LABEL_FRACTION * total:
            shape = "x".join(map(str, p.shape))
            ax.text(
                p.start + p.numel / 2,
                0,
                f"{_short_name(p.name)}\n{shape}",
                ha="center",
                va="center",
                fontsize=7,
                rotation=90 if p.numel < 0.12 * total else 0,
                clip_on=True,
            )
    if layerwise:
        ranks = sorted({p.owner for p in layout.params})
        handles += [Patch(color=cmap(r % cmap.N), label=f"rank {r}") for r in ranks[:16]]
    else:
        handles.append(Patch(color="tab:blue", label="param"))
    for b in layout.buckets:
        ax.axvline(b.start, color="black", linewidth=2.5)
        if layout.sharded:
            for rank in range(1, layout.dp_size):
                ax.axvline(
                    layout.shard_range(b.index, rank)[0],
                    color="black",
                    linestyle="--",
                    linewidth=0.9,
                )
    ax.axvline(total, color="black", linewidth=2.5)
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], color="black", linewidth=2.5, label="bucket boundary"))
    if layout.sharded:
        handles.append(
            Line2D([], [], color="black", linestyle="--", linewidth=0.9, label="shard boundary")
        )
    ax.set_xlim(0, total)
    ax.set_ylim(-0.6, 0.6)
    ax.set_yticks([])
    ax.set_xlabel("element offset")
    ax.set_title(_title(layout), fontsize=9)
    return handles


def draw_layout(layouts: Sequence[BufferLayout] | BufferLayout, path: str) -> None:
    """Write a PNG of ``layouts`` (one bar each) to ``path``; no display needed.

    Draws on a bare :class:`matplotlib.figure.Figure` (its own Agg canvas), so the process's
    pyplot backend and figure registry are left as the caller set them.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    if isinstance(layouts, BufferLayout):
        layouts = [layouts]
    if not layouts:
        raise ValueError("draw_layout needs at least one layout; plan one with plan_layout()")
    cmap = colormaps["tab10" if max(layout.dp_size for layout in layouts) <= 10 else "tab20"]
    fig = Figure(figsize=(14, 1.9 * len(layouts) + 0.4))
    axes = fig.subplots(len(layouts), 1, squeeze=False)
    for ax, layout in zip(axes[:, 0], layouts):
        handles = _draw_one(ax, layout, cmap)
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=7,
            frameon=False,
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
