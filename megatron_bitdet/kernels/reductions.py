"""Topology-invariant float reductions: exact data movement, then a local sum in logical-rank order.

A ring or tree all-reduce adds partial sums in the order the data travels, so its bits follow the
physical ring (NCCL_ALGO=Ring pins the algorithm, not which ring an allocation gets). Here every
float SUM/AVG reduction moves *unreduced* shards (an all-to-all: the same (N-1)/N of the buffer per
rank as a ring reduce-scatter), adds them on the owner in group-rank order 0..N-1, and for an
all-reduce moves the reduced shards back (another (N-1)/N: the ring all-gather's bytes). The bits
then depend on the logical layout only. Exact reductions (MAX/MIN, integer dtypes) keep c10d's.

Where bytes differ from the ring: a buffer whose numel is not a multiple of N is zero-padded to the
next multiple (at most N-1 elements), and the all-gather half is an all-to-all of the repeated shard
(same bytes on the wire, one extra buffer-sized copy in memory: the shard N times) because c10d's
all_gather_into_tensor defers into megatron's coalescing manager while all_to_all_single runs at once.

The transport is pluggable so the invariance can be tested honestly on one machine: ``RingTransport``
moves the same bytes with point-to-point sends along a ring whose order is chosen per run
(``BITDET_EMULATED_RING=<seed>``), emulating the physical ring an allocation receives; with it the
*ordinary* reduction is a real ring reduce-scatter/all-gather that adds in travel order.
"""
from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist

from megatron_bitdet.enforce.env import EMULATED_RING_ENV
from megatron_bitdet.kernels.moe_aux import tree_sum

REDUCING_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class Completed:
    """What an ``async_op=True`` call returns: the reductions here finish before they return."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def _group(group):
    return group if group is not None else dist.group.WORLD


def reduces_floats(tensor, op) -> bool:
    """True where the summation order changes the bits (float SUM/AVG)."""
    return tensor.is_floating_point() and op in REDUCING_OPS


def rank_order_sum(chunks: torch.Tensor) -> torch.Tensor:
    """``chunks[0] + chunks[1] + ... + chunks[N-1]``, left to right: one order for every topology."""
    acc = chunks[0].clone()
    for r in range(1, chunks.shape[0]):
        acc.add_(chunks[r])
    return acc


def bit_reversed(n: int) -> list[int]:
    """0 .. n-1 (a power of two) in bit-reversed order: adjacent pairs of this order are the first
    level of :func:`~megatron_bitdet.kernels.moe_aux.tree_sum`'s tree, so a streaming binary counter
    over it builds the same tree."""
    bits = n.bit_length() - 1
    return [int(f"{i:0{bits}b}"[::-1], 2) if bits else 0 for i in range(n)]


def exact_square_sum(tensors: list, group, limb_bits: int = 24, limbs: int = 3) -> float:
    """Sum of squares whose bits do not depend on how the elements are split over ranks and tensors
    (ReproBLAS-style binning): a MAX all-reduce fixes the scale 2**(2e) >= max(x**2); each square
    (exact in float64 for float32 inputs) is cut onto the fixed grid 2**(2e - limb_bits*limbs) as
    ``limbs`` integer limbs of ``limb_bits`` bits, truncated; the limbs are summed in int64 (integer
    sums are associative: any partition and order give the same integers) and SUM all-reduced exactly.
    Kept: every square's bits down to 2**-72 of the largest square (defaults); the total's relative
    error is below n * 2**-72 for n elements, and limb sums cannot overflow below 2**39 elements."""
    device = tensors[0].device if tensors else torch.device("cpu")
    peak = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        if t.numel():
            peak = torch.maximum(peak, t.detach().abs().max().to(torch.float64))
    spread = dist.is_initialized() and dist.get_world_size(group) > 1
    if spread:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    if not torch.isfinite(peak):
        return float(peak)
    exponent = int(torch.frexp(peak).exponent) if peak > 0 else 0
    sums = torch.zeros(limbs, dtype=torch.int64, device=device)
    grid = float(2 ** limb_bits)
    for t in tensors:
        x = torch.ldexp(t.detach().to(torch.float64).reshape(-1) ** 2, torch.tensor(-2 * exponent, device=device))
        for k in range(limbs):
            x = x * grid
            whole = torch.floor(x)
            sums[k] += whole.to(torch.int64).sum()
            x = x - whole
    if spread:
        dist.all_reduce(sums, group=group)
    total = 0.0
    for k, s in enumerate(sums.tolist()):
        total += float(s) * 2.0 ** (2 * exponent - limb_bits * (k + 1))
    return total


class CollectiveTransport:
    """Exact data movement through c10d's all-to-all (whatever algorithm the library picks)."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, group) -> None:
        dist.all_to_all_single(out, inp, group=group)


