"""CheapLauncher ([Note: cheap launches] in aligndp/lowp/triton_launch.py): the specialization
key against Triton 3.6's rules, the launcher's choice between its cached kernel and
``kernel[grid]`` (CPU, with stand-ins for Triton), and on a GPU, bit-identical results of the
cached launch and ``kernel[grid]`` for every kernel that launches through it."""

from __future__ import annotations

import gc
import types
import weakref

import pytest
import torch

from aligndp.lowp.triton_launch import (
    CheapLauncher,
    position_rules,
    specialization_key,
    through_triton,
)

BASE = torch.zeros(64)  # float32: an offset of 4 elements is 16 bytes
ALIGNED, ALIGNED_TOO, UNALIGNED = BASE[:32], BASE[4:36], BASE[1:33]
LAYOUT = object()


def desc(base, block_shape, layout=LAYOUT):
    return types.SimpleNamespace(base=base, block_shape=block_shape, layout=layout)


# (a, b, Triton compiles them apart) for one non-constexpr argument, hand-worked from Triton
# 3.6's specialization (python/src/specialize.cc, ``JITFunction.run``'s cache key):
# - a tensor is keyed by its dtype and by "D" when ``data_ptr() % 16 == 0``;
# - an int equal to 1 becomes the constant 1; any other int is typed i32 when it fits
#   [-2**31, 2**31), else i64, else u64 (below 2**64), and keyed "D" when it is a multiple of 16;
# - a bool is u1 and a float fp32, neither keyed by value; None is a constant.
# - a host tensor descriptor is keyed by its base's dtype and block shape (a Gluon one also by
#   its layout), not by its pointer.
ONE_ARG = [
    (ALIGNED, ALIGNED_TOO, False),  # both 16-byte aligned, other shapes and pointers
    (ALIGNED, UNALIGNED, True),  # a view 4 bytes in
    (ALIGNED, ALIGNED.to(torch.bfloat16), True),
    (ALIGNED, ALIGNED.view(torch.int32), True),
    (2, 3, False),
    (1, 2, True),  # 1 is a constant
    (16, 32, False),
    (16, 17, True),
    (-16, 48, False),
    (2**31 - 16, 2**31, True),  # i32 vs i64, both multiples of 16
    (2**31, 2**40, False),
    (2**31, 2**31 + 1, True),
    (2**62, 2**63, True),  # i64 vs u64
    (True, False, False),
    (True, 1, True),
    (0.5, 2.0, False),
    (None, None, False),
    (desc(ALIGNED, [64, 32]), desc(UNALIGNED, [64, 32]), False),
    (desc(ALIGNED, [64, 32]), desc(ALIGNED, [32, 64]), True),
    (desc(ALIGNED, [64, 32]), desc(ALIGNED.to(torch.bfloat16), [64, 32]), True),
    (desc(ALIGNED, [64, 32]), desc(ALIGNED, [64, 32], layout=object()), True),
]


@pytest.mark.parametrize("a, b, apart", ONE_ARG, ids=range(len(ONE_ARG)))
def test_key_separates_what_triton_compiles_apart(a, b, apart):
    """One argument in the middle of others: the keys differ exactly where Triton's would."""
    ka = specialization_key([ALIGNED, a, 7])
    kb = specialization_key([ALIGNED, b, 7])
    assert (ka != kb) is apart, (ka, kb)
    hash(ka)


# position 1 in ``do_not_specialize``: Triton keeps only the type (no constant 1, no "D");
# in ``do_not_specialize_on_alignment``: the constant 1 stays, "D" goes
UNSPECIALIZED = [
    ("do_not_specialize", 1, 2, False),
    ("do_not_specialize", 16, 17, False),
    ("do_not_specialize", 16, 2**31, True),
    ("do_not_specialize", ALIGNED, UNALIGNED, False),
    ("do_not_specialize_on_alignment", 1, 2, True),
    ("do_not_specialize_on_alignment", 16, 17, False),
    ("do_not_specialize_on_alignment", ALIGNED, UNALIGNED, False),
    ("do_not_specialize_on_alignment", ALIGNED, ALIGNED.to(torch.bfloat16), True),
]


