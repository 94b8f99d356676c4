"""A custom model provider: the default hybrid Nemotron with dense MLP layers twice as wide.

Use it with ``bitdet train --model-provider examples.wider_mlp_provider:provider`` (run from the
repository root, or put this directory's parent on PYTHONPATH). It shows the provider contract:
same signature as ``default_model_provider``, call it, modify what it returns.
"""
from __future__ import annotations

import math

import torch
from megatron.core.ssm.mlp_layer import MLPLayer

from megatron_bitdet.model.builder import default_model_provider

WIDTH_FACTOR = 2


def provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """Dense (``-``) MLP layers get ``WIDTH_FACTOR`` x ffn_hidden_size; their output projection is
    scaled by 1/sqrt(WIDTH_FACTOR) so the residual stream keeps the default's initial scale.

    The run's config is widened only while the model is built: the schedule and DDP read the same
    object later, so a copy would lose the hooks ``train.setup`` attaches to it.
    """
    narrow = config.ffn_hidden_size
    config.ffn_hidden_size = narrow * WIDTH_FACTOR
    try:
        model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    finally:
        config.ffn_hidden_size = narrow
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, MLPLayer):  # the dense ``-`` layers (MoE layers are TransformerLayers)
                layer.mlp.linear_fc2.weight.mul_(1.0 / math.sqrt(WIDTH_FACTOR))
    return model
