"""Triton grouped expert MLP (optional GPU extra; imported only when ``GroupedMLPConfig.backend`` asks:
recipe key ``model.moe.grouped_backend: triton``, refused at build where triton or CUDA is absent).

One row-grouped GEMM kernel with selectable epilogues does the hot work; a K-grouped kernel does the
weight gradients. Every program accumulates its tile in a fixed loop order and block sizes are pinned
(no autotuning: the chosen config would change the bits). The fc2 dgrad epilogue reduces
``ds * act(h)`` over its N-tile and either

* stores it into its PRIVATE slot ``dprob_slots[row, pid_n]`` (deterministic; the slots are summed by
  :func:`~megatron_bitdet.kernels.moe_aux.tree_sum` after the kernel finishes), or
* ``tl.atomic_add``s it into ``dprob[row]`` — the nondeterministic upstream pattern, kept beside it
  as the speed baseline for ``benchmarks/bench_moe.py``.

The fused activation is squared ReLU (Nemotron); the torch backend covers every other activation.
"""
from __future__ import annotations

import torch
from megatron.core.activations import squared_relu

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.kernels.moe_aux import tree_sum

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - GPU extra
    raise BitdetInputError("the triton grouped-MLP backend needs triton (pip install '.[gpu]') and a CUDA device") from exc

BLOCK_M, BLOCK_K = 64, 32
EPI_STORE, EPI_FC1_ACT_PROB, EPI_DPROB_SLOTS, EPI_DPROB_ATOMIC = 0, 1, 2, 3


