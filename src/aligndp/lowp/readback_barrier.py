"""A barrier before every read-back in Inductor's Triton kernels: :func:`install`.

[Note: read-back barrier]
Why: Inductor fuses a producer and its consumers into one Triton kernel. When the producer's
result must also be stored (an output, or saved for backward), a looped reduction kernel
stores it in one loop and loads it back in a later one: a LayerNorm kernel stores its
normalised rows (kept for backward) and reads them back for the affine. Inductor takes it
that each thread reads back what it stored. Triton's coalesce pass may give the store and the
load different thread layouts (triton-lang/triton#10924, open), and nothing orders them, so a
thread can read elements that another warp has not written yet: stale bytes. On one H200
(torch 2.11, Triton 3.6), a compiled 1x128 GPT of four 1b-width blocks whose every quantise
went through the opaque ``aligndp::quantize_rc`` op read FP8 bytes the caching allocator had
handed out before as float32 rows: NaN logits
(benchmarks/results/2026-12-02_triton_race_layernorm.md).
pytorch/pytorch#190517 reports the same kernel shape on XPU, and #190519 proposed a barrier
there; torch 2.13's Inductor has only the barrier for the opposite order (a load, then a store
over it: triton-lang/triton#1615).

How: :func:`install` wraps Inductor's ``TritonKernel.load``. A load of a buffer that this
kernel has already stored (Inductor's CSE lists it in ``invalidated_stores``, or still in
``store_cache``) gets ``tl.debug_barrier()`` right before it, in the code section the load
went to. The barrier is ``bar.sync``: every global write of the CTA's threads before it is
visible to all of them after it. A CTA-wide barrier is enough because Inductor's read-back
reads the rows that the same program stored (each program owns its ``xindex`` rows through
every loop). Kernels without a read-back are generated as before.

Scope and cost: the Hopper block backends install it when constructed
(:class:`~aligndp.lowp.triton_backend.TritonBackend`), and then quantise every compiled operand
through the one-pass kernel, which reads its input once for both layouts. Inductor's fused row and
column quantise read it again per layout, several times the kernel's GPU time in a 1b step on one
H200 (benchmarks/results/2026-12-02_readback_barrier.md). From then on it applies to every graph the
process compiles. A barrier adds one ``bar.sync`` per loop iteration of the kernels that read back,
and none elsewhere. Where Inductor's code is not as this wrapper expects, :func:`install` returns
False and the backends keep quantising compiled activations in torch ops: there the quantise is
fused into the LayerNorm kernel, which then stores its bf16 result once and does not read it back.
"""

from __future__ import annotations

import functools

__all__ = ["install", "with_barrier"]

BARRIER = "tl.debug_barrier()"


def _stored_here(kernel, name: str) -> bool:
    cse = kernel.cse
    return name in getattr(cse, "invalidated_stores", ()) or name in getattr(cse, "store_cache", {})


def with_barrier(load, deferred_line):
    """``load`` (``TritonKernel.load``) that puts ``deferred_line(name, BARRIER)`` right before
    the line it writes for a buffer the kernel has already stored. A load that writes no line
    (a CSE hit: the value is already in registers, read behind an earlier barrier) gets none."""

    @functools.wraps(load)
    def wrapped(self, name, index):
        if not _stored_here(self, name):
            return load(self, name, index)
        sections = (self.loads, self.compute, self.body)
        sizes = [len(section._lines) for section in sections]
        result = load(self, name, index)
        for section, size in zip(sections, sizes, strict=True):
            if len(section._lines) > size:
                section.writeline(deferred_line(name, BARRIER))  # at the section's indent
                section._lines.insert(size, section._lines.pop())
                break
        return result

    wrapped.adds_readback_barrier = True
    return wrapped


@functools.cache
def install() -> bool:
    """Wrap Inductor's ``TritonKernel.load`` ([Note: read-back barrier]), once per process;
    whether the barrier is in place (False where Inductor's code differs from what the wrapper
    reads)."""
    return _install()


def _install() -> bool:
    try:
        from torch._inductor.codegen.common import DeferredLine, IndentedBuffer
        from torch._inductor.codegen.triton import TritonKernel

        lines_kept = isinstance(IndentedBuffer()._lines, list)
    except (ImportError, AttributeError, TypeError):  # another Inductor: the fallback path
        return False
    load = getattr(TritonKernel, "load", None)
    if load is None or not lines_kept:
        return False
    if not getattr(load, "adds_readback_barrier", False):
        TritonKernel.load = with_barrier(load, DeferredLine)
    return True
