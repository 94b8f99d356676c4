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

import io

import pytest
import torch

from megatron_bitdet.compat import checkpoint


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


class MegatronFP32Optimizer:
    """What the restore reads of megatron's FP32Optimizer around the inner optimizer: ``.optimizer``
    and a ``load_state_dict`` that hands the state to it (megatron's class needs CUDA for its scale)."""

    def __init__(self, inner):
        self.optimizer = inner

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


STEPS, RESUME_AT = 6, 3


def _train(param, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step))
        opt.step()


def _resumed_equals_uninterrupted(make_opt) -> bool:
    """Train STEPS uninterrupted; train RESUME_AT, save through bytes, restore into a fresh optimizer
    with compat.checkpoint, train the rest. Bitwise equal final parameters and moments?"""
    start = torch.randn(16, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.Parameter(start.clone())
    ref_opt = make_opt([ref])
    _train(ref, ref_opt, 0, STEPS)

    first = torch.nn.Parameter(start.clone())
    first_opt = make_opt([first])
    _train(first, first_opt, 0, RESUME_AT)
    buf = io.BytesIO()
    torch.save({"param": first.detach(), "optimizer": first_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = torch.nn.Parameter(saved["param"].clone())
    opt = make_opt([resumed])
    checkpoint.load_optimizer_state(MegatronFP32Optimizer(opt), saved["optimizer"])
    _train(resumed, opt, RESUME_AT, STEPS)
    pairs = [(ref, resumed)] + [(ref_opt.state[ref][k], opt.state[resumed][k]) for k in ("exp_avg", "exp_avg_sq")]
    return all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs)


@pytest.mark.parametrize("make_opt", [torch.optim.Adam, torch.optim.AdamW, FusedAdam])
def test_resume_is_bitwise_for_both_step_layouts(make_opt):
    assert _resumed_equals_uninterrupted(make_opt)


def test_fused_adam_resume_diverges_without_the_group_step_rule(monkeypatch):
    """The rule is needed: treated like torch Adam (its serialized group step dropped), a FusedAdam
    restarts its bias correction at step 1 and the resumed run diverges from the uninterrupted one."""
    monkeypatch.setattr(checkpoint, "keeps_per_param_step", lambda inner: True)
    assert not _resumed_equals_uninterrupted(FusedAdam)
