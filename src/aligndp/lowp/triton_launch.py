"""Eager launches of ``@triton.jit`` / ``@gluon.jit`` kernels without Triton's per-call host
work: :class:`CheapLauncher`. GPU only in use; importable anywhere (Triton is imported on the
first launch), so the key rules below are tested on CPU.

[Note: cheap launches]
Why: the eager FP8 recipes are host-bound. On one H200 (Triton 3.6, torch 2.11) the host time
of one launch through ``kernel[grid](...)`` (Triton's ``JITFunction.run``: binder,
specialization, cache key, launch metadata, hooks) was more than twice that through the cached
``CompiledKernel``'s own ``run`` with the driver's current stream (the stream from
``torch.cuda.current_stream().cuda_stream`` costs more); figures in docs/performance.md.

How: the first call for a specialization goes through ``kernel[grid](...)``, which compiles (or
finds) the kernel and returns its ``CompiledKernel``; that kernel is cached under
:func:`specialization_key` plus the launch options and the current device. Later calls with
the same key call ``CompiledKernel.run(grid0, grid1, grid2, stream, function, packed_metadata,
None, None, None, *args)`` -- the call ``JITFunction.run`` itself ends with (Triton 3.6), without
launch metadata and hooks (Triton 3.6's hook slots default to an empty ``HookChain``, not None,
so its own path builds launch metadata and calls both chains on every launch). What the
wrapper adds is its key. On the GPU host it was a large part of the call for the 1x128 GEMM's
15 arguments (five of them host tensor descriptors, since moved to the device below:
[Note: descriptors on the device]), so the key is cheap by construction: what to read at each
position is worked out once per tuple of argument types (:class:`_Plan`), and a call's key is
then the types, C-level gathers of the constexpr values and identities, and one short loop
each over its tensors and ints (arguments passed in signature order rather than by keyword
made the key cheaper still on a CPU). Kernels are
called with their arguments in signature order where that is easy: binding keywords to
positions is Python work per call.

What it relies on (else every call goes through ``kernel[grid]``, which is always correct):
- the JIT function has ``params`` whose entries say ``name``, ``is_constexpr``,
  ``do_not_specialize``, ``do_not_specialize_on_alignment`` (else never fast);
- ``kernel[grid]`` returns an object with ``run``, ``function`` and ``packed_metadata`` (not
  under ``TRITON_INTERPRET``, where it returns None: never fast);
- no launch hook is active (``knobs.runtime.launch_enter_hook`` / ``launch_exit_hook`` None or
  an empty ``HookChain``) and the function has no ``pre_run_hooks``: checked on every call, so
  a profiler that adds a hook (proton) sees every launch;
- the key separates every call Triton would compile apart (:func:`specialization_key`, and
  ``knobs.runtime.debug``); ``TRITON_INSTRUMENTATION_MODE`` is not re-read per call, and the
  check that a global the kernel reads has not changed since compiling is Triton's alone.

[Note: descriptors on the device]
The 1x128 Gluon GEMM (gluon_gemm.py) takes plain pointers and makes its five TMA descriptors
itself (``tma.make_tensor_descriptor``), each program into its slice of the launch's global
scratch.
Host descriptors cost the host, per call: five Gluon ``TensorDescriptor`` objects (their
checks), Triton's encoding of each into a ``CUtensorMap`` at every launch and a longer launch
key; on the device the whole call's host time about halved
(benchmarks/results/2026-12-02_fp8_launch_host_cost.md). On the GPU, making them costs a few
microseconds per GEMM before the programs' first loads, a few percent of the kernel at 1b's
shapes (made inside the warp-specialised partitions instead, no better). The 1b step with
every block Linear in 1x128, compiled, got faster against bf16 + compile: its host had fallen
behind its GPU (docs/performance.md). The
scratch comes from the allocator Triton asks at launch (``triton.set_allocator``): a thread
that has none (autograd runs backward on a thread of its own, and Triton keeps the allocator
per thread) gets torch's caching allocator on its first launch; one the user set is used as
it is. The descriptors take each operand's rows as packed, so
:func:`aligndp.lowp.triton_kernels.scaled_gemm` refuses a strided operand before the launch.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "CheapLauncher",
    "ensure_scratch_allocator",
    "position_rules",
    "specialization_key",
    "through_triton",
]

_PLAIN = (int, float, str, type(None), bool)
"""Constexpr types keyed by value (the key's types keep ``True`` apart from ``1``)."""


def _int_class(v: int, value: bool, align: bool):
    """Triton 3.6's rule for a non-constexpr int: 1 is a constant (``value`` on); else its type
    by range (i32, i64, u64) and, ``value`` and ``align`` on, whether it is a multiple of 16."""
    if value and v == 1:
        return "one"
    if -(2**31) <= v < 2**31:
        width = "i32"
    elif -(2**63) <= v < 2**63:
        width = "i64"
    elif 0 <= v < 2**64:
        width = "u64"
    else:
        return None  # Triton raises OverflowError: let it
    return (width, value and align and v % 16 == 0)


SPECIALIZED, CONSTEXPR, NO_VALUE, NO_ALIGN = range(4)
"""What Triton does with an argument position: specializes it on its value (the default),
compiles it in, or keeps only its type (``do_not_specialize``) or drops the 16-byte rule
(``do_not_specialize_on_alignment``)."""


def position_rules(
    n: int,
    constexpr: frozenset[int] = frozenset(),
    do_not_specialize: frozenset[int] = frozenset(),
    do_not_specialize_on_alignment: frozenset[int] = frozenset(),
) -> tuple[int, ...]:
    """The rule of each of ``n`` positions from the sets of positions Triton's params name."""
    return tuple(
        CONSTEXPR
        if i in constexpr
        else NO_VALUE
        if i in do_not_specialize
        else NO_ALIGN
        if i in do_not_specialize_on_alignment
        else SPECIALIZED
        for i in range(n)
    )


def specialization_key(args: Sequence, rules: Sequence[int] | None = None) -> tuple | None:
    """A hashable key of ``args`` (the kernel's arguments in signature order) that differs
    wherever Triton 3.6 would compile another kernel, or None for an argument type these rules
    do not cover (the caller then launches through Triton). ``rules``: one per position
    (:func:`position_rules`; default all ``SPECIALIZED``). The key holds every argument's type;
    beyond that, by position:

    - constexpr: the value (int, float, str, bool, None), or the object's identity;
    - tensor: dtype, and (``SPECIALIZED`` only) whether ``data_ptr()`` is 16-byte aligned;
    - bool, float, None: nothing more (types ``u1``, ``fp32``, a constant);
    - int: equal to 1, type by range (i32 / i64 / u64), multiple of 16 (:func:`_int_class`);
    - tensor descriptor (``base`` and ``block_shape``): dtype, block shape, layout's identity.
    Finer than Triton where that is cheaper (a bool-typed ``1`` vs ``True``): a finer key only
    costs one more trip through ``kernel[grid]``. An identity is an ``id``: whoever keeps the
    key keeps those objects alive (:meth:`_Plan.kept`), so no other object takes their ids."""
    types = tuple(map(type, args))
    return _Plan(types, tuple(rules or (SPECIALIZED,) * len(args))).key(args, types)


def _getter(positions: list[int]) -> Callable[[Sequence], tuple]:
    """``args -> tuple(args[i] for i in positions)``, at C speed."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        (i,) = positions
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class _Plan:
    """What :func:`specialization_key` reads at each position, for one tuple of argument
    types: worked out once per types (:class:`CheapLauncher` keeps them), so a call's key is a
    few C-level gathers and one loop per tensor and int ([Note: cheap launches])."""

    def __init__(self, types: tuple[type, ...], rules: tuple[int, ...]):
        values, idents, aligned, dtyped, ints, others = [], [], [], [], [], []
        self.int_rules = []
        for i, (t, rule) in enumerate(zip(types, rules, strict=True)):
            if rule == CONSTEXPR:
                (values if t in _PLAIN else idents).append(i)
            elif issubclass(t, torch.Tensor):
                (aligned if rule == SPECIALIZED else dtyped).append(i)
            elif t in (bool, float, type(None)):
                pass  # its type is all Triton keys
            elif issubclass(t, int):
                ints.append(i)
                self.int_rules.append((rule != NO_VALUE, rule == SPECIALIZED))
            else:
                others.append(i)  # a tensor descriptor, or a type no rule covers
        self.values, self.idents, self.aligned = _getter(values), _getter(idents), _getter(aligned)
        self.dtyped, self.ints, self.others = _getter(dtyped), _getter(ints), _getter(others)

    def key(self, args: Sequence, types: tuple) -> tuple | None:
        ints = []
        for v, (value, align) in zip(self.ints(args), self.int_rules):
            part = _int_class(v, value, align)
            if part is None:
                return None
            ints.append(part)
        descs = []
        for a in self.others(args):
            if not (hasattr(a, "base") and hasattr(a, "block_shape")):
                return None
            descs.append((a.base.dtype, tuple(a.block_shape), id(getattr(a, "layout", None))))
        return (
            types,
            self.values(args),
            tuple(map(id, self.idents(args))),
            tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in self.aligned(args)]),
            tuple([t.dtype for t in self.dtyped(args)]),
            tuple(ints),
            tuple(descs),
        )

    def kept(self, args: Sequence) -> tuple:
        """The objects whose ids the key holds."""
        return (*self.idents(args), *[getattr(a, "layout", None) for a in self.others(args)])


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """A launch's global scratch from torch's caching allocator on the current device (512-byte
    aligned; freed after the launch, stream-ordered)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Give this thread torch's allocator for Triton's launch scratch unless it has one
    ([Note: descriptors on the device]). GPU only: imports Triton."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


_THROUGH_TRITON = [False]


class through_triton:
    """Context manager: every :class:`CheapLauncher` call inside goes through ``kernel[grid]``
    (for tests and benchmarks comparing the two)."""

    def __enter__(self):
        self._old, _THROUGH_TRITON[0] = _THROUGH_TRITON[0], True

    def __exit__(self, *exc):
        _THROUGH_TRITON[0] = self._old


class _TritonEnv:
    """What a launch reads from Triton's runtime: the device and stream ``JITFunction.run``
    would use, and whether a launch hook is active."""

    def __init__(self):
        from triton import knobs
        from triton.runtime import driver

        self.device = driver.active.get_current_device
        self.stream = driver.active.get_current_stream
        self._runtime = knobs.runtime

    def hooked(self) -> bool:
        rt = self._runtime
        return _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook)

    def debug(self) -> bool:
        return self._runtime.debug


