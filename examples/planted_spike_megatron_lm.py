"""A planted loss spike for ``bitdet replay`` on a Megatron-LM run, reached from an unmodified launch line:
``pretrain_mamba.py ... --spec examples.planted_spike_megatron_lm spiked_mamba_stack_spec`` builds every
dense MLP's ``linear_fc2`` as a RowParallelLinear whose weights are multiplied by ``SCALE`` in place when
step ``STEP``'s first forward reaches it (a corrupted update that stays; the step is Megatron-LM's own
iteration count, so a replay from a checkpoint before it plants it again). Run from the repository root
(the ranks import ``examples.`` from there)::

    bitdet megatron-lm --nproc 2 --run-dir runs/mlm_spike $MEGATRON_LM_PATH/pretrain_mamba.py $ARGS \\
        --spec examples.planted_spike_megatron_lm spiked_mamba_stack_spec --train-iters 5 \\
        --save runs/mlm_spike_ckpt --save-interval 2
    bitdet replay runs/mlm_spike --step 5       # decoder.layers.2.mlp.linear_fc2 first
    bitdet replay runs/mlm_spike --step 5 --counterfactual prev-params:decoder.layers.2.mlp.linear_fc2

The scaling is a forward pre-hook registered when the layer is built, so a counterfactual's
``prev-params`` (a pre-hook registered later, at the step) replaces what it did, as in ``examples.planted_spike``.
"""
from __future__ import annotations

import copy

import torch
from megatron.core.tensor_parallel import RowParallelLinear

from megatron_bitdet.megatron_lm.specs import local_mamba_stack_spec

STEP, SCALE = 5, 30.0


class SpikedRowLinear(RowParallelLinear):
    """RowParallelLinear (checkpointed as one) whose weights are scaled once, at step ``STEP``'s first forward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_forward_pre_hook(_scale_once_at_step())


def _scale_once_at_step():
    done = set()

    def hook(module, args):
        from megatron.training import get_args

        step = get_args().curr_iteration + 1  # Megatron-LM's iteration count before the step
        if step == STEP and module.training and step not in done:
            done.add(step)
            with torch.no_grad():
                module.weight.mul_(SCALE)
    return hook


# read by megatron as a module attribute (it imports the module and takes the name from its namespace)
spiked_mamba_stack_spec = copy.deepcopy(local_mamba_stack_spec)
spiked_mamba_stack_spec.submodules.mlp_layer.submodules.mlp.submodules.linear_fc2 = SpikedRowLinear
