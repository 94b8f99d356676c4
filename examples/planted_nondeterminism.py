"""Two model providers whose runs diverge, for ``bitdet localize`` to find (run from the repository root):

``provider`` plants an emulated atomic add: on global rank 0 the output projection (``linear_fc2``)
of the first dense MLP layer becomes a split-K GEMM whose partial products are summed by one
dispatcher-visible op, ``bitdet_example::atomic_sum``, in an order drawn from ``os.urandom`` (not
from torch's seeded RNG), like GPU atomics. Float addition is not associative, so the bits differ
run to run; rank 1 receives the difference through collectives.

    bitdet train --recipe recipes/nemotron_h_tiny.yaml --model-provider examples.planted_nondeterminism:provider \\
        --run-dir runs/a training.iterations=3      # twice, runs/a and runs/b; then bitdet localize runs/a runs/b

``index_put_provider`` reproduces the real CPU nondeterminism of docs: megatron's deterministic
embedding path (``weight[ids]``, backward ``index_put_(accumulate=True)``) without torch's
deterministic algorithms; run it with ``determinism.mode=false`` (torch's flag off).
"""
from __future__ import annotations

import random

import torch
from megatron.core.ssm.mlp_layer import MLPLayer

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.model.builder import default_model_provider

SPLITS = 8
PLANT_RANK = 0


@torch.library.custom_op("bitdet_example::atomic_sum", mutates_args=())
def atomic_sum(partials: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in a run-to-run varying order (one op to the dispatcher: inputs equal, output not)."""
    order = random.SystemRandom().sample(range(partials.shape[0]), partials.shape[0])
    out = partials[order[0]].clone()
    for i in order[1:]:
        out += partials[i]
    return out


@atomic_sum.register_fake
def _(partials):
    return partials.new_empty(partials.shape[1:])


def _atomic_sum_backward(ctx, grad):
    return grad.unsqueeze(0).expand(ctx.n, *grad.shape)


atomic_sum.register_autograd(_atomic_sum_backward,
                             setup_context=lambda ctx, inputs, output: setattr(ctx, "n", inputs[0].shape[0]))


class SplitKAtomicLinear(torch.nn.Module):
    """Stands in for a RowParallelLinear without bias (TP1): same weight Parameter, same (out, bias) return."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        slices = torch.arange(x.shape[-1]).chunk(SPLITS)
        partials = torch.stack([x[..., s] @ self.weight[:, s].t() for s in slices])
        return atomic_sum(partials), None


def provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid with the planted split-K atomic sum in the first dense MLP, on rank PLANT_RANK."""
    if config.tensor_model_parallel_size != 1:
        raise BitdetInputError("examples.planted_nondeterminism:provider plants a TP1 linear; use parallel.tensor=1")
    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    if torch.distributed.get_rank() == PLANT_RANK:
        mlp = next((layer.mlp for layer in model.modules() if isinstance(layer, MLPLayer)), None)
        if mlp is None:
            raise BitdetInputError("examples.planted_nondeterminism:provider needs a dense '-' layer in the pattern")
        mlp.linear_fc2 = SplitKAtomicLinear(mlp.linear_fc2)
    return model


def index_put_provider(recipe, config, *, pre_process: bool = True, post_process: bool = True):
    """The default hybrid with megatron's deterministic embedding path switched on for the embedding only."""
    model = default_model_provider(recipe, config, pre_process=pre_process, post_process=post_process)
    if pre_process:
        model.embedding.word_embeddings.deterministic_mode = True
    return model
