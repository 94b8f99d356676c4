"""Install the recipe's reduction mode for the rest of the process (``determinism.reductions``).

c10d's float reductions are rebound wherever they are bound — torch.distributed, c10d and megatron's
import-time aliases (``dist_reduce_scatter_func``) — through the same swap the tracer uses, so DDP's
bucket all-reduce / distributed-optimizer reduce-scatter, the TP/SP mappings and the scalar
all-reduces (loss, grad norm) all go through :mod:`megatron_bitdet.kernels.reductions`.

``dp_invariant`` (``virtual_dp: V``) makes the bits independent of the data-parallel size: the
cross-rank sums are :func:`~megatron_bitdet.kernels.moe_aux.tree_sum` trees over the group's
ranks, every DDP bucket scales by 1/V instead of 1/DP, the grad norm is the partition-free
:func:`~megatron_bitdet.kernels.reductions.exact_square_sum`, and a physical rank hosting V/DP
strided virtual ranks (:class:`VirtualLayout`) runs each one's micro-batches from the step's RNG
state into a zeroed buffer and adds the hosted gradients by the lower levels of the same tree
(:class:`GradTree`); the loop's scalars follow the same structure (``train.loop``).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

from megatron_bitdet.enforce.env import EMULATED_RING_ENV
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.kernels import reductions as kernels

MODES = ("native", "topology_invariant", "dp_invariant")
_IDS = {"topology_invariant": "topology_invariant_reductions", "dp_invariant": "dp_invariant_reductions"}
_INSTALLED = contextlib.ExitStack()
_RECORD: dict = {}


@contextlib.contextmanager
def active(mode: str):
    """``mode``'s reductions for a block only (the tax alternates sides with and without them);
    yields the swapped bindings ([] when c10d's reductions stay); ``dp_invariant`` adds the grad norm."""
    from megatron_bitdet.compat.collectives import swap_collectives

    reductions = kernels.from_environment(mode)
    if reductions is None:
        yield []
        return
    makers = kernels.wrappers(reductions)
    with contextlib.ExitStack() as stack:
        bindings = list(stack.enter_context(swap_collectives(lambda name, fn: makers[name](fn), tuple(makers))))
        if mode == "dp_invariant":
            from megatron.core.optimizer import optimizer as megatron_optimizer

            from megatron_bitdet.compat.rebind import megatron_modules, rebound

            original = megatron_optimizer.get_grad_norm_fp32
            norm = stack.enter_context(rebound({original: exact_grad_norm(original)}, megatron_modules()))
            bindings += [f"{m.__name__}:{a}" for m, a, _ in norm]
        yield bindings


def exact_grad_norm(original):
    """megatron's ``get_grad_norm_fp32`` with the 2-norm's squares summed by ``exact_square_sum``
    (whatever the distributed optimizer's shard boundaries); other norms stay megatron's."""
    def get_grad_norm_fp32(grads_for_norm, norm_type=2, grad_stats_parallel_group=None):
        if norm_type != 2:
            return original(grads_for_norm, norm_type=norm_type, grad_stats_parallel_group=grad_stats_parallel_group)
        grads = [grads_for_norm] if hasattr(grads_for_norm, "numel") else list(grads_for_norm)
        return math.sqrt(kernels.exact_square_sum(grads, grad_stats_parallel_group))
    return get_grad_norm_fp32


def install(mode: str) -> dict | None:
    """Install once per process; returns the manifest record (None when c10d's reductions stay)."""
    if _RECORD:
        return dict(_RECORD)
    reductions = kernels.from_environment(mode)
    if reductions is None:
        return None
    bindings = _INSTALLED.enter_context(active(mode))
    _RECORD.update(
        id=_IDS.get(mode, "emulated_ring_reductions"),
        mode=mode, transport=type(reductions.transport).__name__,
        emulated_ring_seed=os.environ.get(EMULATED_RING_ENV), bindings=sorted(bindings),
    )
    return dict(_RECORD)


@dataclass(frozen=True)
class VirtualLayout:
    """This rank's place in ``dp_invariant``'s virtual layout: rank ``r`` of DP hosts the virtual ranks
    ``r, r + DP, r + 2DP, ...`` of ``virtual_dp`` (strided, so that the ranks running at once form the
    same EP groups as at DP = V), run in bit-reversed order so that ``GradTree``'s adjacent pairs are
    :func:`~megatron_bitdet.kernels.moe_aux.tree_sum`'s."""

    virtual_dp: int
    dp_size: int
    dp_rank: int

    @property
    def hosted(self) -> int:
        return self.virtual_dp // self.dp_size

    def runs(self, rank: int | None = None) -> list[int]:
        """The virtual ranks ``rank`` (default this one) hosts, in the order it runs them."""
        r = self.dp_rank if rank is None else rank
        return [r + h * self.dp_size for h in kernels.bit_reversed(self.hosted)]

    def gathered_order(self) -> list[int]:
        """Row ``v`` of a DP-gathered [DP x hosted] stack is at this index: virtual-rank order."""
        where = {v: i for i, v in enumerate(v for r in range(self.dp_size) for v in self.runs(r))}
        return [where[v] for v in range(self.virtual_dp)]

    def record(self, grad_bytes: int) -> dict:
        """The manifest's account of what the mode applies on this rank."""
        extra = GradTree.depth(self.hosted)
        return {"virtual_dp": self.virtual_dp, "dp_size": self.dp_size, "hosted_per_rank": self.hosted,
                "hosted_virtual_ranks": {str(r): self.runs(r) for r in range(self.dp_size)},
                "gradient_scaling": f"1/{self.virtual_dp}", "extra_grad_buffers": extra,
                "extra_grad_bytes": extra * grad_bytes}


def virtual_layout(recipe) -> VirtualLayout | None:
    """The layout once megatron's parallel state exists (None unless ``dp_invariant``)."""
    from megatron.core import parallel_state as ps

    d = recipe.determinism
    if d.reductions != "dp_invariant":
        return None
    dp = ps.get_data_parallel_world_size()
    issue = d.virtual_dp_issue(dp)
    if issue:
        raise BitdetInputError(issue)
    return VirtualLayout(d.virtual_dp, dp, ps.get_data_parallel_rank())


def scale_by_virtual_dp(ddp_modules, virtual_dp: int) -> None:
    """Every DDP bucket pre-scales its gradients by 1/V (megatron: 1/DP). V is a power of two, so
    scaling commutes exactly with the sums (subnormals aside) and the hosted tree's scaled total
    equals V scaled leaves."""
    for m in ddp_modules:
        for buffer in (*m.buffers, *m.expert_parallel_buffers):
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = 1.0 / virtual_dp


class GradTree:
    """The hosted virtual ranks' gradients added by the lower levels of the pairwise tree, as a binary
    counter over the order they run (``VirtualLayout.runs``): a finished virtual rank's buffers are
    added to the pending partial of the same level, carrying upward; at most log2(hosted) partial
    copies are held at once."""

    def __init__(self, buffers: list):
        self.buffers = buffers      # the live DDP grad buffers backward accumulates into
        self.partials: list = []    # (level, [copies of the buffers])

    @staticmethod
    def depth(hosted: int) -> int:
        return hosted.bit_length() - 1

    def push(self) -> None:
        """Take the buffers' current contents as the next leaf (the caller zeroes them after)."""
        carry, level = None, 0
        while self.partials and self.partials[-1][0] == level:
            _, left = self.partials.pop()
            carry = [a.add_(b) for a, b in zip(left, self.buffers if carry is None else carry)]
            level += 1
        self.partials.append((level, [b.clone() for b in self.buffers] if carry is None else carry))

    def write_back(self) -> None:
        """Put the hosted total into the buffers for megatron's cross-rank reduction."""
        (_, total), = self.partials
        for b, t in zip(self.buffers, total):
            b.copy_(t)
        self.partials.clear()