@pytest.mark.parametrize("rule, a, b, apart", UNSPECIALIZED, ids=range(len(UNSPECIALIZED)))
def test_key_follows_do_not_specialize(rule, a, b, apart):
    rules = position_rules(2, **{rule: frozenset({1})})
    ka = specialization_key([ALIGNED, a], rules)
    kb = specialization_key([ALIGNED, b], rules)
    assert (ka != kb) is apart, (ka, kb)
    # the other positions keep their rules
    assert specialization_key([UNALIGNED, a], rules) != ka


def test_constexprs_are_keyed_by_value_and_objects_by_identity():
    """A constexpr is compiled in: every value is its own kernel (Triton keys it by value;
    here an object such as a ``tl.dtype`` or a Gluon layout by identity, which is finer)."""

    def key(value):
        return specialization_key([value], position_rules(1, constexpr=frozenset({0})))

    assert key(64) != key(128)
    assert key(64) == key(64)
    assert key(True) != key(1)
    assert key(True) != key(False)
    one, other = object(), object()
    assert key(one) == key(one)
    assert key(one) != key(other)


def test_arguments_the_rules_do_not_cover_have_no_key():
    assert specialization_key([ALIGNED, (1, 2)]) is None
    assert specialization_key([ALIGNED, [ALIGNED]]) is None
    assert specialization_key([2**64]) is None  # Triton raises OverflowError: let it


# ---- the launcher, with stand-ins for a JIT function, its compiled kernel and the runtime ----


class FakeCompiled:
    def __init__(self, log, n):
        self.function, self.packed_metadata = f"function{n}", f"metadata{n}"
        self.run = lambda *a: log.append(("fast", a))


class FakeJit:
    """``kernel[grid](...)`` logs the call and returns a new compiled kernel each time."""

    def __init__(self, names, constexpr=(), defaults=None, compiled=True):
        defaults = defaults or {}
        self.params = [
            types.SimpleNamespace(
                name=n,
                is_constexpr=n in constexpr,
                do_not_specialize=False,
                do_not_specialize_on_alignment=False,
                has_default=n in defaults,
                default=defaults.get(n),
            )
            for n in names
        ]
        self.pre_run_hooks, self.log, self.compiled = [], [], compiled

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log, len(self.log)) if self.compiled else None

        return launch


class Bare:
    __getitem__ = FakeJit.__getitem__

    def __init__(self):
        self.log, self.compiled = [], True


class FakeEnv:
    def __init__(self):
        self.dev, self.hook, self.debug_on = 0, False, False

    def device(self):
        return self.dev

    def stream(self, device):
        return 1000 + device

    def hooked(self):
        return self.hook

    def debug(self):
        return self.debug_on


def launcher(**kw):
    fn = FakeJit(["x", "n", "BLOCK", "FLAG"], constexpr=("BLOCK", "FLAG"), **kw)
    env = FakeEnv()
    return fn, env, CheapLauncher(fn, env=lambda: env)


def kinds(fn):
    kinds = [entry[0] for entry in fn.log]
    fn.log.clear()
    return kinds


def test_second_call_runs_the_cached_kernel_with_the_arguments_in_signature_order():
    """``JITFunction.run``'s own last call: grid padded to three dims, the current stream, the
    kernel's function and packed metadata, no launch metadata or hooks, then every argument
    in signature order (constexprs given as keywords included); options are not arguments."""
    fn, env, launch = launcher()
    launch[(3,)](ALIGNED, 5, FLAG=True, BLOCK=64, num_warps=4)
    assert fn.log == [("triton", (3,), (ALIGNED, 5), dict(FLAG=True, BLOCK=64, num_warps=4))]
    fn.log.clear()
    launch[(7, 2)](ALIGNED_TOO, 6, FLAG=True, BLOCK=64, num_warps=4)
    fast = (7, 2, 1, 1000, "function1", "metadata1", None, None, None, ALIGNED_TOO, 6, 64, True)
    assert fn.log == [("fast", fast)]


