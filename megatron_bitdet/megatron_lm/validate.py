"""Megatron-LM's own ``validate_args`` on a copy of the parsed args, so bitdet judges and records what
Megatron will build: the defaults it derives (``moe_ffn_hidden_size`` from ``ffn_hidden_size``,
``ffn_hidden_size`` with ``--swiglu``, sequence parallelism off at TP 1, ``num_experts`` 0 -> None, ...).

The copy is validated with the flags bitdet judges itself switched off (``deterministic_mode``: Megatron's
one-at-a-time determinism asserts would hide the full list bitdet gives, and it would switch torch's
deterministic algorithms on in a ``--check``; the flags of ``MEGATRON_FLAG_RULES``: Megatron asserts on them
one at a time too -- ``--tp-comm-overlap`` without sequence parallelism -- and reads the CUDA device's
compute capability for ``--moe-grouped-gemm``; ``fp4``: Megatron compares Transformer Engine's version,
None without TE, and bitdet judges FP4 itself, ``args.fp4_issue``), then those flags are put back as given. The real args are
validated by Megatron afterwards, as always. Megatron's refusal of the line is bad input (exit 2), never a
traceback inside a rank.
"""
from __future__ import annotations

import contextlib
import copy
import io
import os
import traceback
import warnings

from megatron_bitdet.enforce.megatron import MEGATRON_FLAG_RULES
from megatron_bitdet.errors import BitdetInputError

# the hybrid Mamba entry points: pretrain_hybrid.py from Megatron-LM 0.18 (pretrain_mamba.py then runs it)
HYBRID_SCRIPTS = ("pretrain_mamba.py", "pretrain_hybrid.py")
NEUTRAL = {"deterministic_mode": False, "fp4": None, **{flag: False for flag in MEGATRON_FLAG_RULES}}


def validated(args, validate_args, defaults=None, *, world_size: int | None = None):
    """A validated copy of ``args`` (``validate_args``: Megatron's original, unwrapped). ``world_size``:
    the launch's (``--nproc``), where the environment does not say it (a ``--check``)."""
    probe = copy.deepcopy(args)
    if world_size is not None:
        probe.world_size = world_size
    given = {name: getattr(args, name, None) for name in NEUTRAL}
    vars(probe).update(NEUTRAL)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate_args(probe, defaults or {})
        except (AssertionError, ValueError, RuntimeError, TypeError) as exc:
            raise BitdetInputError(f"Megatron-LM's validate_args refuses this launch line: {refusal(exc)}") from None
    vars(probe).update(given)
    return probe


# what this machine cannot run is judged by machine.missing (and FP8 / FP4 by args): megatron-core's config
# asserts on these (the fused RoPE / permute kernels, TE's version) are that section's, not the line's
MACHINE_NEUTRAL = {"apply_rope_fusion": False, "moe_permute_fusion": False, "moe_router_fusion": False,
                   "gradient_accumulation_fusion": False, "masked_softmax_fusion": False, "no_persist_layer_norm": True,
                   "tp_comm_overlap": False, "cuda_graph_impl": "none", "batch_invariant_mode": False}


def model_config_refusal(config) -> list[str]:
    """Megatron-LM's model config built from the validated line as the ranks' model builder builds it
    (``core_transformer_config_from_args``): a ``TransformerConfig`` assert (``--fp8-param-gather`` left without
    ``--fp8-format``) refuses the line before any rank starts instead of in each rank at model build. The copy has
    the flags bitdet judges itself off, as for ``validated``, with the machine's (``MACHINE_NEUTRAL``) and FP8
    (its ``--fp8-param-gather`` with it: ``args.fp8_issue`` and the machine section judge it)."""
    from megatron.training.arguments import core_transformer_config_from_args

    probe = copy.copy(config)
    vars(probe).update({**NEUTRAL, **MACHINE_NEUTRAL})
    if getattr(probe, "fp8", None):
        probe.fp8, probe.fp8_param_gather = None, False
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            core_transformer_config_from_args(probe)
        except (AssertionError, ValueError, RuntimeError, TypeError) as exc:
            return [f"Megatron-LM's model config (TransformerConfig) refuses this launch line: {refusal(exc)}"]
    return []


