"""Pure-torch Mamba-2 kernels vs independent step-by-step references, and bitwise repeatability.

Tolerances are for comparing two different algorithms (chunked matmuls vs a per-step recurrence):
float64 inputs agree to 1e-10 (observed ~1e-14), float32 kernel vs float64 reference to 1e-4
(float32 epsilon ~1e-7 times O(100) accumulated terms). Repeatability checks are byte-exact.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.kernels.causal_conv1d import causal_conv1d_fn, ssd_split_conv1d_scan_combined
from megatron_bitdet.kernels.gated_rmsnorm import GatedRMSNorm, gated_rms_norm
from megatron_bitdet.kernels.ssd import UnsupportedKernelFeature, ssd_chunk_scan_combined

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def sequential_ssd(x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), initial_states=None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t ; y_t = C_t h_t + D x_t ; y *= silu(z). One step at a time."""
    b, l, h, p = x.shape
    r = h // B.shape[2]
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(*dt_limit)
    Bh, Ch = B.repeat_interleave(r, dim=2), C.repeat_interleave(r, dim=2)  # head i reads group i // r
    state = torch.zeros(b, h, p, B.shape[-1], dtype=x.dtype) if initial_states is None else initial_states
    ys = []
    for t in range(l):
        a = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = a * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * z * torch.sigmoid(z)
    return y, state


def make_inputs(seed, dtype, b=2, l=37, h=4, p=3, g=2, n=5, d_hdim=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    t = dict(
        x=r(b, l, h, p), dt=r(b, l, h) - 1.0, A=-torch.rand(h, generator=gen, dtype=torch.float64) * 2 - 0.1,
        B=r(b, l, g, n), C=r(b, l, g, n), D=r(h, p) if d_hdim else r(h), z=r(b, l, h, p), dt_bias=r(h) * 0.5,
        initial_states=r(b, h, p, n),
    )
    return {k: v.to(dtype) for k, v in t.items()}


CASES = [  # (seqlen, chunk_size, kwargs)
    (32, 8, dict(dt_softplus=True)),  # divisible
    (37, 8, dict(dt_softplus=True, initial_states=True)),  # not divisible, with initial state
    (37, 16, dict(dt_softplus=True, D=True, z=True, dt_bias=True)),
    (5, 16, dict(dt_softplus=True, D=True, dt_bias=True, dt_limit=(0.05, 0.5), initial_states=True)),  # l < chunk
    (50, 16, dict(dt_softplus=True, D=True, z=True, initial_states=True, d_hdim=True)),
    (37, 8, dict(dt_bias=True, D=True)),  # no softplus: negative dt is clamped at the default limit (0, inf)
]


def _args(inp, kw):
    """Select the optional tensors a case uses."""
    kw = dict(kw)
    kw.pop("d_hdim", None)
    out = {}
    for name in ("D", "z", "dt_bias", "initial_states"):
        if kw.pop(name, False):
            out[name] = inp[name]
    return {**out, **kw}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seqlen,chunk,kw", CASES)
def test_ssd_matches_sequential_recurrence(dtype, seqlen, chunk, kw):
    inp = make_inputs(seqlen + chunk, dtype, l=seqlen, d_hdim=kw.get("d_hdim", False))
    opt = _args(inp, kw)
    y, final = ssd_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk,
                                       return_final_states=True, **opt)
    ref_in = {k: v.double() for k, v in inp.items()}
    ref_y, ref_final = sequential_ssd(ref_in["x"], ref_in["dt"], ref_in["A"], ref_in["B"], ref_in["C"],
                                      **_args(ref_in, kw))
    assert y.dtype == dtype and y.shape == inp["x"].shape and final.shape == ref_final.shape
    torch.testing.assert_close(y.double(), ref_y, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(final.double(), ref_final, atol=TOL[dtype], rtol=TOL[dtype])


def _ssd_grads(inp, chunk, kw):
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    y, final = ssd_chunk_scan_combined(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
                                       return_final_states=True, **_args(leaves, kw))
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)  # non-uniform upstream gradient
    ((y * w).sum() + final.square().sum()).backward()
    return y, final, {k: v.grad for k, v in leaves.items() if v.grad is not None}


