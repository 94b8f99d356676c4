"""Swaps that cannot silently miss (compat.patching.verify), against the installed megatron-core: a target
that only re-exports, a binding of the original the declaration does not name, a target nothing calls, and
class-attribute targets (megatron-core 0.18+ reduces the aux losses in ``MoEMetricsTracker._sync_metrics``).
The re-export and the extra caller are real modules executing real imports of megatron-core, registered
under ``megatron.core`` for the test only (as 0.18's ``ssm/mamba_block.py`` is ``import *`` of another)."""
from __future__ import annotations

import importlib
import re
import sys
import types

import pytest
import torch

from megatron_bitdet.compat import cpu_backend
from megatron_bitdet.compat.patching import (
    applied_patches, apply_patches, load_declarations, parse_declaration, patched, revert_patches)
from megatron_bitdet.errors import BitdetError

cpu_backend.install()  # the Mamba mixer imports GPU-only modules without it

CALLS = []


def counting_set_loss_scale(scale):
    """A test replacement: records that megatron's own class attribute lookup reached it."""
    CALLS.append(scale)


@pytest.fixture
def megatron_module():
    """Registers ``megatron.core.<name>`` built from ``source`` (real imports, run for real); removes it after."""
    made = []

    def make(name, source):
        module = types.ModuleType(name)
        sys.modules[name] = module
        made.append(name)
        exec(compile(source, f"<{name}>", "exec"), module.__dict__)
        return module

    yield make
    for name in made:
        del sys.modules[name]
    assert applied_patches() == []


def _decl(*swaps, **extra):
    return parse_declaration({"id": "t", "rule": "t", "why": "test", "swaps": list(swaps), **extra}, "t.yaml")


def _refused(decl, *fragments):
    try:
        apply_patches([decl])
    except BitdetError as exc:
        message = str(exc)
    else:
        revert_patches()
        pytest.fail(f"{decl.source} was applied")
    assert applied_patches() == [] and "nothing was patched" in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_re_export_target_is_refused_naming_the_binding_megatron_calls(megatron_module):
    """0.18 made ``ssm.mamba_block`` a re-export: local_final_norm's target there would patch nothing. The
    module whose TENorm the installed megatron-core's stack calls is re-exported here the same way."""
    from megatron_bitdet.compat.versions import megatron_core_version

    (real,) = [s for s in load_declarations(ids=["local_final_norm"])[0].swaps if s.applies(megatron_core_version())]
    caller = real.targets[0]  # the stack's module: ssm.mamba_block before 0.18, models.hybrid.hybrid_block after
    stack = importlib.import_module(caller.split(":")[0])
    swap = dict(replacement="megatron_bitdet.model.norm:LocalNorm", targets=["megatron.core.ssm.bitdet_moved:TENorm"],
                untouched={**real.untouched, caller: "the caller"})
    megatron_module("megatron.core.ssm.bitdet_moved", f"from {stack.__name__} import *\n")
    before = stack.TENorm
    message = _refused(_decl(swap), "megatron.core.ssm.bitdet_moved:TENorm is only a re-export")
    assert re.search(r"megatron calls it through [^)]*" + re.escape(caller), message), message
    assert stack.TENorm is before and sys.modules["megatron.core.ssm.bitdet_moved"].TENorm is before
    # a re-export megatron-core 0.16.1 ships: the tensor_parallel package's ColumnParallelLinear
    _refused(_decl(dict(replacement="megatron_bitdet.kernels.fp8_linear:EmulatedFP8ColumnParallelLinear",
                        targets=["megatron.core.tensor_parallel:ColumnParallelLinear"])),
             "megatron.core.tensor_parallel:ColumnParallelLinear is only a re-export",
             "megatron.core.tensor_parallel.layers:ColumnParallelLinear also binds the original")


