"""Optimizer resume check: an optimizer restored from its saved state continues bit for bit like one
that was never interrupted. Run on CPU with torch's Adam and a FusedAdam-layout stand-in (tests), and
on a GPU with the real TE / apex FusedAdam (benchmarks/gpu_check.py)."""
from __future__ import annotations

import io
from typing import Callable

import torch

from megatron_bitdet.compat import checkpoint


class MegatronFP32Optimizer:
    """What a restore reads of megatron's FP32Optimizer around the inner optimizer: ``.optimizer`` and
    a ``load_state_dict`` that hands the state to it (megatron's class needs CUDA for its loss scale)."""

    def __init__(self, inner):
        self.optimizer = inner

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)


def resume_matches(make_optimizer: Callable, *, load: Callable = checkpoint.load_optimizer_state,
                   device="cpu", steps: int = 6, resume_at: int = 3) -> bool:
    """Train ``steps`` uninterrupted; train ``resume_at``, save through bytes, ``load`` the state into a
    fresh optimizer (wrapped as megatron wraps it), train the rest. True when the final parameters and
    both Adam moments are bitwise equal. ``make_optimizer([param])`` builds the optimizer."""
    def train(param, opt, start, stop):
        for step in range(start, stop):
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step)).to(device)
            opt.step()

    start = torch.randn(1024, generator=torch.Generator().manual_seed(0)).to(device)
    ref = torch.nn.Parameter(start.clone())
    ref_opt = make_optimizer([ref])
    train(ref, ref_opt, 0, steps)

    first = torch.nn.Parameter(start.clone())
    first_opt = make_optimizer([first])
    train(first, first_opt, 0, resume_at)
    buf = io.BytesIO()
    torch.save({"param": first.detach(), "optimizer": first_opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True, map_location=device)
    resumed = torch.nn.Parameter(saved["param"].clone())
    opt = make_optimizer([resumed])
    load(MegatronFP32Optimizer(opt), saved["optimizer"])
    train(resumed, opt, resume_at, steps)
    pairs = [(ref, resumed)] + [(ref_opt.state[ref][k], opt.state[resumed][k]) for k in ("exp_avg", "exp_avg_sq")]
    return all(torch.equal(a.detach().view(torch.int32), b.detach().view(torch.int32)) for a, b in pairs)


def load_dropping_group_step(optimizer, state: dict) -> None:
    """A restore with torch Adam's rule applied to every optimizer: the step megatron leaves in the
    param groups is dropped (torch Adam reads only its per-parameter step). What a FusedAdam resume
    would get without compat.checkpoint's group-step rule."""
    optimizer.load_state_dict(state)
    for group in optimizer.optimizer.param_groups:
        group.pop("step", None)