def refusal(exc: BaseException) -> str:
    """Megatron's message and where it was raised; for a bare ``assert`` (no message) the asserted source line:
    ``megatron/training/arguments.py:1234: assert args.save_interval is not None``."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    path = frame.filename.replace(os.sep, "/")
    where = f"{path[path.rindex('megatron/'):] if 'megatron/' in path else path}:{frame.lineno}"
    message = str(exc).strip()
    return f"{message} ({where})" if message else f"{where}: {frame.line or type(exc).__name__}"


def unsupported(args, script: str) -> list[str]:
    """Production flags bitdet cannot hold to its guarantees (or Megatron cannot build), refused before any
    rank starts (exit 2), each naming the flag and the fix, every one at once: 0.16.1's ``MambaStack`` asserts
    the virtual pipeline away (0.18+: Megatron's own ``validate_args`` refuses the flags beside a hybrid pattern,
    reported as its refusal; ``compat.hybrid_stack``), and its ``MambaMixer`` the head / group counts that do
    not divide (``_mamba_heads``)."""
    from megatron_bitdet.compat.hybrid_stack import stack_refuses_virtual_pipeline

    problems = []
    if script in HYBRID_SCRIPTS and getattr(args, "virtual_pipeline_model_parallel_size", None) \
            and stack_refuses_virtual_pipeline():
        problems.append("--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank: "
                        "megatron-core's MambaStack asserts 'The Mamba hybrid model does not currently support "
                        "virtual/interleaved pipeline parallelism'; fix: drop it (pretrain_gpt.py takes it)")
    if script in HYBRID_SCRIPTS:
        problems += _mamba_heads(args)
    return problems


def _mamba_heads(args) -> list[str]:
    """megatron-core's ``MambaMixer.__init__`` arithmetic (the same asserts in 0.16.1 and 0.19.2) on the flags
    (``expand``: the ``--spec``'s mixer params, else 2): heads from ``--mamba-num-heads``, else ``expand *
    --hidden-size / --mamba-head-dim``; every TP rank one head and one group, every group whole heads. Each
    assert it would raise in every rank."""
    from megatron_bitdet.megatron_lm.args import _mixer_param, hybrid_pattern

    if "M" not in hybrid_pattern(args):
        return []
    groups, head_dim, tp = args.mamba_num_groups, args.mamba_head_dim, args.tensor_model_parallel_size
    heads, expand = args.mamba_num_heads, _mixer_param("expand")(args)
    if min(groups, head_dim, 1 if heads is None else heads) <= 0:
        return [f"--mamba-num-groups {groups} / --mamba-head-dim {head_dim} / --mamba-num-heads {heads}: "
                "megatron-core's MambaMixer asserts each positive; fix: set it to a positive count"]
    if heads is None:
        inner = int(expand * args.hidden_size)
        if inner % head_dim:
            return [f"--hidden-size {args.hidden_size} / --mamba-head-dim {head_dim}: megatron-core's MambaMixer "
                    f"asserts 'd_inner must be evenly divisible by headdim' (d_inner {inner}); fix: add "
                    f"--mamba-head-dim dividing {inner}, or --mamba-num-heads"]
        heads = inner // head_dim
    named = f"--mamba-num-heads {args.mamba_num_heads}" if args.mamba_num_heads is not None else \
        f"{heads} Mamba heads (--hidden-size {args.hidden_size} x expand {expand} / --mamba-head-dim {head_dim})"
    out = []
    if heads % groups:
        fit = max((g for g in range(tp, min(groups, heads) + 1, tp) if heads % g == 0), default=None)
        out.append(f"{named} with --mamba-num-groups {groups}: megatron-core's MambaMixer asserts 'nheads must be "
                   f"evenly divisible by ngroups'; fix: set --mamba-num-groups {fit or 'G dividing the heads'} "
                   f"(or --mamba-num-heads / --mamba-head-dim / --hidden-size giving a multiple of {groups} heads)")
    for what, n, flag in ((named, heads, "nheads"), (f"--mamba-num-groups {groups}", groups, "ngroups")):
        if n % tp:
            out.append(f"{what} at --tensor-model-parallel-size {tp}: megatron-core's MambaMixer asserts '{flag} "
                       f"must be evenly divisible by tp_size'; fix: a multiple of {tp} (or a smaller "
                       "--tensor-model-parallel-size)")
    return out
