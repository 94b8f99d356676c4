"""MoE load-balancing (aux) loss with a fixed reduction order, and rank-ordered cross-rank sums.

megatron-core's fused path (TE ``fused_moe_aux_loss``) adds per-CTA partials with ``atomicAdd``, and
its logging tracker all-reduces float losses, whose bits then depend on the collective algorithm and
topology. Here every float sum has one order, fixed by the shapes alone:

* the per-expert probability sums are built from per-block partials, each block of ``block_rows``
  tokens in its own private slot, each slot and then the slots combined by the pairwise tree of
  :func:`tree_sum` (elementwise adds only: independent of threads, vector width and hardware);
* cross-rank float sums all_gather the per-rank values (exact data movement) and add them in rank
  order (:func:`rank_ordered_sum`); integer token counts keep megatron's all_reduce (exact).

The backward has no reduction at all (d loss / d probs[t, e] = g * scale * tokens_per_expert[e]); it
is written out so that its bits equal megatron's unfused autograd graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class AuxLossConfig:
    """block_rows: tokens per private partial slot (the CTA tile of a GPU kernel doing the same sum)."""

    block_rows: int = 256


DEFAULT_AUX_CONFIG = AuxLossConfig()


def tree_sum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum along ``dim`` by a fixed pairwise tree: element i is added to element i + n//2, an odd
    tail is added to the last pair; repeat. The order depends only on the length along ``dim``.

    One elementwise add per tree level, never one per pair; the levels after the first fold in
    place into a workspace whose level views are made once per shape (see :func:`_levels`). Along
    the innermost dim of a tensor with more than one, the levels fold in place along it instead:
    moved to the front, every level would read with a stride of ``n`` (2.4x slower for the grouped
    MLP's dprob tiles)."""
    if x.dim() > 1 and dim in (-1, x.dim() - 1) and x.stride(-1) == 1:
        return _tree_sum_innermost(x)
    x = x.movedim(dim, 0)
    n = x.shape[0]
    if n <= 1:
        return x.sum(0) if n == 0 else x[0].clone()
    h = n // 2
    if torch.is_grad_enabled() and x.requires_grad:  # differentiable: no shared workspace, no out=
        buf = x[:h] + x[h : 2 * h]
        if n % 2:
            buf[h - 1] += x[2 * h]
        levels = _level_views(buf, h, host=False)
    else:
        buf, levels = _levels(h, tuple(x.shape[1:]), x.dtype, x.device)
        torch.add(x[:h], x[h : 2 * h], out=buf)
        if n % 2:
            buf[h - 1] += x[2 * h]
    for lo, hi, tail in levels:
        lo += hi
        if tail is not None:
            last, odd = tail  # one-row slices: views (a numpy index would give a copy)
            last += odd
    return buf[0].clone()


def _tree_sum_innermost(x: torch.Tensor) -> torch.Tensor:
    """:func:`tree_sum` along the last dim: the same pairs in the same order, halving along it."""
    n = x.shape[-1]
    while n > 1:
        h = n // 2
        lo = x[..., :h] + x[..., h : 2 * h]
        if n % 2:
            lo[..., h - 1] += x[..., 2 * h]
        x, n = lo, h
    return x.sum(-1) if n == 0 else x[..., 0].clone()


_WORKSPACES: dict = {}
_WORKSPACE_BYTES = 64 << 20


def _level_views(buf: torch.Tensor, n: int, host: bool = True) -> list:
    """(first half, second half, (last pair, odd tail) or None) of every level folding ``buf[:n]``.

    On the CPU the views are numpy arrays over the same memory: an in-place numpy add on a small view
    costs a third of torch's dispatch, and float32/float64 addition is IEEE-exact in both, so the bits
    are the same."""
    views = buf.numpy() if host and buf.device.type == "cpu" and buf.dtype in (torch.float32, torch.float64) else buf
    levels = []
    while n > 1:
        h = n // 2
        levels.append((views[:h], views[h : 2 * h], (views[h - 1 : h], views[2 * h : 2 * h + 1]) if n % 2 else None))
        n = h
    return levels


def _levels(h: int, rest: tuple, dtype, device) -> tuple:
    """The workspace of a tree over ``2h`` or ``2h + 1`` rows of shape ``rest`` and its level views,
    kept per shape (bounded in bytes) because the aux loss runs with one shape per MoE layer."""
    key = (h, rest, dtype, device)
    ws = _WORKSPACES.get(key)
    if ws is None:
        buf = torch.empty((h, *rest), dtype=dtype, device=device)
        ws = (buf, _level_views(buf, h))
        if buf.numel() * buf.element_size() <= _WORKSPACE_BYTES // 8:
            if sum(b.numel() * b.element_size() for b, _ in _WORKSPACES.values()) > _WORKSPACE_BYTES:
                _WORKSPACES.clear()
            _WORKSPACES[key] = ws
    return ws