def test_a_new_specialization_goes_through_triton_once():
    fn, env, launch = launcher()
    base = dict(BLOCK=64, FLAG=False, num_warps=4)
    launch[(1,)](ALIGNED, 5, **base)
    assert kinds(fn) == ["triton"]
    for args, kwargs in [
        ((UNALIGNED, 5), base),  # pointer alignment
        ((ALIGNED, 16), base),  # a multiple of 16
        ((ALIGNED, 1), base),  # the constant 1
        ((ALIGNED, 2**31 + 3), base),  # i64
        ((ALIGNED.to(torch.bfloat16), 5), base),  # dtype
        ((ALIGNED, 5), dict(base, BLOCK=128)),  # a constexpr
        ((ALIGNED, 5), dict(base, num_warps=8)),  # a launch option
    ]:
        launch[(1,)](*args, **kwargs)
        launch[(1,)](*args, **kwargs)
        assert kinds(fn) == ["triton", "fast"], (args, kwargs)
    env.dev = 1  # another device: compiled there again, launched on its stream
    launch[(1,)](ALIGNED, 5, **base)
    launch[(1,)](ALIGNED, 5, **base)
    assert [e[0] for e in fn.log] == ["triton", "fast"] and fn.log[1][1][3] == 1001
    fn.log.clear()
    env.debug_on = True  # Triton's debug knob is part of its cache key
    launch[(1,)](ALIGNED, 5, **base)
    assert kinds(fn) == ["triton"]


def test_hooks_and_unknown_internals_launch_through_triton_every_time():
    fn, env, launch = launcher()
    launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False)
    kinds(fn)
    env.hook = True  # a profiler's launch hook must see every launch
    launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False)
    assert kinds(fn) == ["triton"]
    env.hook = False
    fn.pre_run_hooks.append(print)
    launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False)
    assert kinds(fn) == ["triton"]
    fn.pre_run_hooks.clear()
    with through_triton():
        launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False)
    launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False)
    assert kinds(fn) == ["triton", "fast"]
    launch[(1,)](ALIGNED, (1, 2), BLOCK=64, FLAG=False)  # an argument the key does not cover
    launch[(1,)](ALIGNED, (1, 2), BLOCK=64, FLAG=False)
    assert kinds(fn) == ["triton", "triton"]

    for _ in range(2):  # an option the key does not cover
        launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False, extern_libs={"lib": "path"})
    assert kinds(fn) == ["triton", "triton"]

    interpreted, env, launch = launcher(compiled=False)  # kernel[grid] returned no kernel
    for _ in range(2):
        launch[(1,)](ALIGNED, 5, BLOCK=64, FLAG=False)
    assert kinds(interpreted) == ["triton", "triton"]
    bare = Bare()  # no ``params``: not the JITFunction it was written for
    never = CheapLauncher(bare, env=FakeEnv)
    for _ in range(2):
        never[(1,)](ALIGNED)
    assert kinds(bare) == ["triton", "triton"]


def test_defaults_fill_missing_arguments():
    fn = FakeJit(["x", "BLOCK"], constexpr=("BLOCK",), defaults={"BLOCK": 32})
    env = FakeEnv()
    launch = CheapLauncher(fn, env=lambda: env)
    launch[(1,)](ALIGNED)
    launch[(1,)](ALIGNED)
    assert fn.log[1][1][9:] == (ALIGNED, 32)
    fn.log.clear()
    launch[(1,)](ALIGNED, 32, 5)  # one argument too many: Triton's error, not ours
    assert kinds(fn) == ["triton"]


class Layout:
    """A constexpr object keyed by identity."""


