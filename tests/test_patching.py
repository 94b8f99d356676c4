"""The declared swaps against the installed megatron-core: targets exist, every binding is covered,
megatron's own call paths reach the replacements, revert restores, versions are enforced."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import sys
from unittest.mock import NonCallableMock

import pytest
import torch
import yaml

from megatron_bitdet.compat import cpu_backend
from megatron_bitdet.compat.patching import verify
from megatron_bitdet.compat.rebind import megatron_modules
from megatron_bitdet.errors import BitdetError, BitdetInputError
from megatron_bitdet.kernels import moe_aux
from megatron_bitdet.kernels.grouped_mlp import GroupedProbMLP
from megatron_bitdet.compat.patching import (
    applied_patches,
    apply_patches,
    load_declaration,
    load_declarations,
    megatron_core_version,
    patched,
    revert_patches,
    split_symbol,
)

cpu_backend.install()  # the Mamba mixer imports GPU-only modules without it

from test_kernels_moe import megatron_1rank, moe_config  # noqa: E402,F401  (shared fixture)

DECLS = load_declarations()
SWAPS = [(d.id, s) for d in DECLS for s in d.swaps if s.applies(megatron_core_version())]  # the installed version's
TARGETS = [(pid, t, s.optional_binding) for pid, s in SWAPS for t in s.targets]
_ABSENT = object()


@pytest.fixture(autouse=True)
def nothing_left_applied():
    yield
    if applied_patches():
        revert_patches()
        pytest.fail("a test left patches applied")


def _current(symbol):
    """The value bound now (a ``Class.attr`` target: the class's own attribute)."""
    module, attr = split_symbol(symbol)
    owner = importlib.import_module(module)
    for part in attr.split(".")[:-1]:
        owner = vars(owner)[part]
    value = vars(owner).get(attr.split(".")[-1], _ABSENT)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def _resolve(symbol):
    module, attr = split_symbol(symbol)
    return getattr(importlib.import_module(module), attr)


def test_declarations_cover_the_rule_ids():
    assert {d.id: d.rule for d in DECLS} == {
        "moe_aux_loss": "moe_router_fusion",
        "grouped_gemm_dprob": "te_grouped_gemm",
        "ssd_scan": "mamba_ssm_nondeterministic",
        "gated_rmsnorm": "mamba_ssm_nondeterministic",
        "causal_conv1d": "causal_conv1d_old",
        "local_final_norm": "local_spec",
        "fp8_emulated_linear": "local_spec",
        "fp4_emulated_linear": "local_spec",
    }
    from megatron_bitdet.enforce import RULES_BY_ID

    swaps_by_rule = {r.id: r.swap for r in RULES_BY_ID.values() if r.swap}
    # every patch serves a real rule (gated_rmsnorm rides along with the SSD swap), or the local spec
    assert all(d.rule in RULES_BY_ID or d.rule == "local_spec" for d in DECLS)
    assert set(swaps_by_rule.values()) <= {d.id for d in DECLS}
    for _, swap in SWAPS:
        replacement = _resolve(swap.replacement)
        assert callable(replacement) or replacement is True  # a class/function, or a HAVE_* flag


@pytest.mark.parametrize("pid,target,optional", TARGETS, ids=[t for _, t, _ in TARGETS])
def test_target_exists_and_megatron_code_reads_it(pid, target, optional):
    """Present (unless megatron binds it only when a GPU package imports), and either read as a
    global by code of its module (a call site) or defined there (reached by ``module.attr``
    callers): a megatron upgrade that moves the call site fails here."""
    module_name, attr = split_symbol(target)
    module = importlib.import_module(module_name)
    if "." in attr:  # a class attribute: defined on that class, looked up by megatron code
        cls_name, attr = attr.split(".")
        assert attr in vars(vars(module)[cls_name]), f"{target} is gone from megatron-core"
        assert any(attr in verify.module_reads(m, vars(vars(module)[cls_name])[attr]) for m in megatron_modules())
        return
    if not optional:
        assert attr in module.__dict__, f"{target} is gone from megatron-core"
    value = module.__dict__.get(attr)
    defined_here = getattr(value, "__module__", None) == module_name and getattr(value, "__name__", None) == attr
    assert defined_here or attr in verify.module_reads(module), f"no code in {module_name} reads {attr!r} any more"


def _import_megatron_modules():
    # post_training: the entry points import its ModelOpt specs (0.18+: they bind TENorm)
    for package in ("megatron.core.transformer", "megatron.core.models", "megatron.core.ssm",
                    "megatron.core.post_training"):
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            try:
                importlib.import_module(info.name)
            except Exception:  # GPU-only modules; what did import is scanned
                pass


@pytest.mark.parametrize("pid,swap", SWAPS, ids=[pid for pid, _ in SWAPS])
def test_every_binding_of_the_original_is_declared(pid, swap):
    """``from m import f`` makes copies: every megatron module holding the original must be a
    target or listed as untouched (with a reason)."""
    originals = {id(v): v for v in map(_current, swap.targets) if v is not _ABSENT and v is not None}
    originals = {k: v for k, v in originals.items() if not isinstance(v, NonCallableMock)}  # CPU stand-ins
    originals = {k: v for k, v in originals.items() if not isinstance(v, (bool, int))}  # shared constants
    if not originals:
        rule = next(d.rule for d in DECLS if d.id == pid)
        package = {"causal_conv1d_old": "causal-conv1d", "mamba_ssm_nondeterministic": "mamba-ssm"}.get(rule)
        pytest.skip(f"megatron holds no real original of {pid} here: needs the GPU package "
                    f"{package or 'that ' + pid + ' replaces'} (not installed)")
    _import_megatron_modules()
    holders = {
        f"{name}:{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith("megatron.core.") and module is not None
        for attr, value in list(vars(module).items())
        if id(value) in originals and value is originals[id(value)]
    }
    assert holders - set(swap.targets) - set(swap.untouched) == set()


def test_revert_restores_every_original_binding():
    before = {t: _current(t) for _, t, _ in TARGETS}
    records = apply_patches(DECLS)
    assert [r["id"] for r in records] == [d.id for d in DECLS] == [r["id"] for r in applied_patches()]
    # fp8_emulated_linear and fp4_emulated_linear swap the same bindings (a recipe selects one of
    # them); applied together, the later one holds them
    holder = {target: swap.replacement for _, swap in SWAPS for target in swap.targets}
    for target, replacement in holder.items():
        assert _current(target) is _resolve(replacement)
    assert revert_patches() == [d.id for d in DECLS]
    assert all(_current(t) is v for t, v in before.items())
    assert applied_patches() == []


def test_router_aux_loss_paths_reach_the_fixed_order_kernel(megatron_1rank):
    """megatron's TopKRouter (all three aux-loss kinds) ends up with our autograd node in its graph."""
    from megatron.core.transformer.moe.router import TopKRouter

    def kernels_in_graph(probs):
        found, stack, seen = set(), [probs.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            found.add(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
            try:
                stack.extend(t.grad_fn for t in node.saved_tensors)  # MoEAuxLossAutoScaler keeps the loss
            except (AttributeError, RuntimeError):
                pass
        return found

    x = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(0))
    for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
        config = moe_config(moe_router_load_balancing_type=kind)
        torch.manual_seed(0)
        plain = TopKRouter(config, pg_collection=_pg())
        assert "FixedOrderAuxLossBackward" not in kernels_in_graph(plain(x)[0])
        with patched(load_declarations(ids=["moe_aux_loss"])):
            torch.manual_seed(0)
            router = TopKRouter(config, pg_collection=_pg())
            assert "FixedOrderAuxLossBackward" in kernels_in_graph(router(x)[0]), kind


def _pg():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def test_aux_tracker_reduction_reaches_the_rank_ordered_version(megatron_1rank, monkeypatch):
    """What Megatron-LM's training_log calls to reduce the aux losses (``track_moe_metrics`` before 0.18,
    ``get_moe_metrics_tracker().report`` after) reaches the rank-ordered sums, and only when swapped."""
    from megatron.core.transformer.moe import moe_utils

    calls = []
    real = moe_aux.rank_ordered_sum

    def counting(tensor, group=None):
        calls.append(tensor.clone())
        return real(tensor, group)

    monkeypatch.setattr(moe_aux, "rank_ordered_sum", counting)  # our module, not megatron's

    def logged():
        moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.75), 1, 1)
        totals = {}
        try:
            from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
        except ImportError:
            moe_utils.track_moe_metrics(loss_scale=1.0, iteration=1, total_loss_dict=totals, num_layers=1)
        else:
            get_moe_metrics_tracker().report(loss_scale=1.0, iteration=1, total_loss_dict=totals, num_layers=1)
        return totals["load_balancing_loss"].item()

    assert logged() == 0.75 and calls == []
    with patched(load_declarations(ids=["moe_aux_loss"])):
        assert logged() == 0.75
    # the tracker may hold other names (zeroed, not removed) from earlier tests: each is reduced too. One
    # rank-ordered sum per reduction step of this name: the PP sum; the 0.18+ tracker class also the DP mean
    tracker_class = importlib.util.find_spec("megatron.core.transformer.moe.moe_logging") is not None
    assert [c.sum().item() for c in calls].count(0.75) == (2 if tracker_class else 1), calls