def _active(hook) -> bool:
    """A hook slot in use: a callable, or a ``HookChain`` with calls (Triton 3.6's default is an
    empty chain)."""
    return bool(getattr(hook, "calls", hook))


class CheapLauncher:
    """``CheapLauncher(kernel)[grid](*args, **kwargs)`` launches like ``kernel[grid](...)``;
    see [Note: cheap launches]. ``env`` stands in for Triton's runtime (tests)."""

    def __init__(self, fn, *, env: Callable[[], object] = _TritonEnv):
        self.fn = fn
        self._make_env, self._env = env, None
        self._kernels: dict = {}
        self._plans: dict[tuple, _Plan] = {}  # by argument types
        try:
            params = list(fn.params)
            self._names = tuple(p.name for p in params)
            self._name_set = frozenset(self._names)
            self._defaults = {p.name: p.default for p in params if p.has_default}
            self._pre_run_hooks = fn.pre_run_hooks  # a list Triton appends to
            flags = [
                frozenset(i for i, p in enumerate(params) if getattr(p, flag))
                for flag in ("is_constexpr", "do_not_specialize", "do_not_specialize_on_alignment")
            ]
        except (AttributeError, TypeError):
            self._names = None  # not the JITFunction this was written for: never fast
            return
        self._rules = position_rules(len(params), *flags)

    def __getitem__(self, grid: tuple):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        env = self._env
        if env is None:
            env = self._env = self._make_env()
        key, bound, plan = self._key(env, args, kwargs)
        try:
            cached = None if key is None else self._kernels.get(key)
        except TypeError:  # an unhashable option value
            key = cached = None
        if cached is None:  # Triton binds, specializes, compiles or finds, and launches
            kernel = self.fn[grid](*args, **kwargs)
            parts = tuple(getattr(kernel, a, None) for a in ("run", "function", "packed_metadata"))
            if key is not None and None not in parts:
                self._kernels[key] = (*parts, plan.kept(bound))
            return
        run, function, metadata, _ = cached
        g0, g1, g2 = (*grid, 1, 1)[:3]
        run(g0, g1, g2, env.stream(key[0]), function, metadata, None, None, None, *bound)

    def _key(self, env, args: tuple, kwargs: dict) -> tuple[tuple | None, tuple, _Plan | None]:
        """(the cache key, the arguments in signature order, their plan), or (None, (), None)
        where this call must go through Triton."""
        never = None, (), None
        if self._names is None or _THROUGH_TRITON[0] or env.hooked() or self._pre_run_hooks:
            return never
        if len(args) > len(self._names):  # Triton says what is wrong
            return never
        if len(args) < len(self._names):
            try:
                rest = [
                    kwargs[n] if n in kwargs else self._defaults[n]
                    for n in self._names[len(args) :]
                ]
            except KeyError:  # a missing argument: Triton says which
                return never
            args = (*args, *rest)
        types = tuple(map(type, args))
        plan = self._plans.get(types)
        if plan is None:
            plan = self._plans[types] = _Plan(types, self._rules)
        spec = plan.key(args, types)
        if spec is None:
            return never
        options = tuple([item for item in kwargs.items() if item[0] not in self._name_set])
        return (env.device(), env.debug(), options, spec), args, plan