def test_a_cached_kernel_keeps_the_constexpr_objects_its_key_names_by_identity():
    """The key names a constexpr object (a ``tl.dtype``, a Gluon layout) by ``id``: the cache
    keeps the object alive, so no later object can take its id and launch a kernel compiled
    for another."""
    fn = FakeJit(["x", "LAYOUT"], constexpr=("LAYOUT",))
    env = FakeEnv()
    launch = CheapLauncher(fn, env=lambda: env)
    layout = Layout()
    alive = weakref.ref(layout)
    launch[(1,)](ALIGNED, layout)
    launch[(1,)](ALIGNED, layout)
    assert kinds(fn) == ["triton", "fast"]
    del layout
    gc.collect()
    assert alive() is not None
    launch[(1,)](ALIGNED, Layout())  # another object: compiled apart
    assert kinds(fn) == ["triton"]


def test_each_tuple_of_argument_types_gets_its_own_kernel():
    """A position that takes a tensor on one call and None on the next (an optional bias):
    each is compiled once and then launched from the cache, whichever came last."""
    fn, env, launch = launcher()
    for _ in range(2):
        for n in (5, None, 5.0):
            launch[(1,)](ALIGNED, n, BLOCK=64, FLAG=False)
    assert kinds(fn) == ["triton", "triton", "triton", "fast", "fast", "fast"]
    assert len(launch._plans) == 3


# ---- on a GPU: the cached launch against kernel[grid], kernel by kernel ----

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")


class Counting:
    """Stands in for a launcher's JIT function: counts the launches through ``kernel[grid]``."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __getitem__(self, grid):
        self.calls += 1
        return self.fn[grid]


def bits(tensors):
    return [t.reshape(-1).view(torch.uint8) for t in tensors if t is not None]


def fast_equals_triton(monkeypatch, launchers, run):
    """``run()`` (returning tensors) through the cached kernels, then through ``kernel[grid]``:
    the same bits, and the first run never went through ``kernel[grid]``."""
    run()  # compiles and caches
    counters = [Counting(launch.fn) for launch in launchers]
    for launch, counter in zip(launchers, counters):
        monkeypatch.setattr(launch, "fn", counter)
    fast = bits(run())
    assert [c.calls for c in counters] == [0] * len(counters)
    with through_triton():
        slow = bits(run())
    assert all(c.calls > 0 for c in counters)
    torch.cuda.synchronize()
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def unaligned(rows, cols, dtype, seed):
    """A contiguous (rows, cols) view 2 bytes (one 16-bit element) into its storage."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randn(rows * cols + 1, generator=g, device="cuda").to(dtype)
    x = buf[1:].view(rows, cols)
    assert x.data_ptr() % 16
    return x


@gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("offset", [False, True])
def test_fp8_tensor_quantise_fast_path_is_bit_identical(monkeypatch, transposed, offset):
    """Both fp8-tensor kernels (amax, cast); 1000 x 48 is a multiple of neither kernel's block."""
    import aligndp.lowp.fp8_tensor_kernels as fk

    x = unaligned(1000, 48, torch.bfloat16, 0) if offset else torch.randn(1000, 48, device="cuda")
    fast_equals_triton(
        monkeypatch,
        [fk._amax, fk._cast],
        lambda: fk.quantize_per_tensor(x, transposed=transposed),
    )


def has_gluon() -> bool:
    from aligndp.lowp.triton_common import _gluon

    return _gluon is not None and torch.cuda.get_device_capability() == (9, 0)


QUANTISE = [  # (impl, MX or 1x128, shape): 352 x 224 is not a multiple of the 64-wide tiles
    ("triton", True, (352, 224)),
    ("triton", False, (384, 640)),
    ("gluon", True, (352, 224)),
    ("gluon", False, (384, 640)),
]


