"""MXFP8 quantisation against torchao 0.18 ``to_mx`` (FLOOR) and hand-worked OCP examples.

See [Note: MXFP8 format] in ``aligndp/lowp/mx_format.py`` for where we deliberately differ. The
hand-worked cases need no torchao and run without it; only the torchao comparisons skip.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aligndp.lowp import MXTensor, dequantize_mxfp8, quantize_mxfp8
from aligndp.lowp.mx_format import ELEMENT_FORMATS

try:
    import torchao.prototype.mx_formats.mx_tensor as torchao_mx
except ImportError:  # the hand-worked cases still run
    torchao_mx = None
NEEDS_TORCHAO = pytest.mark.skipif(torchao_mx is None, reason="torchao is not importable")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BOTH = pytest.mark.parametrize("elem", [E4M3, E5M2], ids=["e4m3", "e5m2"])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def torchao_pair(x: torch.Tensor, elem: torch.dtype, block_size: int = 32) -> MXTensor:
    scale, data = torchao_mx.to_mx(x.contiguous(), elem, block_size)
    return MXTensor(data, scale)


def assert_bit_exact(x: torch.Tensor, elem: torch.dtype, block_size: int = 32) -> None:
    ours, ref = (
        quantize_mxfp8(x, elem_dtype=elem, block_size=block_size),
        torchao_pair(x, elem, block_size),
    )
    assert torch.equal(bits(ours.scale), bits(ref.scale))
    assert torch.equal(bits(ours.data), bits(ref.data))


def also_bit_exact_with_torchao(x: torch.Tensor, elem: torch.dtype) -> None:
    """The torchao comparison of a hand-worked case; the hand-worked asserts run without it."""
    if torchao_mx is not None:
        assert_bit_exact(x, elem)


def tiny_threshold(elem: torch.dtype) -> float:
    """Blocks with amax below this get scale byte 0, where we differ from torchao on purpose."""
    return 2.0 ** (ELEMENT_FORMATS[elem].emax - 126)


@NEEDS_TORCHAO
@BOTH
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (4, 3, 64), (128, 512)])
def test_random_normal_bit_exact(elem, dtype, shape):
    g = torch.Generator().manual_seed(hash((str(elem), str(dtype), shape)) % 2**31)
    assert_bit_exact(torch.randn(shape, generator=g).to(dtype), elem)


@NEEDS_TORCHAO
@BOTH
def test_magnitude_sweep_bit_exact(elem):
    """Every block gets its own power-of-two magnitude, from just above the tiny threshold
    to near the float32 max, plus heavy-tailed data so the elements span fp8 subnormals."""
    low = ELEMENT_FORMATS[elem].emax - 126 + 1
    exps = torch.arange(low, 126)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(exps), 32, generator=g) * torch.exp2(exps.float())[:, None]
    x = x * torch.exp2(
        torch.randint(-12, 1, x.shape, generator=g).float()
    )  # elements far below amax
    x[:, 0] = torch.exp2(exps.float() + 0.5)  # pin the block max
    assert_bit_exact(x, elem)
    assert_bit_exact(x.bfloat16(), elem)


@NEEDS_TORCHAO
@BOTH
def test_boundary_of_tiny_blocks_is_bit_exact(elem):
    """amax in [2**(emax-126), 2**(emax-125)) gets scale byte 1: still exactly torchao."""
    base = tiny_threshold(elem)
    x = torch.linspace(1.0, 1.99, 64).reshape(2, 32) * base
    ours = quantize_mxfp8(x, elem_dtype=elem)
    assert bits(ours.scale).tolist() == [[1], [1]]
    assert_bit_exact(x, elem)


@NEEDS_TORCHAO
@BOTH
def test_tiny_blocks_deliberately_differ_from_torchao(elem):
    """Deliberate difference: torchao encodes scale-byte-0 blocks with 2**-126 but stores
    2**-127, so its round trip halves them. We encode with the 2**-127 we store."""
    x = torch.linspace(0.25, 1.0, 32).reshape(1, 32) * tiny_threshold(elem) / 2  # amax < threshold
    ours, ref = quantize_mxfp8(x, elem_dtype=elem), torchao_pair(x, elem)
    assert bits(ours.scale).tolist() == bits(ref.scale).tolist() == [[0]]
    # twice torchao's elements, each rounded once more to a 3-bit mantissa: 2**-4 relative
    torch.testing.assert_close(ours.data.float(), 2 * ref.data.float(), rtol=2**-4 + 2**-6, atol=0)
    ours_err = (dequantize_mxfp8(ours) - x).abs().max()
    ref_err = (torchao_mx.to_dtype(ref.data, ref.scale, elem, 32, torch.float32) - x).abs().max()
    assert ours_err <= x.abs().max() * 2.0**-3 < ref_err


@BOTH
def test_all_zero_blocks(elem):
    x = torch.zeros(3, 64)
    x[1, 32:] = torch.randn(32)
    ours = quantize_mxfp8(x, elem_dtype=elem)
    assert bits(ours.scale)[0].tolist() == [0, 0] and bits(ours.scale)[1, 0] == 0
    assert not ours.data.float()[0].any()
    assert torch.equal(dequantize_mxfp8(ours)[0], x[0])
    also_bit_exact_with_torchao(x, elem)


def test_hand_worked_ocp_examples():
    """amax 3.0: e = floor(log2 3) - 8 = -7 (byte 120); 3.0 -> 384, 0.1 -> 12.8 -> 13 (RNE,
    spacing 1 in [8, 16)), 1.0 -> 128. E5M2: amax 1.0 -> e = -15 (byte 112), 1.0 -> 32768."""
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([3.0, 0.1, -1.0])
    mx = quantize_mxfp8(x)
    assert bits(mx.scale).item() == 120
    assert mx.data.float()[0, :3].tolist() == [384.0, 13.0, -128.0]
    assert dequantize_mxfp8(mx)[0, :3].tolist() == [3.0, 13 / 128, -1.0]
    y = torch.zeros(1, 32)
    y[0, 0] = 1.0
    mx5 = quantize_mxfp8(y, elem_dtype=E5M2)
    assert bits(mx5.scale).item() == 112 and mx5.data.float()[0, 0].item() == 32768.0


# (amax of the block, element type, scale byte): byte = floor(log2(amax)) - emax + 127, by hand.
# Round-to-nearest (or ceil) of log2(amax) gives the next byte wherever the mantissa of amax
# is >= 1.5 (1.5, 1.99, 3.0, 3.99, 0.75, 511, 1e-3, 1.9, 57344, 0.3).
FLOOR_CASES = [
    (1.0, E4M3, 119),
    (1.5, E4M3, 119),
    (1.99, E4M3, 119),
    (2.0, E4M3, 120),
    (3.0, E4M3, 120),
    (3.99, E4M3, 120),
    (0.75, E4M3, 118),
    (448.0, E4M3, 127),
    (511.0, E4M3, 127),
    (512.0, E4M3, 128),
    (2.0**-10, E4M3, 109),
    (1e-3, E4M3, 109),
    (1.0, E5M2, 112),
    (1.9, E5M2, 112),
    (2.0, E5M2, 113),
    (57344.0, E5M2, 127),
    (0.3, E5M2, 110),
]


@pytest.mark.parametrize("amax, elem, byte", FLOOR_CASES)
def test_scale_is_floor_of_log2_amax_hand_worked(amax, elem, byte):
    """OCP MX v1.0 6.3: the shared exponent is FLOOR(log2(amax)) - emax_elem; no torchao needed."""
    x = torch.zeros(2, 32)
    x[0, 5] = amax
    x[1, 7] = -amax
    assert bits(quantize_mxfp8(x, elem_dtype=elem).scale).tolist() == [[byte], [byte]]


def test_floor_scale_saturates_the_block_max_hand_worked():
    """amax 1.99 -> scale 2**-8 (FLOOR): 1.99 * 256 = 509.4 saturates to 448 and 0.5 -> 128,
    so the round trip gives [1.75, 0.5]. (Round-to-nearest would pick 2**-7: 254.7 -> 256.)"""
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.99, 0.5])
    mx = quantize_mxfp8(x)
    assert bits(mx.scale).item() == 119
    assert mx.data.float()[0, :2].tolist() == [448.0, 128.0]
    assert dequantize_mxfp8(mx)[0, :2].tolist() == [1.75, 0.5]


def test_ties_round_to_nearest_even():
    """amax 1.0 -> scale 2**-8, so element v maps to 256 v. In [256, 512) E4M3 steps by 32:
    272 (tie 256/288) -> 256, 304 (tie 288/320) -> 320; in [16, 32) steps by 2: 17 -> 16, 19 -> 20;
    subnormals step by 2**-9: 2**-10 (tie 0 / 2**-9) -> 0, 3 * 2**-10 -> 2**-8."""
    scaled = [256.0, 272.0, 304.0, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10]
    expected = [256.0, 256.0, 320.0, 16.0, 20.0, 0.0, 2.0**-8]
    x = torch.zeros(1, 32)
    x[0, : len(scaled)] = torch.tensor(scaled) / 256
    mx = quantize_mxfp8(x)
    assert mx.data.float()[0, : len(scaled)].tolist() == expected
    also_bit_exact_with_torchao(x, E4M3)
    also_bit_exact_with_torchao(-x, E4M3)


@BOTH
def test_saturation(elem):
    """FLOOR puts amax in [2**emax, 2**(emax+1)); above the element max it saturates."""
    fmt = ELEMENT_FORMATS[elem]
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([1.0, -1.0]) * (2.0 ** (fmt.emax + 1) - 1)  # 511 (E4M3), 65535 (E5M2)
    mx = quantize_mxfp8(x, elem_dtype=elem)
    assert bits(mx.scale).item() == 127
    assert mx.data.float()[0, :2].tolist() == [fmt.max, -fmt.max]
    also_bit_exact_with_torchao(x * 2.0**40, elem)


@NEEDS_TORCHAO
@BOTH
def test_nan_blocks_match_torchao(elem):
    x = torch.randn(2, 64)
    x[0, 5] = float("nan")
    ours, ref = quantize_mxfp8(x, elem_dtype=elem), torchao_pair(x, elem)
    assert torch.equal(bits(ours.scale), bits(ref.scale)) and bits(ours.scale)[0, 0] == 255
    assert torch.equal(ours.data.float().isnan(), ref.data.float().isnan())
    assert torch.equal(ours.data.float().nan_to_num(), ref.data.float().nan_to_num())
    out = dequantize_mxfp8(ours)
    assert out[0, :32].isnan().all() and not out[0, 32:].isnan().any() and not out[1].isnan().any()


@NEEDS_TORCHAO
@BOTH
def test_inf_blocks_deliberately_become_nan(elem):
    """Deliberate difference: torchao saturates +-inf to +-max (scale 2**(128 - emax)),
    hiding an overflow; per the OCP spec a block whose log2(amax) is out of range gets a NaN
    scale."""
    x = torch.randn(1, 64)
    x[0, 40] = float("inf")
    ours, ref = quantize_mxfp8(x, elem_dtype=elem), torchao_pair(x, elem)
    assert bits(ours.scale).tolist() == [[bits(ref.scale)[0, 0].item(), 255]]
    assert bits(ref.scale)[0, 1].item() != 255
    assert dequantize_mxfp8(ours)[0, 32:].isnan().all()
    assert torch.equal(bits(ours.data)[0, :32], bits(ref.data)[0, :32])


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_dim_is_transpose_of_last_dim(dim):
    x = torch.randn(64, 96)
    mx = quantize_mxfp8(x, dim=dim)
    along = dim % 2
    ref = quantize_mxfp8(x.movedim(along, -1).contiguous())
    assert mx.data.shape == x.shape and mx.scale.shape[along] == x.shape[along] // 32
    assert torch.equal(bits(mx.data), bits(ref.data.movedim(-1, along)))
    assert torch.equal(bits(mx.scale), bits(ref.scale.movedim(-1, along)))
    torch.testing.assert_close(
        dequantize_mxfp8(mx, dim=dim), dequantize_mxfp8(ref).movedim(-1, along)
    )


def test_round_trip_error_bound():
    """E4M3 keeps 3 mantissa bits: relative error <= 2**-4 for elements not far below amax,
    except the FLOOR rule's saturation of [448, 512) x scale to 448 (error < 2**-3)."""
    x = torch.randn(256, 64, dtype=torch.float64).float()
    out = dequantize_mxfp8(quantize_mxfp8(x))
    blocks_amax = x.abs().reshape(256, 2, 32).amax(-1).repeat_interleave(32, -1)
    big = x.abs() >= blocks_amax * 2.0**-6
    saturated = x.abs() > 448 * torch.exp2(torch.floor(torch.log2(blocks_amax)) - 8)
    assert ((out - x).abs() <= x.abs() * 2.0**-4)[big & ~saturated].all()
    assert ((out - x).abs() < x.abs() * 2.0**-3)[saturated].all() and saturated.any()
    assert ((out - x).abs() <= blocks_amax * 2.0**-9)[~big].all()
    assert dequantize_mxfp8(quantize_mxfp8(x), dtype=torch.bfloat16).dtype == torch.bfloat16