def test_an_undeclared_binding_of_the_original_is_refused(megatron_module):
    """A megatron module that copied the function (``from m import f``) and calls its own copy."""
    megatron_module("megatron.core.transformer.moe.bitdet_caller",
                    "from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func\n"
                    "def loss(*args, **kwargs):\n    return switch_load_balancing_loss_func(*args, **kwargs)\n")
    _refused(load_declarations(ids=["moe_aux_loss"])[0],
             "megatron.core.transformer.moe.bitdet_caller:switch_load_balancing_loss_func also binds the original "
             "of megatron.core.transformer.moe.moe_utils:switch_load_balancing_loss_func")


def test_a_target_nothing_calls_is_refused_until_something_does(megatron_module):
    megatron_module("megatron.core.bitdet_orphan", "def orphan():\n    return 1\n")
    decl = _decl(dict(replacement="megatron_bitdet.kernels.moe_aux:rank_ordered_sum",
                      targets=["megatron.core.bitdet_orphan:orphan"]))
    _refused(decl, "nothing in megatron-core calls megatron.core.bitdet_orphan:orphan any more")
    megatron_module("megatron.core.bitdet_user",  # a caller through the module attribute: the definition is it
                    "from megatron.core import bitdet_orphan\ndef use():\n    return bitdet_orphan.orphan()\n")
    with patched([decl]):
        assert sys.modules["megatron.core.bitdet_user"].use.__globals__["bitdet_orphan"].orphan.__name__ == \
            "rank_ordered_sum"


def test_a_class_attribute_target_reaches_megatron_callers_and_is_judged(megatron_module):
    """``Class.method`` targets: megatron's schedules call ``MoEAuxLossAutoScaler.set_loss_scale`` (a
    static method: the replacement stays static); inherited or overridden methods are refused."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    target = "megatron.core.transformer.moe.moe_utils:MoEAuxLossAutoScaler.set_loss_scale"
    original = vars(MoEAuxLossAutoScaler)["set_loss_scale"]
    decl = _decl(dict(replacement="test_patch_targets:counting_set_loss_scale", targets=[target]))
    CALLS.clear()
    with patched([decl]) as records:
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(2.0))
        MoEAuxLossAutoScaler().set_loss_scale(torch.tensor(3.0))
    assert [c.item() for c in CALLS] == [2.0, 3.0] and records[0]["swaps"][0]["targets"] == [target]
    assert vars(MoEAuxLossAutoScaler)["set_loss_scale"] is original  # reverted, static as before

    _refused(_decl(dict(replacement="test_patch_targets:counting_set_loss_scale",
                        targets=["megatron.core.transformer.moe.router:TopKRouter.set_layer_number"])),
             "TopKRouter.set_layer_number is not defined on TopKRouter: it is inherited from "
             "megatron.core.transformer.moe.router:Router.set_layer_number")
    megatron_module("megatron.core.transformer.moe.bitdet_scaler",
                    "from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler\n"
                    "class Scaler(MoEAuxLossAutoScaler):\n"
                    "    @staticmethod\n    def set_loss_scale(scale):\n        pass\n")
    _refused(decl, "megatron.core.transformer.moe.bitdet_scaler:Scaler.set_loss_scale overrides " + target)


def test_a_swap_applies_only_to_its_versions():
    """moe_aux_loss reduces the tracker through the module function before 0.18 and through
    ``MoEMetricsTracker._sync_metrics`` from 0.18 on: the installed version gets exactly one of them."""
    from megatron_bitdet.compat.versions import megatron_core_version

    (decl,) = load_declarations(ids=["moe_aux_loss"])
    replacements = {s.replacement.split(":")[1]: s.applies(megatron_core_version()) for s in decl.swaps}
    assert replacements["switch_load_balancing_loss_func"]
    assert replacements["reduce_aux_losses_tracker_across_ranks"] != replacements["sync_metrics"]
    moe_logging = importlib.util.find_spec("megatron.core.transformer.moe.moe_logging")
    assert replacements["sync_metrics"] == (moe_logging is not None)  # the tracker class exists exactly there
    with patched([decl]) as records:
        applied = {s["replacement"].split(":")[1] for s in records[0]["swaps"]}
    assert applied == {name for name, on in replacements.items() if on}
