"""Emulated FP8 quantization (kernels.fp8) and the bf16 fault's rounding: exact encodings, repeatability
byte for byte, TE's delayed-scaling rule, and fingerprints that see one flipped bit in values or scales."""
import torch

from megatron_bitdet.fingerprint.tensor import fingerprint, fingerprint_blocked
from megatron_bitdet.kernels import fp8 as q
from megatron_bitdet.train.precision import bf16_toward_zero


def _x(seed=0, shape=(6, 70)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5


def test_blockwise_encoding_is_mx_style_and_repeats_bytewise():
    x = _x()
    a, b = q.quantize_blockwise(x, torch.float8_e4m3fn), q.quantize_blockwise(x.clone(), torch.float8_e4m3fn)
    assert a.data.dtype == torch.float8_e4m3fn and a.data.shape == (6, 96)  # 70 padded to 3 blocks of 32
    assert a.scales.dtype == torch.uint8 and a.scales.shape == (6, 3)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    # Each block's largest magnitude lands in the top binade of e4m3 (2**8 .. 2**9), saturating above 448.
    blocks = a.data.float().view(6, 3, 32).abs().amax(-1)
    assert ((blocks >= 256) & (blocks <= 448)).all()
    back = q.dequantize_blockwise(a, x.shape, x.dtype)
    # numeric bound (quantization error vs the input, not a bitwise claim): e4m3 keeps 3 mantissa bits,
    # for elements in the format's normal range and not saturated
    scaled = a.data.float()[:, :70]
    normal = (scaled.abs() >= 2**-6) & (scaled.abs() < 448)
    assert ((back - x).abs() <= x.abs() * 2**-4)[normal].all() and normal.float().mean() > 0.9


def test_tensorwise_roundtrip_and_delayed_scale_rule():
    x = _x(1)
    history = torch.tensor([0.0, 2.0, 8.0, 4.0])
    assert q.scale_from_history(history, torch.float8_e4m3fn, margin=0, algo="max") == 448.0 / 8.0
    assert q.scale_from_history(history, torch.float8_e4m3fn, margin=1, algo="most_recent") == 1.0  # history[0] = 0
    assert q.scale_from_history(history[1:], torch.float8_e5m2, margin=1, algo="most_recent") == 57344.0 / 2.0 / 2.0
    scale = q.scale_from_history(q.amax(x).view(1), torch.float8_e5m2, margin=0, algo="max")
    v = q.quantize_tensorwise(x, scale, torch.float8_e5m2)
    assert v.dtype == torch.float8_e5m2 and float(v.float().abs().max()) == 57344.0
    assert torch.equal(q.dequantize_tensorwise(v, scale, x.dtype), q.dequantize_tensorwise(v.clone(), scale, x.dtype))


def test_fingerprints_see_one_bit_in_values_or_scales():
    bt = q.quantize_blockwise(_x(2), torch.float8_e4m3fn)
    base = fingerprint_blocked(bt)
    flipped_values = bt.data.clone()
    flipped_values.view(torch.uint8)[0, 0] ^= 1
    flipped_scales = bt.scales.clone()
    flipped_scales[0, 0] ^= 1
    assert base.differs_in(fingerprint_blocked(q.BlockedTensor(flipped_values, bt.scales))) == ["values"]
    assert base.differs_in(fingerprint_blocked(q.BlockedTensor(bt.data, flipped_scales))) == ["scales"]
    assert fingerprint(bt.data).dtype == "float8_e4m3fn"


def test_straight_through_gradients_and_quantized_output_gradient():
    x = _x(3).requires_grad_()
    y = q.fake_quantize(x, lambda t: t.round())
    assert torch.equal(y, x.detach().round())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    z = _x(4).requires_grad_()
    q.quantize_grad(z * 1.0, lambda g: g * 0 + 3).sum().backward()
    assert torch.equal(z.grad, torch.full_like(z, 3.0))


def test_fault_rounding_is_toward_zero_not_nearest_even():
    x = torch.randn(10000, generator=torch.Generator().manual_seed(5))
    rz, rne = bf16_toward_zero(x), x.to(torch.bfloat16)
    assert rz.dtype == torch.bfloat16
    assert (rz.float().abs() <= x.abs()).all()
    assert 0.3 < float((rz != rne).float().mean()) < 0.7