@NEEDS_TORCHAO
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 4),
    blocks=st.integers(1, 3),
    # exp_lo + spread <= 125 keeps |randn| * 2**e finite: an infinity is where we differ from
    # torchao on purpose (NaN scale, tested on its own), not a property of normal data
    exp_lo=st.integers(-100, 95),
    spread=st.integers(0, 30),
    seed=st.integers(0, 2**31 - 1),
    e5m2=st.booleans(),
    bf16=st.booleans(),
)
def test_property_bit_exact(rows, blocks, exp_lo, spread, seed, e5m2, bf16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32 * blocks, generator=g)
    x = x * torch.exp2(torch.randint(exp_lo, exp_lo + spread + 1, x.shape, generator=g).float())
    elem = E5M2 if e5m2 else E4M3
    assert_bit_exact(x.bfloat16() if bf16 else x, elem)


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="pad it with zeros to 64"):
        quantize_mxfp8(torch.randn(4, 40))
    with pytest.raises(ValueError, match="pad it with zeros to 32"):
        quantize_mxfp8(torch.randn(20, 64), dim=0)
    for bad in (torch.ones(2, 32, dtype=torch.int32), torch.ones(2, 32, dtype=torch.float64)):
        with pytest.raises(ValueError, match="x.float()"):
            quantize_mxfp8(bad)
        with pytest.raises(TypeError):
            quantize_mxfp8(bad)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quantize_mxfp8(torch.randn(2, 32), elem_dtype=torch.float16)
    with pytest.raises(ValueError, match="out of range"):
        quantize_mxfp8(torch.randn(2, 32), dim=2)
    with pytest.raises(ValueError, match="block_size"):
        quantize_mxfp8(torch.randn(2, 32), block_size=0)
    with pytest.raises(ValueError, match="0-d"):
        quantize_mxfp8(torch.tensor(1.0))
    mx = quantize_mxfp8(torch.randn(64, 64), dim=0)
    with pytest.raises(ValueError, match="pass the dim used to quantise"):
        dequantize_mxfp8(mx, dim=1)
    with pytest.raises(TypeError, match="quantize_mxfp8"):
        dequantize_mxfp8(MXTensor(torch.randn(2, 32), mx.scale))
    assert math.isclose(
        dequantize_mxfp8(quantize_mxfp8(torch.full((1, 32), 2.0)))[0, 0].item(), 2.0
    )