def test_spec_providers_hand_out_the_grouped_experts():
    from megatron.core.extensions import transformer_engine_spec_provider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_bitdet.enforce.audit import walk_spec

    def experts():  # a ModuleSpec before 0.17, a partial builder after: the walk reads both
        return dict(walk_spec(get_moe_module_spec(use_te=False, num_experts=4)))["experts"]

    assert experts() is SequentialMLP
    with patched(load_declarations(ids=["grouped_gemm_dprob"])):
        assert experts() is GroupedProbMLP
        assert transformer_engine_spec_provider.SequentialMLP is GroupedProbMLP
    assert experts() is SequentialMLP


def _write(tmp_path, name, data):
    path = tmp_path / f"{name}.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def _decl_dict(**overrides):
    data = {
        "id": "moe_aux_loss",
        "rule": "moe_aux_loss",
        "megatron_core": f"=={megatron_core_version()}",
        "why": "test",
        "swaps": [
            {
                "replacement": "megatron_bitdet.kernels.moe_aux:switch_load_balancing_loss_func",
                "targets": ["megatron.core.transformer.moe.router:switch_load_balancing_loss_func"],
            }
        ],
    }
    data.update(overrides)
    return data


def test_out_of_range_megatron_core_is_refused_and_nothing_is_applied(tmp_path):
    target = "megatron.core.transformer.moe.router:switch_load_balancing_loss_func"
    before = _current(target)
    good = load_declaration(_write(tmp_path, "moe_aux_loss", _decl_dict()))
    future = load_declaration(_write(tmp_path, "future", _decl_dict(id="future", megatron_core=">=99")))
    with pytest.raises(BitdetError, match=rf"supports megatron-core >=99, installed is {megatron_core_version()}; refusing"):
        apply_patches([good, future])
    assert _current(target) is before and applied_patches() == []


