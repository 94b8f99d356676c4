"""megatron-core's MoE aux-loss tracker (each router records its layer's load-balancing loss into it),
across versions, for bitdet's own loop and fingerprints.

Before 0.18 the tracker is ``moe_utils``' module-level dict (``get_moe_layer_wise_logging_tracker()``),
written in place and reduced by ``moe_utils.reduce_aux_losses_tracker_across_ranks``. From 0.18 it is
``moe_logging.MoEMetricsTracker`` (``MetricEntry`` entries, reduced by its ``_sync_metrics``); the deprecated
``get_moe_layer_wise_logging_tracker()`` builds a new dict on every call, so an entry added to it is lost. A
pipeline stage without MoE layers adds one so that it joins the PP sum its other stages run: on 0.19.2 a
2-rank PP 2 run of ``M*-M*E`` hung at step 1 (the stage without experts left the sum out). Both reductions
are the ``moe_aux_loss`` swap's targets, so under it the rank-ordered sums run.
"""
from __future__ import annotations

import torch
from packaging.specifiers import SpecifierSet

from megatron_bitdet.compat.versions import megatron_core_version, supports


def _metrics_tracker():
    """0.18+'s tracker object; None before 0.18 (the module-level dict)."""
    if supports(megatron_core_version(), SpecifierSet("<0.18")):
        return None
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def entries() -> dict[str, dict]:
    """name -> {"values" (the live per-layer tensor), "reduce_group", "avg_group"} for each tracked loss."""
    tracker = _metrics_tracker()
    if tracker is None:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return get_moe_layer_wise_logging_tracker()
    return {name: {"values": e.values, "reduce_group": e.reduce_group, "avg_group": e.avg_group}
            for name, e in tracker.metrics.items()}


def entry(name: str, num_layers: int) -> dict:
    """``name``'s entry, created with ``num_layers`` zeros in the tracker itself where this rank recorded none."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tracker = _metrics_tracker()
    if tracker is not None:
        tracker.ensure_initialized(name, num_layers, device)
    else:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().setdefault(name, {
            "values": torch.zeros(num_layers, device=device), "reduce_group": None, "avg_group": None,
            "reduce_group_has_dp": False})
    return entries()[name]


def reduce(names: list[str]) -> None:
    """megatron's reduction of these entries across ranks (PP sum, reduce group, DP average), in place."""
    tracker = _metrics_tracker()
    if tracker is None:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.reduce_aux_losses_tracker_across_ranks(names)  # the module global: the <0.18 swap's target
    else:
        tracker._sync_metrics(names, None)  # the class attribute: the 0.18+ swap's target


def clear() -> None:
    """Zero every entry (megatron's own call on every version)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
