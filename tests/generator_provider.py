"""A model provider whose model draws from its own torch.Generator (a custom noise/dropout source):
state outside megatron's RNG tracker that a checkpoint must carry for a resume to hold."""
from __future__ import annotations

import torch

from megatron_bitdet.model.builder import default_model_provider


class NoiseSource(torch.nn.Module):
    """No parameters or buffers: only a generator, advanced by every forward."""

    def __init__(self, seed: int):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def add_noise(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-2 * torch.randn(x.shape, generator=self.gen, dtype=x.dtype).to(x.device)


def provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    model.noise = NoiseSource(seed=7 + torch.distributed.get_rank())
    if pre_process:
        model.embedding.register_forward_hook(lambda module, args, out: model.noise.add_noise(out))
    return model