@gpu
@pytest.mark.parametrize("impl, mx, shape", QUANTISE)
def test_row_column_quantise_fast_path_is_bit_identical(monkeypatch, impl, mx, shape):
    """The plain-Triton quantise (also from an unaligned input) and the Gluon one, MXFP8
    (1x32, E8M0) and 1x128 (float32 scales)."""
    from aligndp.lowp.recipe import ScaleFormat
    from aligndp.lowp.triton_kernels import quantize_rows_and_columns

    if impl == "gluon":
        if not has_gluon():
            pytest.skip("the Gluon kernels run on sm_90 with Triton's Gluon")
        import aligndp.lowp.gluon_quantize as module
    else:
        import aligndp.lowp.triton_quantize as module
    block = 32 if mx else 128
    fmt = ScaleFormat.E8M0 if mx else ScaleFormat.FP32
    inputs = [torch.randn(*shape, device="cuda", dtype=torch.bfloat16)]
    if impl == "triton":
        inputs.append(unaligned(*shape, torch.bfloat16, 1))
    for x in inputs:
        for rowwise, colwise in [(True, True), (True, False), (False, True)]:

            def run(x=x, rowwise=rowwise, colwise=colwise):
                pairs = quantize_rows_and_columns(
                    x, block=block, scale_format=fmt, impl=impl, rowwise=rowwise, colwise=colwise
                )
                return [t for op in pairs if op is not None for t in op]

            fast_equals_triton(monkeypatch, [module._quantize], run)
            monkeypatch.undo()


GEMMS = [  # (impl, block, M, N, K); MXFP8's N and K are not multiples of the bf16 GEMM's tiles
    ("mx", 32, 256, 192, 352),
    ("triton", 128, 384, 256, 384),
    ("gluon", 128, 256, 384, 512),
]


@gpu
@pytest.mark.parametrize("impl, block, m, n, k", GEMMS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_fast_path_is_bit_identical(monkeypatch, impl, block, m, n, k, accumulate):
    """The MXFP8 dequantise + bf16 GEMM, the plain-Triton 1x128 GEMM and the Gluon one."""
    import aligndp.lowp.triton_gemm as tg
    from aligndp.lowp.recipe import ScaleFormat
    from aligndp.lowp.triton_kernels import quantize_rows_and_columns, scaled_gemm

    fmt = ScaleFormat.E8M0 if impl == "mx" else ScaleFormat.FP32
    if impl == "gluon":
        if not has_gluon():
            pytest.skip("the Gluon kernels run on sm_90 with Triton's Gluon")
        import aligndp.lowp.gluon_gemm as gg

        launchers = [gg._gemm]
    else:
        launchers = [tg._mx_dequant, tg._bf16_gemm] if impl == "mx" else [tg._fp8_block_gemm]
    g = torch.Generator(device="cuda").manual_seed(3)
    a, b = (
        quantize_rows_and_columns(
            torch.randn(rows, k, generator=g, device="cuda"),
            block=block,
            scale_format=fmt,
            colwise=False,
        )[0]
        for rows in (m, n)
    )
    old = torch.randn(m, n, generator=g, device="cuda")

    def run():
        out = old.clone()
        gemm_impl = "auto" if impl == "mx" else impl
        scaled_gemm(a, b, out, block=block, scale_format=fmt, accumulate=accumulate, impl=gemm_impl)
        return [out]

    fast_equals_triton(monkeypatch, launchers, run)


@gpu
def test_an_active_launch_hook_sees_every_launch(monkeypatch):
    """With a launch-enter hook set (a profiler's), every launch goes through ``kernel[grid]``,
    the hook sees both quantise kernels, and the result is the fast path's."""
    from triton import knobs

    import aligndp.lowp.fp8_tensor_kernels as fk

    x = torch.randn(768, 768, device="cuda", dtype=torch.bfloat16)
    fast = bits(fk.quantize_per_tensor(x, transposed=True))
    seen = []

    def hook(metadata):
        seen.append(metadata)

    counters = [Counting(launch.fn) for launch in (fk._amax, fk._cast)]
    for launch, counter in zip((fk._amax, fk._cast), counters):
        monkeypatch.setattr(launch, "fn", counter)
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):  # a Triton whose hook slot holds one callable
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
        hooked = bits(fk.quantize_per_tensor(x, transposed=True))
    else:  # Triton 3.6: a HookChain
        chain.add(hook)
        try:
            hooked = bits(fk.quantize_per_tensor(x, transposed=True))
        finally:
            chain.remove(hook)
    assert [c.calls for c in counters] == [1, 1]
    assert len(seen) == 2
    for a, b in zip(fast, hooked):
        assert torch.equal(a, b)