def test_ssd_backward_matches_sequential_recurrence():
    kw = dict(dt_softplus=True, D=True, z=True, dt_bias=True, initial_states=True)
    inp = make_inputs(7, torch.float64, l=21)
    _, _, grads = _ssd_grads(inp, 8, kw)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inp.items()}
    y, final = sequential_ssd(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], **_args(leaves, kw))
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)
    ((y * w).sum() + final.square().sum()).backward()
    assert set(grads) == {"x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"}
    for name, g in grads.items():
        torch.testing.assert_close(g, leaves[name].grad, atol=1e-10, rtol=1e-10, msg=name)


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _bytes(t):
    return t.detach().contiguous().view(torch.uint8).flatten().tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_forward_backward_bitwise_repeatable(dtype):
    kw = dict(dt_softplus=True, D=True, z=True, dt_bias=True, initial_states=True)
    inp = make_inputs(11, dtype, b=2, l=100, h=8, p=16, g=2, n=16)
    with threads(2):
        runs = [_ssd_grads(inp, 32, kw) for _ in range(3)]
    first = runs[0]
    for y, final, grads in runs[1:]:
        assert _bytes(y) == _bytes(first[0]) and _bytes(final) == _bytes(first[1])
        assert grads.keys() == first[2].keys()
        for name in grads:
            assert _bytes(grads[name]) == _bytes(first[2][name]), name
    assert all(torch.isfinite(g.float()).all() for g in first[2].values())


def test_ssd_refuses_packed_sequences_and_bad_shapes():
    inp = make_inputs(3, torch.float32, l=8)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4)
    with pytest.raises(UnsupportedKernelFeature, match="packed sequences"):
        ssd_chunk_scan_combined(*args, seq_idx=torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(UnsupportedKernelFeature):
        ssd_chunk_scan_combined(*args, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(NotImplementedError):  # also catchable as the builtin kind
        ssd_chunk_scan_combined(*args, return_varlen_states=True)
    with pytest.raises(BitdetInputError, match="dt must be"):
        ssd_chunk_scan_combined(inp["x"], inp["dt"][:, :4], *args[2:])
    with pytest.raises(BitdetInputError, match="divisible by ngroups"):
        ssd_chunk_scan_combined(inp["x"][:, :, :3], inp["dt"][:, :, :3], inp["A"][:3], *args[3:])


def test_ssd_matches_mamba_ssm_minimal_reference():
    """Optional oracle: mamba_ssm's own pure-torch ssd_minimal_discrete (absent on CPU CI)."""
    minimal = pytest.importorskip("mamba_ssm.modules.ssd_minimal")
    inp = make_inputs(5, torch.float64, l=64, g=4)
    dt = F.softplus(inp["dt"])
    y = ssd_chunk_scan_combined(inp["x"], dt, inp["A"], inp["B"], inp["C"], 16)
    ref, _ = minimal.ssd_minimal_discrete(inp["x"] * dt[..., None], inp["A"] * dt, inp["B"], inp["C"], 16)
    torch.testing.assert_close(y, ref, atol=1e-10, rtol=1e-10)


# ---- gated RMSNorm ----------------------------------------------------------------------------

def formula_gated_rmsnorm(x, w, z, eps, group_size, norm_before_gate):
    """Straight from the definition, one group at a time, float64."""
    x, w, z = x.double(), w.double(), None if z is None else z.double()
    silu = None if z is None else z / (1 + torch.exp(-z))
    v = x * silu if (z is not None and not norm_before_gate) else x
    outs = []
    for s in range(0, x.shape[-1], group_size):
        part = v[..., s:s + group_size]
        outs.append(part / torch.sqrt((part * part).sum(-1, keepdim=True) / group_size + eps))
    out = torch.cat(outs, dim=-1) * w
    return out * silu if (z is not None and norm_before_gate) else out


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("group_size", [None, 6])
@pytest.mark.parametrize("with_z", [True, False])
def test_gated_rmsnorm_matches_formula(norm_before_gate, group_size, with_z):
    gen = torch.Generator().manual_seed(1)
    x, z = torch.randn(2, 3, 12, generator=gen), torch.randn(2, 3, 12, generator=gen)
    norm = GatedRMSNorm(12, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12, generator=gen))
    out = norm(x, z if with_z else None)
    ref = formula_gated_rmsnorm(x, norm.weight, z if with_z else None, 1e-5, group_size or 12, norm_before_gate)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)  # float32 compute vs float64 formula


