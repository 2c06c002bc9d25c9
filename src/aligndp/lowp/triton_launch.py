"""Eager launches of ``@triton.jit`` / ``@gluon.jit`` kernels without Triton's per-call host
work: :class:`CheapLauncher`. GPU only in use; importable anywhere (Triton is imported on the
first launch), so the key rules below are tested on CPU.

[Note: cheap launches]
Why: the eager FP8 recipes are host-bound. On one H200 (Triton 3.6, torch 2.11) the host time
of one launch of fp8-tensor's amax kernel (768x768 bf16) was 13.1 us through ``kernel[grid](...)``
(Triton's ``JITFunction.run``: binder, specialization, cache key, launch metadata, hooks) and
5.6 us through the cached ``CompiledKernel``'s own ``run`` with the driver's current stream
(10.4 us with the stream from ``torch.cuda.current_stream().cuda_stream``); a whole fp8-tensor
quantise (two launches) took 63 us.

How: the first call for a specialization goes through ``kernel[grid](...)``, which compiles (or
finds) the kernel and returns its ``CompiledKernel``; that kernel is cached under
:func:`specialization_key` plus the launch options and the current device. Later calls with
the same key call ``CompiledKernel.run(grid0, grid1, grid2, stream, function, packed_metadata,
None, None, None, *args)`` -- the call ``JITFunction.run`` itself ends with (Triton 3.6), without
launch metadata and hooks (Triton 3.6's hook slots default to an empty ``HookChain``, not None,
so its own path builds launch metadata and calls both chains on every launch). What the
wrapper adds to that 5.6 us is its key: about 2.5 us of Python for the cast kernel's 11
arguments on a slow shared 2-core CPU (not yet measured on the GPU host:
``benchmarks/launch_cost.py``).

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["CheapLauncher", "position_rules", "specialization_key", "through_triton"]

_PLAIN = (int, float, str, type(None))
"""Constexpr values keyed by value (bool too, apart from ints: ``True == 1``)."""


class _Same:
    """A key part equal only to itself's object (``is``): a constexpr object (a ``tl.dtype``, a
    Gluon layout) keyed without hashing its contents per call. The key holds the object, so its
    ``id`` is never reused while the cached kernel lives."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Same) and self.obj is other.obj


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
    (:func:`position_rules`; default all ``SPECIALIZED``).

    - constexpr: the value (bools apart from ints; other objects by identity);
    - tensor: dtype, and (``SPECIALIZED`` only) whether ``data_ptr()`` is 16-byte aligned;
    - bool: nothing (type ``u1``); float: nothing (``fp32``); None: a constant;
    - int: equal to 1, type by range (i32 / i64 / u64), multiple of 16 (:func:`_int_class`);
    - tensor descriptor (``base`` and ``block_shape``): its class, dtype, block shape, layout.
    Finer than Triton where that is cheaper (a bool-typed ``1`` vs ``True``): a finer key only
    costs one more trip through ``kernel[grid]``."""
    key = []
    for rule, a in zip(rules or (SPECIALIZED,) * len(args), args, strict=True):
        if rule == CONSTEXPR:
            if isinstance(a, bool):
                key.append(("bool", a))
            else:
                key.append(a if isinstance(a, _PLAIN) else _Same(a))
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, rule == SPECIALIZED and a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append("u1")
        elif isinstance(a, int):
            part = _int_class(a, rule != NO_VALUE, rule == SPECIALIZED)
            if part is None:
                return None
            key.append(part)
        elif isinstance(a, float):
            key.append("fp32")
        elif a is None:
            key.append(None)
        elif hasattr(a, "base") and hasattr(a, "block_shape"):
            layout = getattr(a, "layout", None)
            key.append((type(a), a.base.dtype, tuple(a.block_shape), _Same(layout)))
        else:
            return None
    return tuple(key)


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
        key, bound = self._key(env, args, kwargs)
        try:
            cached = None if key is None else self._kernels.get(key)
        except TypeError:  # an unhashable option value
            key = cached = None
        if cached is None:  # Triton binds, specializes, compiles or finds, and launches
            kernel = self.fn[grid](*args, **kwargs)
            parts = tuple(getattr(kernel, a, None) for a in ("run", "function", "packed_metadata"))
            if key is not None and None not in parts:
                self._kernels[key] = parts
            return
        run, function, metadata = cached
        g0, g1, g2 = (*grid, 1, 1)[:3]
        run(g0, g1, g2, env.stream(key[0]), function, metadata, None, None, None, *bound)

    def _key(self, env, args: tuple, kwargs: dict) -> tuple[tuple | None, tuple]:
        """(the cache key, the arguments in signature order), or (None, ()) where this call
        must go through Triton."""
        if self._names is None or _THROUGH_TRITON[0] or env.hooked() or self._pre_run_hooks:
            return None, ()
        if len(args) > len(self._names):  # Triton says what is wrong
            return None, ()
        if len(args) < len(self._names):
            try:
                rest = [
                    kwargs[n] if n in kwargs else self._defaults[n]
                    for n in self._names[len(args) :]
                ]
            except KeyError:  # a missing argument: Triton says which
                return None, ()
            args = (*args, *rest)
        spec = specialization_key(args, self._rules)
        if spec is None:
            return None, ()
        options = tuple([item for item in kwargs.items() if item[0] not in self._name_set])
        return (env.device(), env.debug(), options, spec), args
