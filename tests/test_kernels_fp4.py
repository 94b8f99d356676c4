"""Emulated NVFP4 (kernels.fp4, kernels.fp4_linear's GEMMs): exact E2M1 encodings and packing, the two
scale levels, 2D weight blocks that survive a transpose, stochastic rounding that repeats from a
restored generator and only ever picks a neighbour, an exactly orthogonal Hadamard matrix, and the
emulated GEMMs against fp32 (a numerical comparison of two algorithms, stated as such)."""
import pytest
import torch

from megatron_bitdet.kernels import fp4 as q


def _x(seed=0, shape=(6, 70)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5


def _bytes(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_grid_values_encode_exactly_packed_low_nibble_first_ties_to_even():
    v = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -0.5, 0.25, 0.75, 2.5, 5, 1.25, 7]])
    t = q.quantize(v)
    assert t.values.dtype == torch.float4_e2m1fn_x2 and t.values.shape == (1, 8)
    assert t.block_scales.dtype == torch.float8_e4m3fn and t.block_scales.shape == (1, 1)
    # amax 7: s_enc = 6*448/7 = 384, block decode scale 7/6*384 = 448 -> e4m3 448: values / (448/384)
    assert float(t.global_scale) == 384.0 and float(t.block_scales.float()) == 448.0
    assert t.values.view(torch.uint8)[0, 0] == (0x1 << 4) | 0x0  # codes 0 (0.0), 1 (0.5)
    # ties: 0.25 -> 0 (even code 0), 0.75 -> 1 (code 2), 2.5 -> 2 (code 4), 5 -> 4 (code 6)
    amax_one = torch.tensor([[0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -0.5, 0.25, 0.75, 2.5, 5, 1.25, 6]])
    back = q.dequantize(q.quantize(amax_one), torch.float32)
    assert back.tolist() == [[0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -0.5, 0, 1, 2, 4, 1, 6]]


def test_blocks_of_16_and_16x16_weight_blocks_survive_a_transpose():
    x = _x()
    a = q.quantize(x)
    assert a.values.shape == (6, 40) and a.block_scales.shape == (6, 5)  # 70 padded to 5 blocks of 16
    w = _x(1, (40, 70))
    w2d = q.quantize(w, block=(16, 16))
    assert w2d.block_scales.shape == (3, 5)
    # one scale per 16x16 tile: the transpose quantized the same way is the same matrix (forward and
    # dgrad see one weight, the recipe's reason for 2D scaling)
    assert torch.equal(q.dequantize(w2d, torch.float32).t(), q.dequantize(q.quantize(w.t(), block=(16, 16)),
                                                                          torch.float32))
    # 1x16 blocks do not have that property
    assert not torch.equal(q.dequantize(q.quantize(w), torch.float32).t(),
                           q.dequantize(q.quantize(w.t()), torch.float32))


def test_stochastic_rounding_repeats_from_a_restored_generator_and_picks_a_neighbour():
    x = _x(2)
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    first = q.quantize(x, generator=g)
    second = q.quantize(x, generator=g)
    g.set_state(state)
    again = q.quantize(x, generator=g)
    assert _bytes(first.values) == _bytes(again.values) and _bytes(first.block_scales) == _bytes(again.block_scales)
    assert _bytes(first.values) != _bytes(second.values)  # the stream moved on
    nearest = q.dequantize(q.quantize(x), torch.float32)
    sr = q.dequantize(first, torch.float32)
    decode = (first.block_scales.float() / first.global_scale).repeat_interleave(16, 1)[:, :70]
    # E2M1 grid points are at most 2 apart: a stochastic result lies within one step of x (numerical bound)
    assert ((sr - x).abs() <= 2 * decode).all() and not torch.equal(sr, nearest)


def test_hadamard_matrix_is_exactly_orthogonal_and_keeps_the_product():
    signs = q.draw_signs(torch.Generator().manual_seed(0))
    assert set(signs.tolist()) == {-1.0, 1.0}
    m = q.hadamard_matrix(signs)
    assert torch.equal(m @ m.t(), torch.eye(16))  # entries +-1/4: exact in fp32
    a, b = _x(3, (5, 37)), _x(4, (7, 37))
    ta, tb = q.random_hadamard(a, signs), q.random_hadamard(b, signs)
    assert ta.shape == (5, 48)  # padding kept: transformed padding is not zero
    # numerical (two algorithms: transformed vs direct product), not a bitwise claim
    torch.testing.assert_close(ta @ tb.t(), a @ b.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("hadamard,two_d", [(True, True), (False, False)])
def test_emulated_gemms_repeat_bytewise_and_track_fp32(hadamard, two_d):
    from types import SimpleNamespace

    from megatron_bitdet.kernels.fp4_linear import _NVFP4GEMM

    fp4 = SimpleNamespace(stochastic_rounding=True, hadamard=hadamard, weight_2d_scaling=two_d)
    layer = SimpleNamespace(fp4=fp4, fp4_sr_generator=torch.Generator().manual_seed(3),
                            fp4_hadamard_signs=q.draw_signs(torch.Generator().manual_seed(0)))
    layer._encode_weight = lambda w: q.quantize(w, block=(16, 16) if two_d else (1, 16))
    x0, w0, dy = _x(5, (3, 20, 48)), _x(6, (40, 48)) / 5, _x(7, (3, 20, 40))
    state = layer.fp4_sr_generator.get_state()

    def run():
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = _NVFP4GEMM.apply(x, w, layer)
        out.backward(dy)
        return out, x.grad, w.grad

    first = run()
    layer.fp4_sr_generator.set_state(state)
    again = run()
    assert [_bytes(t) for t in first] == [_bytes(t) for t in again]
    assert _bytes(run()[2]) != _bytes(first[2])  # without the restore, stochastic rounding differs
    # numerical (NVFP4 vs fp32), not a bitwise claim: 4-bit operands keep the products' direction
    ref = (x0 @ w0.t(), dy @ w0, dy.reshape(-1, 40).t() @ x0.reshape(-1, 48))
    for got, want in zip(first, ref):
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cos > 0.95, float(cos)
