"""Megatron-LM's checkpointed RNG states under expert parallelism, across versions.

megatron-core seeds each expert-parallel rank's tracker stream apart (``expert-parallel-rng``: seed + 1024 +
100 x EP rank + expert-TP rank), and the router's jitter and expert dropout draw from it. Megatron-LM
``core_v0.16.1``'s ``checkpointing.get_rng_state`` shards the saved states by DP rank when EP > 1, so each rank
restores its own. From 0.17 (read in the 0.17.1, 0.18.2 and 0.19.2 sources) it shards them by (PP, TP) only,
with ``replica_id`` the DP rank, under EP too: dist-checkpointing writes DP rank 0's states and every DP rank
restores them, so an EP rank > 0 resumes on rank 0's expert stream (on 0.19.2, ``bitdet verify-resume`` of an
EP 2 line: rank 1's ``expert-parallel-rng`` differed after the resume; upstream Megatron-LM PR #6858). From
0.17, under EP > 1, bitdet's launches shard the states by DP rank again, as 0.16.1 does: the same function
describes what is saved and what is loaded, so both sides agree. A checkpoint another 0.17+ launch wrote with
EP > 1 holds the (PP, TP) layout and does not load under it.
"""
from __future__ import annotations

import functools
import sys

from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.rebind import rebind
from megatron_bitdet.compat.versions import megatron_core_version, supports


def install() -> bool:
    """Wrap ``checkpointing.get_rng_state`` where it loses the EP ranks' states (0.17+); True if it did here."""
    if supports(megatron_core_version(), SpecifierSet("<0.17")):
        return False
    from megatron.training import checkpointing

    original = checkpointing.get_rng_state
    if getattr(original, "_bitdet_ep_sharded", False):
        return False

    @functools.wraps(original)
    def get_rng_state(*args, **kwargs):
        return per_dp_rank(original(*args, **kwargs), kwargs.get("dp_cp_group"))

    get_rng_state._bitdet_ep_sharded = True
    rebind({original: get_rng_state}, [m for n, m in list(sys.modules.items())
                                       if n.startswith("megatron.training") and m is not None])
    return True


def per_dp_rank(state, dp_cp_group=None):
    """``state`` (what ``get_rng_state`` returns) sharded by DP (with CP) rank as well, with no replicas, when
    it is a dist-checkpointing object and EP > 1; otherwise unchanged."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if not isinstance(state, ShardedObject) or mpu.get_expert_model_parallel_world_size() <= 1:
        return state
    if dp_cp_group is None:
        dp_cp_group = mpu.get_data_parallel_group(with_context_parallel=True)
    import torch

    rank, size = torch.distributed.get_rank(dp_cp_group), torch.distributed.get_world_size(dp_cp_group)
    return ShardedObject(state.key, state.data, (*state.global_shape, size), (*state.global_offset, rank),
                         replica_id=0)
