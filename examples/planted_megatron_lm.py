"""The planted op of ``examples.planted_nondeterminism`` (``bitdet_example::atomic_sum``, a split-K sum in an
order drawn from ``os.urandom``) reached from an unmodified Megatron-LM launch line under
``--deterministic-mode``: ``pretrain_mamba.py ... --spec examples.planted_megatron_lm planted_mamba_stack_spec``
builds every dense MLP's ``linear_fc2`` as that split-K linear, on every rank (every rank builds the same
spec). Run from the repository root (the ranks import ``examples.`` from there); README, "Megatron-LM users".

A module of its own because building a layer spec imports megatron's Mamba stack, which a fresh process
without bitdet's CPU seams cannot import: the op's home module stays importable for the kernel rung's replay.
"""
from __future__ import annotations

import copy

from examples.planted_nondeterminism import SplitKAtomicLinear
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.megatron_lm.specs import local_mamba_stack_spec


class SplitKAtomicRowLinear(SplitKAtomicLinear):
    """The planted linear as a layer-spec entry: megatron builds it with RowParallelLinear's arguments,
    and the linear that makes (its weight initialized as megatron initializes it) is the one replaced."""

    def __init__(self, *args, **kwargs):
        from megatron.core.tensor_parallel import RowParallelLinear

        if kwargs["config"].tensor_model_parallel_size != 1:
            raise BitdetInputError("examples.planted_megatron_lm:planted_mamba_stack_spec plants a TP1 linear; "
                                   "use --tensor-model-parallel-size 1")
        super().__init__(RowParallelLinear(*args, **kwargs))


# read by megatron as a module attribute (it imports the module and takes the name from its namespace)
planted_mamba_stack_spec = copy.deepcopy(local_mamba_stack_spec)
planted_mamba_stack_spec.submodules.mlp_layer.submodules.mlp.submodules.linear_fc2 = SplitKAtomicRowLinear
