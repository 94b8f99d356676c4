"""Resuming an Adam whose step lives where megatron's optimizer keeps it: per parameter (torch Adam/AdamW,
megatron's optimizer on CPU) or per param group (TE's and apex's FusedAdam, megatron's optimizer when
either is installed). The FusedAdam case needs compat.checkpoint's rule: without it the resume diverges.

The FusedAdam state layout reproduced by the stand-in below, from the sources:
- transformer_engine/pytorch/optimizers/fused_adam.py (NVIDIA/TransformerEngine, read at 04912bf0):
  ``step()`` does ``group["step"] += 1`` (``= 1`` on the first call; an int unless capturable) before the
  update, and passes ``group["step"]`` to ``multi_tensor_adam`` for the bias correction; the per-parameter
  state is ``exp_avg`` and ``exp_avg_sq`` (fp32 by default, zero-initialized; ``master_param`` only with
  master_weights), with no per-parameter step; ``adam_w_mode=True`` by default (decoupled weight decay);
  ``state_dict()`` is torch's, so the group step is saved with the param groups.
- apex/optimizers/fused_adam.py (NVIDIA/apex): the same ``group['step']`` counter and moment names.
megatron-core 0.16.1 imports TE's FusedAdam, else apex's, else torch's AdamW (megatron/core/optimizer/__init__.py).
"""
from __future__ import annotations

import pytest
import torch

from megatron_bitdet.testing.optimizer import load_dropping_group_step, resume_matches


class FusedAdam(torch.optim.Optimizer):
    """Stand-in for TE's FusedAdam (a CUDA multi-tensor kernel, absent here), with its state layout
    and its update arithmetic in torch ops (AdamW mode, bias correction from the group step). It
    carries TE's module name, which is what compat.checkpoint sees of the real class."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "bias_correction": True})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (v / (1 - beta2 ** group["step"])).sqrt_().add_(group["eps"])
                update = m / (1 - beta1 ** group["step"]) / denom + group["weight_decay"] * p
                p.sub_(group["lr"] * update)


FusedAdam.__module__ = "transformer_engine.pytorch.optimizers.fused_adam"


@pytest.mark.parametrize("make_opt", [torch.optim.Adam, torch.optim.AdamW, FusedAdam])
def test_resume_is_bitwise_for_both_step_layouts(make_opt):
    assert resume_matches(make_opt)


def test_fused_adam_resume_diverges_without_the_group_step_rule():
    """The rule is needed: treated like torch Adam (the group step megatron saved dropped), a FusedAdam
    restarts its bias correction at step 1 and the resumed run diverges from the uninterrupted one."""
    assert not resume_matches(FusedAdam, load=load_dropping_group_step)
    assert resume_matches(torch.optim.AdamW, load=load_dropping_group_step)  # torch's own step is per parameter