@triton.jit
def _row_grouped_mm(
    a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    h_ptr, prob_ptr, aux_ptr, n_tiles,
    EPILOGUE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[rows] = A[rows] @ B[e] for the token tile ``pid_m`` of expert e, then the epilogue."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    row_end = tl.load(tile_end_ptr + pid_m)
    rows = tl.load(tile_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(
            a_ptr + rows64[:, None] * stride_am + (k0 + ks)[None, :] * stride_ak,
            mask=row_ok[:, None] & k_ok[None, :], other=0.0,
        )
        b = tl.load(
            b_ptr + e * stride_be + (k0 + ks)[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_ok[:, None] & col_ok[None, :], other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    c_offs = rows64[:, None] * stride_cm + cols[None, :] * stride_cn
    out_ty = c_ptr.dtype.element_ty
    if EPILOGUE == 0:
        tl.store(c_ptr + c_offs, acc.to(out_ty), mask=mask)
    else:
        prob = tl.load(prob_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
        if EPILOGUE == 1:  # fc1 forward: keep h for the backward, emit act(h) * prob
            h = acc.to(out_ty)
            tl.store(h_ptr + c_offs, h, mask=mask)
            r = tl.maximum(h.to(tl.float32), 0.0)
            act = (r * r).to(out_ty).to(tl.float32)
            tl.store(c_ptr + c_offs, (act * prob[:, None]).to(out_ty), mask=mask)
        else:  # fc2 dgrad: acc is ds; dprob share of this N-tile, and dh = ds * prob * act'(h)
            ds = acc.to(out_ty).to(tl.float32)
            r = tl.maximum(tl.load(h_ptr + c_offs, mask=mask, other=0.0).to(tl.float32), 0.0)
            act = (r * r).to(out_ty).to(tl.float32)
            partial = tl.sum(ds * act, axis=1)
            if EPILOGUE == 2:
                tl.store(aux_ptr + rows64 * n_tiles + pid_n, partial, mask=row_ok)
            else:
                tl.atomic_add(aux_ptr + rows64, partial, mask=row_ok)
            da = (ds * prob[:, None]).to(out_ty).to(tl.float32)
            tl.store(c_ptr + c_offs, (da * (2.0 * r)).to(out_ty), mask=mask)


@triton.jit
def _k_grouped_mm(
    a_ptr, b_ptr, c_ptr, start_ptr, end_ptr, M, N,
    stride_ak, stride_am, stride_bk, stride_bn, stride_ce, stride_cm, stride_cn,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[e] = A[seg_e]^T @ B[seg_e] (weight gradients); an empty segment gives zeros."""
    e = tl.program_id(0).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    start = tl.load(start_ptr + e)
    end = tl.load(end_ptr + e)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(start, end, BLOCK_K):
        k = (k0 + ks).to(tl.int64)
        k_ok = k < end
        a = tl.load(a_ptr + k[None, :] * stride_ak + ms[:, None] * stride_am, mask=(ms[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + ns[None, :] * stride_bn, mask=k_ok[:, None] & (ns[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    mask = (ms[:, None] < M) & (ns[None, :] < N)
    tl.store(c_ptr + e * stride_ce + ms[:, None] * stride_cm + ns[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _tile_map(offs: torch.Tensor):
    """(expert, first row, end row) of every BLOCK_M token tile, computed on the device."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = (ends - starts + BLOCK_M - 1) // BLOCK_M
    expert = torch.repeat_interleave(torch.arange(len(ends), device=offs.device), counts)
    first_tile = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    index = torch.arange(len(expert), device=offs.device) - first_tile
    return (expert.int(), (starts[expert] + index * BLOCK_M).int(), ends[expert].int())


def _precision(t):
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _row_mm(a, b_view, tiles, n, out, block_n, epilogue=EPI_STORE, h=None, prob=None, aux=None, n_tiles=1):
    """out[rows] = a[rows] @ b_view[e]; b_view is [E, K, N] (any strides)."""
    expert, start, end = tiles
    grid = (len(expert), triton.cdiv(n, block_n))
    if grid[0]:
        _row_grouped_mm[grid](
            a, b_view, out, expert, start, end, n, a.shape[1],
            a.stride(0), a.stride(1), b_view.stride(0), b_view.stride(1), b_view.stride(2), out.stride(0), out.stride(1),
            h if h is not None else out, prob if prob is not None else out, aux if aux is not None else out, n_tiles,
            EPILOGUE=epilogue, PRECISION=_precision(a), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        )
    return out


def _wgrad(a, b, offs, block_n):
    """[E, M, N]: per expert a[seg]^T @ b[seg]."""
    ends = offs.int()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    m, n = a.shape[1], b.shape[1]
    out = torch.empty(len(ends), m, n, device=a.device, dtype=a.dtype)
    grid = (len(ends), triton.cdiv(m, BLOCK_M), triton.cdiv(n, block_n))
    _k_grouped_mm[grid](
        a, b, out, starts, ends, m, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        PRECISION=_precision(a), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
    )
    return out


class _TritonGroupedProbMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, w1, w2, offs, tile_n, atomic):
        tokens, ffn, hidden = x.shape[0], w1.shape[1], w2.shape[1]
        tiles = _tile_map(offs)
        h = torch.empty(tokens, ffn, device=x.device, dtype=x.dtype)
        s = torch.empty_like(h)
        _row_mm(x, w1.transpose(1, 2), tiles, ffn, s, tile_n, EPI_FC1_ACT_PROB, h=h, prob=probs)
        y = _row_mm(s, w2.transpose(1, 2), tiles, hidden, torch.empty(tokens, hidden, device=x.device, dtype=x.dtype), tile_n)
        ctx.save_for_backward(x, probs, w1, w2, offs, h, s)
        ctx.tile_n, ctx.atomic, ctx.tiles = tile_n, atomic, tiles
        return y

    @staticmethod
    def backward(ctx, dy):
        x, probs, w1, w2, offs, h, s = ctx.saved_tensors
        dy = dy.contiguous()
        tokens, ffn, tile_n = x.shape[0], h.shape[1], ctx.tile_n
        n_tiles = triton.cdiv(ffn, tile_n)
        dh = torch.empty_like(h)
        if ctx.atomic:
            dprob = torch.zeros(tokens, device=x.device, dtype=torch.float32)
            _row_mm(dy, w2, ctx.tiles, ffn, dh, tile_n, EPI_DPROB_ATOMIC, h=h, prob=probs, aux=dprob)
        else:
            slots = torch.empty(tokens, n_tiles, device=x.device, dtype=torch.float32)
            _row_mm(dy, w2, ctx.tiles, ffn, dh, tile_n, EPI_DPROB_SLOTS, h=h, prob=probs, aux=slots, n_tiles=n_tiles)
            dprob = tree_sum(slots, dim=1)  # fixed order, after every tile has finished
        dx = _row_mm(dh, w1, ctx.tiles, x.shape[1], torch.empty_like(x), tile_n)
        return dx, dprob.to(probs.dtype), _wgrad(dh, x, offs, tile_n), _wgrad(dy, s, offs, tile_n), None, None, None


def grouped_prob_mlp(x, probs, w1, w2, offs, activation, config):
    """Triton path of :func:`megatron_bitdet.kernels.grouped_mlp.grouped_prob_mlp` (squared ReLU only)."""
    if activation is not squared_relu:
        raise BitdetInputError("the triton grouped-MLP backend fuses squared ReLU only; use backend 'torch'")
    if not x.is_cuda:
        raise BitdetInputError("the triton grouped-MLP backend needs CUDA tensors")
    atomic = config.backend == "triton_atomic"
    return _TritonGroupedProbMLPFn.apply(x.contiguous(), probs.contiguous(), w1, w2, offs, config.dprob_tile_n, atomic)