def test_fp8_1x128_inverse_scale_is_one_correctly_rounded_division():
    """The kernels scale a block by ``div_rn(448, amax)``: the quotient rounded once to float32.
    The reference takes it in float64 and rounds that to float32, the same number (float64
    carries well over twice float32's precision, so the second rounding is innocent). Each
    block holds its amax and 127 elements at midpoints between neighbouring E4M3 values
    (scaled by ``amax / 448``), where one ulp of the inverse decides which way an element
    rounds. Caught on the GPU: ``448 / amax`` in torch is ``amax.reciprocal() * 448``, rounded
    twice, and about 13 % of these elements then cast to another E4M3 than the kernels'."""
    from aligndp.lowp.fp8_blocks import quantize_blocks

    g = torch.Generator().manual_seed(3)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    grid = codes[codes.isfinite() & (codes >= 1)].unique()  # sorted, 1 ... 448
    midpoints = (grid[:-1] + grid[1:]) / 2
    amax = torch.rand(512, 1, generator=g, dtype=torch.float64) * 100 + 0.01
    picked = midpoints[torch.randint(len(midpoints), (512, 127), generator=g)].double()
    x = torch.cat([amax, picked * amax / 448], dim=1).float()  # (512, 128): one block per row
    inverse = (448.0 / x.abs().amax(-1, keepdim=True).double()).float()
    want = (x * inverse).clamp(-448, 448).to(E4M3)
    data, _ = quantize_blocks(x, 128)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))