def test_gated_rmsnorm_module_matches_mamba_mixer_usage():
    """The mixer builds it with (d, eps=1e-5, group_size=d // ngroups, norm_before_gate=False, device, dtype)."""
    norm = GatedRMSNorm(8, eps=1e-5, group_size=4, norm_before_gate=False, device="cpu", dtype=torch.bfloat16)
    assert list(norm.state_dict()) == ["weight"] and norm.bias is None
    assert norm.weight.dtype == torch.bfloat16 and bool((norm.weight == 1).all())
    y = torch.randn(5, 2, 8, dtype=torch.bfloat16)
    out = norm(y, torch.randn(5, 2, 8, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == y.shape
    x64 = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(gated_rms_norm(x64, norm.weight.double(), group_size=4, eps=1e-5),
                               formula_gated_rmsnorm(x64, norm.weight, None, 1e-5, 4, True), atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="group_size"):
        GatedRMSNorm(8, group_size=3)


# ---- causal conv1d ----------------------------------------------------------------------------

def loop_causal_conv1d(x, w, bias, initial_states, silu):
    """out[t] = bias + sum_k w[k] * x[t - (W-1) + k], one time step at a time."""
    width = w.shape[1]
    hist = torch.zeros(*x.shape[:2], width - 1, dtype=x.dtype) if initial_states is None else initial_states
    full = torch.cat([hist, x], dim=-1)
    outs = [(full[..., t:t + width] * w).sum(-1) + (0 if bias is None else bias) for t in range(x.shape[-1])]
    out = torch.stack(outs, dim=-1)
    return (out * torch.sigmoid(out) if silu else out), full[..., -(width - 1):]


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_matches_step_loop(with_init, activation):
    gen = torch.Generator().manual_seed(2)
    x, w, bias = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in [(2, 6, 9), (6, 4), (6,)])
    init = torch.randn(2, 6, 3, generator=gen, dtype=torch.float64) if with_init else None
    out, final = causal_conv1d_fn(x, w, bias, initial_states=init, return_final_states=True, activation=activation)
    ref, ref_final = loop_causal_conv1d(x, w, bias, init, activation == "silu")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(final, ref_final, atol=0, rtol=0)
    assert causal_conv1d_fn(x, w, None).shape == x.shape


def test_causal_conv1d_bitwise_repeatable_and_refusals():
    gen = torch.Generator().manual_seed(4)
    base = [torch.randn(*s, generator=gen) for s in [(4, 96, 300), (96, 4), (96,)]]

    def run():
        x, w, bias = (t.clone().requires_grad_(True) for t in base)
        out = causal_conv1d_fn(x, w, bias, activation="silu")
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out, x.grad, w.grad, bias.grad]

    with threads(2):
        a, b = run(), run()
    assert all(_bytes(u) == _bytes(v) for u, v in zip(a, b))
    with pytest.raises(UnsupportedKernelFeature, match="seq_idx"):
        causal_conv1d_fn(*base, seq_idx=torch.zeros(4, 300, dtype=torch.int32))
    with pytest.raises(UnsupportedKernelFeature, match="activation"):
        causal_conv1d_fn(*base, activation="relu")


def test_split_conv1d_scan_matches_conv_loop_then_recurrence():
    """megatron's mem-eff path: split z|xBC|dt, conv+silu, scan with softplus(dt+bias), D, silu(z)."""
    b, l, h, p, g, n = 2, 19, 4, 3, 2, 5
    dim, conv_dim = h * p, h * p + 2 * g * n
    gen = torch.Generator().manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    zxbcdt, w, bias, dt_bias, D = r(b, l, 2 * dim + 2 * g * n + h), r(conv_dim, 4), r(conv_dim), r(h), r(h)
    A = -torch.rand(h, generator=gen, dtype=torch.float64) - 0.1
    out, final = ssd_split_conv1d_scan_combined(zxbcdt, w, bias, dt_bias, A, D, 8, headdim=p, ngroups=g,
                                                return_final_states=True)
    z, xBC, dt = torch.split(zxbcdt, [dim, conv_dim, h], dim=-1)
    xBC = loop_causal_conv1d(xBC.transpose(1, 2), w, bias, None, True)[0].transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, g * n, g * n], dim=-1)
    ref, ref_final = sequential_ssd(x.reshape(b, l, h, p), dt, A, B.reshape(b, l, g, n), C.reshape(b, l, g, n),
                                    D=D, z=z.reshape(b, l, h, p), dt_bias=dt_bias, dt_softplus=True)
    torch.testing.assert_close(out, ref.reshape(b, l, dim), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(final, ref_final, atol=1e-10, rtol=1e-10)
    with pytest.raises(UnsupportedKernelFeature, match="rmsnorm"):
        ssd_split_conv1d_scan_combined(zxbcdt, w, bias, dt_bias, A, D, 8, headdim=p, ngroups=g, rmsnorm_weight=D)
