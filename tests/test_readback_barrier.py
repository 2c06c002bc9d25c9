"""The read-back barrier in Inductor's Triton kernels ([Note: read-back barrier] in
aligndp/lowp/readback_barrier.py).

The wrapper is checked on a stand-in kernel (any machine), and on the Triton source Inductor
generates for a softmax-like reduction whose stored input is read back in a second loop (where
Triton is importable; Inductor's Triton code generation for CPU needs no GPU, only Triton).
That a barrier there removes the race on a GPU is shown by
tests/test_mx_compile.py::test_compiled_gpt_logits_on_gpu_match_eager.
"""

from __future__ import annotations

import importlib.util
import re
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch._inductor.codegen.common import DeferredLine, IndentedBuffer

from aligndp.lowp.readback_barrier import BARRIER, install, with_barrier


class StandInKernel:
    """A kernel as the wrapper sees it: three code sections and Inductor's CSE sets; its
    ``load`` writes one line into the section ``into`` names, unless the value is cached."""

    def __init__(self, stored=(), invalidated=(), into="loads"):
        self.loads, self.compute, self.body = IndentedBuffer(), IndentedBuffer(), IndentedBuffer()
        self.cse = SimpleNamespace(
            store_cache=dict.fromkeys(stored), invalidated_stores=set(invalidated)
        )
        self.into, self.cached = into, set()

    def load(self, name, index):
        if name not in self.cached:
            getattr(self, self.into).writeline(f"tmp_{name} = tl.load({name} + {index})")
            self.cached.add(name)
        return f"tmp_{name}"


def lines(section: IndentedBuffer) -> list[str]:
    return [getattr(line, "line", line).strip() for line in section._lines]


@pytest.mark.parametrize("into", ["loads", "compute", "body"])
def test_barrier_goes_right_before_a_read_back_in_its_section(into):
    """A buffer stored in an earlier loop (``invalidated_stores``) is read back: the barrier is
    the line right before the load, in whichever section the load went to, at its indent."""
    kernel = StandInKernel(invalidated={"buf0"}, into=into)
    section = getattr(kernel, into)
    section.writeline("tmp0 = x")
    with section.indent():
        load = with_barrier(StandInKernel.load, DeferredLine)
        assert load(kernel, "buf0", "r0") == "tmp_buf0"
        assert load(kernel, "buf0", "r0") == "tmp_buf0"  # a CSE hit writes nothing more
    assert lines(section) == ["tmp0 = x", BARRIER, "tmp_buf0 = tl.load(buf0 + r0)"]
    assert section._lines[1].line.startswith("    ")  # the load's indent
    others = [s for s in ("loads", "compute", "body") if s != into]
    assert all(not getattr(kernel, s)._lines for s in others)


def test_no_barrier_before_a_buffer_the_kernel_has_not_stored():
    """An input, or a buffer the kernel stores only later, is read with no barrier; a buffer
    still in ``store_cache`` (stored in this very loop) gets one."""
    kernel = StandInKernel(stored={"buf1"}, invalidated={"buf0"})
    load = with_barrier(StandInKernel.load, DeferredLine)
    load(kernel, "in_ptr0", "x0")
    load(kernel, "buf1", "x0")
    assert lines(kernel.loads) == [
        "tmp_in_ptr0 = tl.load(in_ptr0 + x0)",
        BARRIER,
        "tmp_buf1 = tl.load(buf1 + x0)",
    ]


def test_install_wraps_inductors_load_once():
    from torch._inductor.codegen.triton import TritonKernel

    assert install() is True
    wrapped = TritonKernel.load
    assert wrapped.adds_readback_barrier
    assert install() is True and TritonKernel.load is wrapped  # not wrapped twice


def test_install_reports_an_inductor_it_cannot_wrap(monkeypatch):
    """An Inductor without the code the wrapper reads: no barrier, and install says so (the
    backends then quantise compiled activations in torch ops)."""
    from torch._inductor.codegen import common
    from torch._inductor.codegen.triton import TritonKernel

    from aligndp.lowp import readback_barrier

    monkeypatch.setattr(TritonKernel, "load", None)
    assert readback_barrier._install() is False
    monkeypatch.undo()
    monkeypatch.setattr(common.IndentedBuffer, "__init__", lambda self: None)  # no _lines
    assert readback_barrier._install() is False


def read_back(x):
    y = x * 2 + 1  # stored (an output) in the reduction's first loop...
    return y, y / y.sum(-1, keepdim=True)  # ...and read back in the second


def triton_source(fn, *args) -> list[str]:
    """The Triton kernels Inductor generates for ``fn`` on CPU (``cpu_backend="triton"``),
    looped reductions forced; the compile stops after code generation."""
    from torch._inductor import config
    from torch._inductor.codegen.triton import TritonKernel

    sources, generate = [], TritonKernel.codegen_kernel

    def record(self, *a, **k):
        sources.append(generate(self, *a, **k))
        raise RuntimeError("generated")

    patches = {"cpu_backend": "triton", "triton.persistent_reductions": False}
    with (
        mock.patch.object(TritonKernel, "codegen_kernel", record),
        mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "test"),
        config.patch(patches),
        pytest.raises(Exception, match="generated"),
    ):
        torch.compile(fn)(*args)
    torch._dynamo.reset()
    return sources


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="Inductor's Triton code generation needs Triton",
)
def test_inductor_kernel_that_reads_back_gets_the_barrier(monkeypatch):
    """Inductor stores ``y`` in the first loop and loads it back in the second: the barrier is
    right before that load (and nowhere else). Without the wrapper, no barrier is generated."""
    from torch._inductor.codegen.triton import TritonKernel

    install()
    (source,) = triton_source(read_back, torch.randn(64, 8192))
    code = [line.strip() for line in source.splitlines()]
    stored = re.search(r"tl\.store\((out_ptr\d+) \+", source).group(1)
    reads_back = [i for i, line in enumerate(code) if f"tl.load({stored} +" in line]
    assert len(reads_back) == 1 and code.count(BARRIER) == 1
    assert code[reads_back[0] - 1] == BARRIER
    assert code.index(BARRIER) > code.index(next(c for c in code if c.startswith("tl.store(")))

    monkeypatch.setattr(TritonKernel, "load", TritonKernel.load.__wrapped__)
    (source,) = triton_source(read_back, torch.randn(64, 8192))
    assert BARRIER not in source and f"tl.load({stored} +" in source