def test_fp8_1x128_blocks_by_hand():
    """The ``fp8`` recipe's blocks (aligndp.lowp.fp8_blocks), hand-worked: a block whose amax
    is 896 has scale 2 and its elements halve, rounded to the nearest E4M3 (0.3 / 2 = 0.15 lies
    between 0.140625 and 0.15625, nearer the second); an all-zero block has scale 1; a block of
    amax 1e-37 takes its scale from the 1e-30 floor, so its zeros stay 0 (448 / 1e-37 would
    overflow and make them NaN). Column blocks of ``x.T`` are the same rule on the transpose,
    and both layouts are the kernels' (data (M, N), scales (N / 128, M), contiguous)."""
    from aligndp.lowp.fp8_blocks import quantize_blocks

    x = torch.zeros(2, 256)
    x[0, :4] = torch.tensor([-896.0, 1.0, 3.0, 0.3])
    x[1, 128] = 1e-37
    data, scale_t = quantize_blocks(x, 128)
    assert data.dtype == E4M3 and data.shape == (2, 256) and data.is_contiguous()
    assert scale_t.shape == (2, 2) and scale_t.is_contiguous()
    assert scale_t.tolist() == [[2.0, 1.0], [1.0, pytest.approx(1e-30 / 448, rel=1e-6)]]
    assert data[0, :4].float().tolist() == [-448.0, 0.5, 1.5, 0.15625]
    assert not data.float()[:, 4:].any() and data.float().isfinite().all()
    col_data, col_scale_t = quantize_blocks(x.T, 2)  # blocks of 2 along the 2 rows of x
    assert col_data.shape == (256, 2) and col_scale_t.shape == (1, 256)
    assert col_data.is_contiguous() and col_scale_t.is_contiguous()  # x.T is not
    assert torch.equal(col_scale_t[0, :3], torch.tensor([896.0, 1.0, 3.0]) / 448)  # float32
    assert col_data[:3, 0].float().tolist() == [-448.0, 448.0, 448.0]