def test_stale_target_and_double_apply_are_refused(tmp_path):
    stale = _decl_dict(swaps=[{"replacement": "megatron_bitdet.kernels.moe_aux:rank_ordered_sum",
                               "targets": ["megatron.core.transformer.moe.router:no_such_function"]}])
    with pytest.raises(BitdetError, match="no_such_function.*does not exist"):
        apply_patches([load_declaration(_write(tmp_path, "moe_aux_loss", stale))])
    with patched(load_declarations(ids=["causal_conv1d"])):
        with pytest.raises(BitdetError, match="already applied"):
            apply_patches(load_declarations(ids=["causal_conv1d"]))


@pytest.mark.parametrize(
    "content,message",
    [
        ("id: [unclosed", "cannot read patch declaration"),
        ("- just a list", "must be a YAML mapping"),
        (_decl_dict(extra=1), r"unknown key\(s\) \['extra'\]"),
        (_decl_dict(megatron_core="version 0.16"), "is not a version specifier"),
        (_decl_dict(id="other"), "must equal the file name"),
        (_decl_dict(swaps=[]), "swaps must be a non-empty list"),
        (_decl_dict(swaps=[{"replacement": "no_colon", "targets": ["megatron.core.x:y"]}]), "dotted.module:attribute"),
        (_decl_dict(swaps=[{"replacement": "a.b:c", "targets": ["torch.nn:Linear"]}]), "not a megatron.core symbol"),
    ],
)
def test_bad_declarations_name_the_file(tmp_path, content, message):
    path = _write(tmp_path, "moe_aux_loss", content)
    with pytest.raises(BitdetInputError, match=message) as err:
        load_declaration(path)
    assert str(path) in str(err.value)


def test_unknown_patch_id_is_an_input_error():
    with pytest.raises(BitdetInputError, match="unknown patch id"):
        load_declarations(ids=["nope"])