class RingTransport(CollectiveTransport):
    """The same bytes moved by point-to-point sends scheduled by ring position: ``order`` is the
    physical ring (a permutation of group ranks) an allocation happened to receive."""

    def __init__(self, seed: int):
        self.seed = seed

    def order(self, group) -> list:
        """This group's ring: a permutation of its ranks fixed by the seed and the group's members."""
        members = dist.get_process_group_ranks(_group(group))
        order = list(range(len(members)))
        random.Random(f"{self.seed}:{members}").shuffle(order)
        return order

    def _exchange(self, send, recv, dst, src, group) -> None:
        g = _group(group)
        ops = [dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(g, dst), group),
               dist.P2POp(dist.irecv, recv, dist.get_global_rank(g, src), group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def all_to_all(self, out, inp, group) -> None:
        """Round k: the rank k places further along the ring gets its chunk (exact, any order)."""
        order = self.order(group)
        n, me = len(order), dist.get_rank(group)
        pos = order.index(me)
        src, dst = inp.view(n, -1), out.view(n, -1)
        dst[me].copy_(src[me])
        for k in range(1, n):
            to, frm = order[(pos + k) % n], order[(pos - k) % n]
            self._exchange(src[to], dst[frm], to, frm, group)

    def ring_reduce_scatter(self, out, inp, group) -> None:
        """An *ordinary* ring reduce-scatter: each chunk is summed in the order it travels the ring,
        starting one position after its owner, so the bits follow ``order``."""
        order = self.order(group)
        n = len(order)
        pos = order.index(dist.get_rank(group))
        chunks = inp.reshape(n, -1)
        nxt, prv = order[(pos + 1) % n], order[(pos - 1) % n]
        partial = chunks[order[(pos - 1) % n]].clone()
        for s in range(n - 1):
            recv = torch.empty_like(partial)
            self._exchange(partial, recv, nxt, prv, group)
            partial = recv.add_(chunks[order[(pos - 2 - s) % n]])
        out.view(-1).copy_(partial)


def _padded(flat: torch.Tensor, n: int) -> torch.Tensor:
    pad = (-flat.numel()) % n
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


class Reductions:
    """The replacements for c10d's float reductions, over one transport.

    ``ordinary`` (only with a ring transport) is the emulated library ring: partial sums formed in
    travel order. Otherwise a reduction is exact movement plus ``combine`` over the group's chunks:
    :func:`rank_order_sum`, or ``moe_aux.tree_sum`` (``dp_invariant``)."""

    def __init__(self, transport: CollectiveTransport, *, ordinary: bool = False, combine=rank_order_sum):
        if ordinary and not isinstance(transport, RingTransport):
            raise ValueError("the ordinary (travel-order) reduction needs a ring transport")
        self.transport, self.ordinary, self.combine = transport, ordinary, combine

    def _reduce_scatter_flat(self, out_flat, in_flat, n, group) -> None:
        if self.ordinary:
            self.transport.ring_reduce_scatter(out_flat, in_flat, group)
            return
        recv = torch.empty_like(in_flat)
        self.transport.all_to_all(recv, in_flat.contiguous(), group)
        out_flat.copy_(self.combine(recv.view(n, -1)))

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = dist.get_world_size(group)
        self._reduce_scatter_flat(output.view(-1), input.reshape(-1), n, group)
        if op == dist.ReduceOp.AVG:
            output.div_(n)
        return Completed() if async_op else None

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = dist.get_world_size(group)
        flat = _padded(tensor.reshape(-1), n)
        shard = flat.new_empty(flat.numel() // n)
        self._reduce_scatter_flat(shard, flat, n, group)
        gathered = torch.empty_like(flat)
        self.transport.all_to_all(gathered, shard.repeat(n), group)
        if op == dist.ReduceOp.AVG:
            gathered.div_(n)
        tensor.copy_(gathered[: tensor.numel()].view_as(tensor))
        return Completed() if async_op else None


def from_environment(mode: str):
    """The reductions for a recipe's ``determinism.reductions`` mode, or None to keep c10d's
    (``dp_invariant``: the halves-first pairwise tree over the group's chunks, ``moe_aux.tree_sum``: for
    a power-of-two count its first levels add exactly the chunks congruent modulo any power of two
    dividing it, so a rank holding the sum of leaves ``r, r + DP, r + 2DP, ...`` (summed by the same
    rule) feeds the upper levels exactly as those ranks would).

    ``BITDET_EMULATED_RING=<seed>`` (tests, benchmarks) routes the data over an emulated physical
    ring; with mode ``native`` the reductions then are that ring's ordinary travel-order sums."""
    seed = os.environ.get(EMULATED_RING_ENV)
    invariant = mode in ("topology_invariant", "dp_invariant")
    combine = tree_sum if mode == "dp_invariant" else rank_order_sum
    if seed is None:
        return Reductions(CollectiveTransport(), combine=combine) if invariant else None
    return Reductions(RingTransport(int(seed)), ordinary=not invariant, combine=combine)


def wrappers(reductions: Reductions) -> dict:
    """c10d name -> wrap(original): float SUM/AVG go to ``reductions``, everything else is c10d's."""
    def all_reduce(orig):
        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if dist.get_world_size(group) > 1 and reduces_floats(tensor, op):
                return reductions.all_reduce(tensor, op, group, async_op)
            return orig(tensor, op=op, group=group, async_op=async_op)
        return all_reduce

    def reduce_scatter_tensor(orig):
        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if dist.get_world_size(group) > 1 and reduces_floats(input, op):
                return reductions.reduce_scatter_tensor(output, input, op, group, async_op)
            return orig(output, input, op=op, group=group, async_op=async_op)
        return reduce_scatter_tensor

    return {"all_reduce": all_reduce, "reduce_scatter_tensor": reduce_scatter_tensor,
            "_reduce_scatter_base": reduce_scatter_tensor}
