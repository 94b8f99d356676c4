"""Two planted loss-spike causes for ``bitdet replay`` to take apart (run from the repository root).

``provider`` plants both, keyed on the iteration (``train.loop.current_step``), so a replay of the
step reproduces them:

- at ``EXPERT_STEP`` the output of expert ``EXPERT`` of MoE layer ``LAYER`` is multiplied by
  ``EXPERT_SCALE`` (for that step only, as if the expert's output projection had been scaled);
- at ``OUTPUT_STEP`` the output layer's weights are multiplied by ``OUTPUT_SCALE`` in place when the
  step's first forward reaches it (a corrupted update that stays): the logits grow and the loss spikes.

    bitdet train --recipe recipes/nemotron_h_tiny.yaml --nproc 2 --run-dir runs/spike --save-interval 2 \\
        --model-provider examples.planted_spike:provider training.iterations=8
    bitdet replay runs/spike --step 7                                         # output_layer first
    bitdet replay runs/spike --step 7 --counterfactual prev-params:output_layer
    bitdet replay runs/spike --step 5                                         # expert 1 of layer 2 first
    bitdet replay runs/spike --step 5 --counterfactual zero-expert:2.1
"""
from __future__ import annotations

import torch

from megatron_bitdet.model.builder import default_model_provider
from megatron_bitdet.train.loop import current_step

EXPERT_STEP, LAYER, EXPERT, EXPERT_SCALE = 5, 2, 1, 1.0e5
OUTPUT_STEP, OUTPUT_SCALE = 7, 10.0


def provider(recipe, config, *, pre_process=True, post_process=True):
    from megatron.core import parallel_state as ps

    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    experts = model.decoder.layers[LAYER].mlp.experts
    local = EXPERT - ps.get_expert_model_parallel_rank() * experts.num_local_experts
    if 0 <= local < experts.num_local_experts:  # the rank holding the expert
        experts.register_forward_hook(_expert_scaler(local))
    if post_process:
        model.output_layer.register_forward_pre_hook(_weight_scaler())
    return model


def _expert_scaler(local: int):
    def hook(module, args, output):
        if current_step() != EXPERT_STEP:
            return None
        out, bias = output
        counts = [int(c) for c in args[1].tolist()] if isinstance(args[1], torch.Tensor) else list(args[1])
        start = sum(counts[:local])
        scale = torch.ones(out.shape[0], 1, dtype=out.dtype, device=out.device)
        scale[start:start + counts[local]] = EXPERT_SCALE
        return out * scale, bias
    return hook


def _weight_scaler():
    done = set()

    def hook(module, args):
        if current_step() == OUTPUT_STEP and OUTPUT_STEP not in done:
            done.add(OUTPUT_STEP)
            with torch.no_grad():
                module.weight.mul_(OUTPUT_SCALE)
    return hook