def block_partials(probs: torch.Tensor, block_rows: int) -> torch.Tensor:
    """[S, E] private slots: slot s holds the tree sum of token block s (the tail block is its own slot)."""
    tokens, experts = probs.shape
    full = tokens // block_rows
    slots = []
    if full:
        slots.append(tree_sum(probs[: full * block_rows].reshape(full, block_rows, experts), dim=1))
    if tokens > full * block_rows or not tokens:
        slots.append(tree_sum(probs[full * block_rows :], dim=0).unsqueeze(0))
    return slots[0] if len(slots) == 1 else torch.cat(slots)


class FixedOrderAuxLoss(torch.autograd.Function):
    """loss = scale * sum_e(tokens_per_expert[e] * sum_t probs[t, e]), every sum in a fixed order."""

    @staticmethod
    def forward(ctx, probs, tokens_per_expert, scale, block_rows):
        per_expert = tree_sum(block_partials(probs, block_rows), dim=0)
        ctx.save_for_backward(tokens_per_expert)
        ctx.scale, ctx.probs_shape = scale, probs.shape
        return tree_sum(per_expert * tokens_per_expert, dim=0) * scale

    @staticmethod
    def backward(ctx, grad):
        (tokens_per_expert,) = ctx.saved_tensors
        # Same ops in the same order as autograd through megatron's unfused expression.
        grad_probs = ((grad * ctx.scale) * tokens_per_expert).expand(ctx.probs_shape)
        return grad_probs, None, None, None


def fixed_order_aux_loss(probs, tokens_per_expert, scale, config: AuxLossConfig = DEFAULT_AUX_CONFIG):
    """The fused fixed-order aux loss for a precomputed ``scale`` (float or 0-d tensor)."""
    return FixedOrderAuxLoss.apply(probs, tokens_per_expert, scale, config.block_rows)


def switch_load_balancing_loss_func(
    probs: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens,
    topk: int,
    num_experts: int,
    moe_aux_loss_coeff: float,
    fused: bool = False,
    padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for megatron's function of the same name; ``fused`` is accepted and ignored: this
    is always the fused fixed-order path (it replaces TE's atomic kernel too)."""
    if padding_mask is not None:
        probs = probs * padding_mask.unsqueeze(-1)
    scale = num_experts * moe_aux_loss_coeff / (topk * total_num_tokens * total_num_tokens)
    return fixed_order_aux_loss(probs, tokens_per_expert, scale)


def gather_ranks(tensor: torch.Tensor, group=None) -> list:
    """Every ``group`` member's ``tensor``, in group-rank order (an all_gather: exact movement)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def rank_ordered_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """Sum of ``tensor`` over ``group``, added in group-rank order after an all_gather, so every rank
    gets the same bits whatever collective algorithm, topology or group construction is used."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tensor.clone()
    parts = gather_ranks(tensor, group)
    total = parts[0]
    for part in parts[1:]:
        total += part
    return total


def reduce_aux_losses_tracker_across_ranks(track_names: Optional[List[str]] = None, pg_collection=None) -> None:
    """megatron's tracker reduction (PP sum, reduce-group sum, DP average) with rank-ordered sums
    instead of float all_reduce; the average divides the rank-ordered sum by the group size."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    if pg_collection is None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    else:
        pp_group, dp_group = pg_collection.pp, pg_collection.dp

    for name in tracker.keys() if track_names is None else track_names:
        entry = tracker[name]
        values = rank_ordered_sum(entry["values"], pp_group)
        if entry.get("reduce_group") is not None:
            values = rank_ordered_sum(values, entry["reduce_group"])
            if not entry.get("reduce_group_has_dp", False):
                values = rank_ordered_mean(values, dp_group)
        if entry.get("avg_group") is not None:
            values = rank_ordered_mean(values, entry["avg_group"])
        entry["values"].copy_(values)


def rank_ordered_mean(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """The rank-ordered sum divided by the group size (megatron's ReduceOp.AVG, in one order)."""
    return rank_ordered_sum(tensor, group) / (dist.get_world_size(group) if dist.is_initialized() else 1)


def sync_metrics(self, metric_names, pg_collection=None) -> None:
    """``MoEMetricsTracker._sync_metrics`` (megatron-core 0.18+, what ``report`` and the deprecated
    module functions call) with rank-ordered sums: PP sum, reduce-group sum, avg-group mean, DP mean."""
    from megatron.core import parallel_state

    if pg_collection is None:
        pp_group, dp_group = parallel_state.get_pipeline_model_parallel_group(), None
    elif hasattr(pg_collection, "dp_cp_gtp_remat"):  # 0.19: the gtp_remat-inclusive group, if it is set
        pp_group, dp_group = pg_collection.pp, pg_collection.dp_cp_gtp_remat
    else:  # 0.18: the collection's DP group
        pp_group, dp_group = pg_collection.pp, pg_collection.dp
    if dp_group is None:
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    for name in metric_names:
        entry = self.metrics.get(name)
        if entry is None:
            continue
        values = rank_ordered_sum(entry.values, pp_group)
        if entry.reduce_group is not None:
            values = rank_ordered_sum(values, entry.reduce_group)
        if entry.avg_group is not None:
            values = rank_ordered_mean(values, entry.avg_group)
        if entry.needs_dp_avg:
            values = rank_ordered_mean(values, dp_group)
        entry.values.copy_(values)
