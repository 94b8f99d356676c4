"""--deterministic-mode enforcement: rules table, env validation, late application, manifest, seams, CLI."""
import argparse
import dataclasses
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_bitdet.enforce import (ENV_TABLE, RULES, Facts, add_args, apply_to_megatron_args, build_manifest,
                                     enable, evaluate_rules, load_manifest, megatron_overrides, plan, resolve_env,
                                     scope_diff, write_manifest)
from megatron_bitdet.enforce.env import effective_env
from megatron_bitdet.enforce.late import late_application
from megatron_bitdet.errors import BitdetInputError, DeterminismViolation
from megatron_bitdet.recipe import Recipe, RecipeError, load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes", "nemotron_h_tiny.yaml")
DATA = os.path.join(ROOT, "tests", "data", "recipes")


@pytest.fixture
def clean_env(monkeypatch):
    """No determinism variable set by the launcher; monkeypatch restores whatever enable() writes."""
    for var in ENV_TABLE:
        monkeypatch.delenv(var.name, raising=False)
    return monkeypatch


@pytest.fixture
def torch_state():
    """enable() flips process-global torch flags: put them back."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.utils.deterministic.fill_uninitialized_memory,
             torch.get_num_threads())
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
    torch.utils.deterministic.fill_uninitialized_memory = saved[3]
    torch.set_num_threads(saved[4])


def canonical_facts(recipe, **changes):
    """Facts of a clean launcher: the env enforcement would produce, with ``env`` entries overlaid."""
    env = effective_env(resolve_env(recipe, {})[0])
    env.update(changes.pop("env", {}))
    return Facts(env=env, **changes)


# rule id -> (recipe overrides, facts changes) of a configuration that needs the rule
TRIGGERS = {
    "cross_entropy_loss_fusion": (["model.cross_entropy_loss_fusion=true"], {}),
    "tp_comm_overlap": (["parallel.tp_comm_overlap=true"], {}),
    "nccl_tree": ([], {"env": {"NCCL_ALGO": "Ring,Tree"}}),
    "moe_router_fusion": (["model.moe.router_fusion=true"], {}),
    "moe_permute_fusion": (["model.moe.permute_fusion=true"], {}),
    "te_grouped_gemm": (["model.moe.expert_impl=te_grouped"], {}),
    "torch_compile_max_autotune": ([], {"env": {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}}),
    "causal_conv1d_old": ([], {"versions": {"causal-conv1d": "1.5.0.post8"}}),
    "mamba_ssm_nondeterministic": ([], {"versions": {"mamba-ssm": "2.2.2"},
                                        "deterministic_support": {"mamba-ssm": False}}),
    "flash_attention": (["model.attention_backend=flash"], {}),
    "te_attention_nondeterministic": (["model.spec=te"], {"env": {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}}),
}


def test_every_rule_has_a_trigger():
    assert set(TRIGGERS) == {r.id for r in RULES}


@pytest.mark.parametrize("rule_id", sorted(TRIGGERS))
def test_rule_fires_when_needed(rule_id):
    overrides, changes = TRIGGERS[rule_id]
    recipe = load_recipe(TINY, overrides)
    out = evaluate_rules(recipe, canonical_facts(recipe, **changes))
    assert [v.rule_id for v in out.violations] == [rule_id]
    (v,) = out.violations
    assert v.why and v.fix and v.message
    assert rule_id not in out.applied


def test_rules_silent_on_the_tiny_recipe_with_good_gpu_stack():
    recipe = load_recipe(TINY, ["model.spec=te"])
    facts = canonical_facts(recipe, versions={"triton": "3.4.0", "causal-conv1d": "1.6.0", "mamba-ssm": "2.2.6",
                                              "transformer-engine": "2.8.0"},
                            deterministic_support={"mamba-ssm": True, "causal-conv1d": True})
    out = evaluate_rules(recipe, facts)
    assert out.violations == [] and out.applied == [r.id for r in RULES]


@pytest.mark.parametrize("overrides, changes", [
    (["model.hybrid_pattern=M*M-", "parallel.expert=1", "model.moe.router_fusion=true",
      "model.moe.permute_fusion=true", "model.moe.expert_impl=te_grouped"], {}),  # no MoE layers
    (["model.hybrid_pattern='*-*E'"], {"versions": {"causal-conv1d": "1.4.0", "mamba-ssm": "2.0.0"},
                                    "deterministic_support": {"mamba-ssm": False}}),  # no Mamba layers
    (["model.spec=local"], {"env": {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"},
                            "versions": {"transformer-engine": "2.8.0"}}),  # TE attention not used
    (["model.hybrid_pattern=M-ME", "model.attention_backend=flash"], {}),  # no attention layers
])
def test_rules_silent_where_the_feature_is_unused(overrides, changes):
    recipe = load_recipe(TINY, overrides)
    assert evaluate_rules(recipe, canonical_facts(recipe, **changes)).violations == []


@pytest.mark.parametrize("value, still", [
    ("^NVLS", "Ring, Tree, CollnetDirect, CollnetChain, NVLSTree, PAT"),  # Megatron-LM accepts this one
    ("^NVLS,Tree,PAT", "Ring, CollnetDirect, CollnetChain, NVLSTree"),
])
def test_nccl_exclusion_list_is_refused_naming_what_it_still_allows(value, still):
    """In NCCL a leading ^ excludes the listed algorithms: every other one may still be picked."""
    recipe = load_recipe(TINY)
    out = evaluate_rules(recipe, canonical_facts(recipe, env={"NCCL_ALGO": value}))
    (v,) = out.violations
    assert v.rule_id == "nccl_tree" and f"still allows {still}" in v.message, v.message


@pytest.mark.parametrize("value", ["Ring", "ring", "Ring,CollnetDirect", "CollnetChain"])
def test_nccl_allow_list_of_deterministic_algorithms_passes(value):
    recipe = load_recipe(TINY)
    assert evaluate_rules(recipe, canonical_facts(recipe, env={"NCCL_ALGO": value})).violations == []


def test_all_violations_reported_together():
    recipe = load_recipe(TINY, ["model.moe.router_fusion=true", "parallel.tp_comm_overlap=true"])
    out = evaluate_rules(recipe, canonical_facts(recipe, env={"NCCL_ALGO": "Tree"}))
    exc = DeterminismViolation(out.violations)
    assert [v.rule_id for v in exc.violations] == ["tp_comm_overlap", "nccl_tree", "moe_router_fusion"]
    assert "variant 'moe_aux_loss'" in str(exc)


def test_opt_out_records_and_unknown_opt_out_names_line():
    recipe = load_recipe(os.path.join(DATA, "router_fusion_opt_out.yaml"))
    out = evaluate_rules(recipe, canonical_facts(recipe))
    assert out.violations == [] and [o["id"] for o in out.opt_outs] == ["moe_router_fusion"]
    bad = os.path.join(DATA, "unknown_opt_out.yaml")
    with pytest.raises(RecipeError) as info:
        evaluate_rules(load_recipe(bad), Facts())
    (line,) = info.value.lines
    assert line.startswith(f"{bad}:6: determinism.opt_out[1]: unknown rule id 'moe_router_fuson'")


def test_swap_seam_resolves_rule_when_registered_and_enabled():
    recipe = load_recipe(os.path.join(DATA, "router_fusion.yaml"), ["determinism.swaps=true"])
    facts = canonical_facts(recipe)
    out = evaluate_rules(recipe, facts, available_swaps=frozenset({"moe_aux_loss"}))
    assert out.violations == [] and out.as_manifest()["swaps"][0]["swap"] == "moe_aux_loss"
    off = load_recipe(os.path.join(DATA, "router_fusion.yaml"), ["determinism.swaps=false"])
    assert [v.rule_id for v in evaluate_rules(off, facts, frozenset({"moe_aux_loss"})).violations] == ["moe_router_fusion"]


def test_env_unset_is_filled_valid_is_kept_invalid_refused(clean_env):
    recipe = load_recipe(TINY)
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    clean_env.setenv("MAMBA_DETERMINISTIC", "0")
    settings, problems = resolve_env(recipe, os.environ)
    assert (settings["NCCL_ALGO"].value, settings["NCCL_ALGO"].source) == ("Ring", "default")
    assert (settings["CUBLAS_WORKSPACE_CONFIG"].value, settings["CUBLAS_WORKSPACE_CONFIG"].source) == (":16:8", "launcher")
    assert settings["OMP_NUM_THREADS"].source == "unset"
    (name, message, fix), = problems
    assert name == "MAMBA_DETERMINISTIC" and "accepted: a value starting with 1" in message and "'1'" in fix


def test_env_from_recipe_is_validated_and_must_agree_with_launcher(clean_env, tmp_path):
    path = tmp_path / "env.yaml"
    path.write_text(f"extends: {TINY}\nname: env\ndeterminism:\n  env:\n    CUBLAS_WORKSPACE_CONFIG: ':1:1'\n"
                    "    NVTE_ALLOW_NONDETERMINISTIC_ALGO: 0\n")
    recipe = load_recipe(str(path))
    clean_env.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    settings, problems = resolve_env(recipe, os.environ)
    assert settings["CUBLAS_WORKSPACE_CONFIG"].source == "recipe"
    messages = [m for _, m, _ in problems]
    assert "the launcher sets NVTE_ALLOW_NONDETERMINISTIC_ALGO='1' but " + f"{path}:6 sets '0'" in messages[0]
    assert f"CUBLAS_WORKSPACE_CONFIG=':1:1' (from {path}:5) is refused; accepted: :4096:8 or :16:8" in messages[1]
    unknown = load_recipe(TINY, ["determinism.env={CUBLAS_WORKSPACE: ':4096:8'}"])
    with pytest.raises(BitdetInputError, match="determinism.env.CUBLAS_WORKSPACE: not a determinism variable"):
        resolve_env(unknown, {})


def test_enable_applies_env_and_torch_flags(clean_env, torch_state):
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    for name in ("TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM"):
        clean_env.setenv(name, "0")  # inductor may already be imported by an earlier test
    enforcement = enable(load_recipe(TINY, ["determinism.threads=1"]))
    assert os.environ["NCCL_ALGO"] == "Ring" and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert torch.utils.deterministic.fill_uninitialized_memory is False
    assert torch.get_num_threads() == 1 == enforcement.threads


def test_enable_refuses_invalid_launcher_value_without_touching_state(clean_env, torch_state):
    torch.use_deterministic_algorithms(False)
    clean_env.setenv("NCCL_ALGO", "Tree")
    clean_env.setenv("CUBLAS_WORKSPACE_CONFIG", "bogus")
    with pytest.raises(DeterminismViolation) as info:
        enable(load_recipe(TINY))
    assert {v.rule_id for v in info.value.violations} >= {"nccl_tree", "env:CUBLAS_WORKSPACE_CONFIG"}
    assert os.environ["NCCL_ALGO"] == "Tree" and "MAMBA_DETERMINISTIC" not in os.environ
    assert not torch.are_deterministic_algorithms_enabled()


def test_late_gloo_process_group_is_reported_as_harmless(clean_env, tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        _, _, violations, warnings = plan(load_recipe(TINY))
    finally:
        dist.destroy_process_group()
    assert not [v for v in violations if "process group" in v.message]
    assert any("a gloo process group already exists" in w for w in warnings)


def test_late_inductor_import_refused_unless_launcher_set_it(clean_env):
    import torch._inductor.config  # noqa: F401  (really imported: it read TORCHINDUCTOR_* already)

    recipe = load_recipe(TINY)
    late = [v for v in plan(recipe)[2] if v.rule_id == "late_application"]
    assert len(late) == 1 and "TORCHINDUCTOR_MAX_AUTOTUNE" in late[0].message and "torch.compile" in late[0].fix
    clean_env.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "0")
    clean_env.setenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", "0")
    assert not [v for v in plan(recipe)[2] if v.rule_id == "late_application"]


def test_late_nccl_and_cuda_refused_only_for_changed_variables():
    recipe = load_recipe(TINY)
    settings = resolve_env(recipe, {})[0]
    refusals, _ = late_application(settings, {}, Facts(dist_backend="nccl", cuda_initialized=True))
    assert sorted(n for names, _, _ in refusals for n in names) == ["CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO"]
    launcher = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    settings = resolve_env(recipe, launcher)[0]
    assert late_application(settings, launcher, Facts(dist_backend="nccl", cuda_initialized=True))[0] == []


def test_manifest_records_opt_out_and_round_trips(clean_env, torch_state, tmp_path):
    for name in ("TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM"):
        clean_env.setenv(name, "0")  # an earlier enable() in this process already imported inductor
    recipe = load_recipe(os.path.join(DATA, "router_fusion_opt_out.yaml"))
    enforcement = enable(recipe)
    manifest = build_manifest(recipe, enforcement, world_size=2, argv=["x"], extra={"patches": ["p1"]})
    assert manifest["rules"]["opt_outs"][0]["id"] == "moe_router_fusion"
    assert any("opt-out [moe_router_fusion]" in w for w in manifest["warnings"])
    scope = manifest["scope"]
    assert (scope["world_size"], scope["dp"], scope["ep"], scope["torch_threads"]) == (2, 2, 2, 2)
    assert scope["env/NCCL_ALGO"] == "Ring" and scope["recipe_digest"] == recipe.digest()
    path = write_manifest(tmp_path / "run", manifest)
    loaded = load_manifest(tmp_path / "run")
    assert loaded == json.loads(json.dumps(manifest)) and os.listdir(tmp_path / "run") == ["manifest.json"]
    assert Recipe.from_dict(loaded["recipe"], source=path) == recipe
    other = dict(scope, torch_threads=1, seed=None)
    assert scope_diff(scope, other) == [("seed", 1234, None), ("torch_threads", 2, 1)]


@pytest.mark.parametrize("content, message", [(None, "no manifest"), ("{not json", "malformed manifest"),
                                              ('{"recipe": {}}', "missing bitdet_version")])
def test_load_manifest_rejects_unusable_files(tmp_path, content, message):
    path = tmp_path / "manifest.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BitdetInputError, match=message):
        load_manifest(path)


def test_megatron_seams():
    from megatron.core.transformer.transformer_config import TransformerConfig

    overrides = megatron_overrides(load_recipe(TINY))
    assert overrides["deterministic_mode"] is True
    assert set(overrides) <= {f.name for f in dataclasses.fields(TransformerConfig)}
    megatron_like = argparse.ArgumentParser()
    megatron_like.add_argument("--deterministic-mode", action="store_true")  # Megatron-LM's own flag
    for parser in (megatron_like, argparse.ArgumentParser()):
        assert add_args(parser) is parser
        args = parser.parse_args(["--deterministic-mode", "--recipe", "r.yaml", "--bitdet-override", "a=1"])
        assert (args.deterministic_mode, args.recipe, args.bitdet_override) == (True, "r.yaml", ["a=1"])
    assert apply_to_megatron_args(argparse.Namespace(deterministic_mode=False)).deterministic_mode is True
    with pytest.raises(DeterminismViolation, match=r"\[cross_entropy_loss_fusion\] --cross-entropy-loss-fusion is set"):
        apply_to_megatron_args(argparse.Namespace(moe_router_fusion=True, cross_entropy_loss_fusion=True))
    opted = load_recipe(os.path.join(DATA, "router_fusion_opt_out.yaml"))
    assert apply_to_megatron_args(argparse.Namespace(moe_router_fusion=True), opted).moe_router_fusion is True


def _bitdet(*args, env=None):
    clean = {k: v for k, v in os.environ.items() if k not in {v.name for v in ENV_TABLE}}
    return subprocess.run([sys.executable, "-m", "megatron_bitdet", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=180, env={**clean, **(env or {})})


def test_cli_refuses_router_fusion_then_accepts_opt_out_with_warning(tmp_path):
    refused = _bitdet("recipe", "validate", os.path.join(DATA, "router_fusion.yaml"))
    assert refused.returncode == 2
    assert "[moe_router_fusion]" in refused.stderr and "atomicAdd" in refused.stderr
    assert "fix: set model.moe.router_fusion: false" in refused.stderr and "Traceback" not in refused.stderr
    run_dir = tmp_path / "run"
    ok = _bitdet("enforce", "--recipe", os.path.join(DATA, "router_fusion_opt_out.yaml"), "--run-dir", str(run_dir),
                 env={"PYTHONHASHSEED": "0"})
    assert ok.returncode == 0, ok.stderr
    assert "opt-out [moe_router_fusion]" in ok.stderr and "NCCL_ALGO" in ok.stderr
    manifest = load_manifest(run_dir)
    assert manifest == json.loads(ok.stdout)
    assert manifest["rules"]["opt_outs"][0]["id"] == "moe_router_fusion"
    assert manifest["env"]["PYTHONHASHSEED"] == {"value": "0", "source": "launcher"}


def test_pythonhashseed_set_after_start_is_recorded_as_not_in_effect():
    """An interpreter started without PYTHONHASHSEED keeps hashing str randomly whatever enable() writes
    into os.environ: the manifest says so and the warning gives the launcher line that fixes it."""
    run = _bitdet("enforce", "--recipe", TINY)
    assert run.returncode == 0, run.stderr
    manifest = json.loads(run.stdout)
    assert manifest["env"]["PYTHONHASHSEED"] == {"value": "0", "source": "default", "in_effect": False}
    assert any("PYTHONHASHSEED=0 torchrun" in w for w in manifest["warnings"])


@pytest.mark.parametrize("overrides, launcher, expected", [
    (["parallel.tensor=2"], {}, ("1", "default")),
    (["parallel.context=2"], {}, ("1", "default")),
    (["parallel.tensor=2"], {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, ("8", "launcher")),  # never overwritten
    ([], {}, (None, "unset")),
])
def test_cuda_device_max_connections_is_one_where_megatron_needs_it(overrides, launcher, expected):
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or context parallelism (pre-Blackwell)."""
    setting = resolve_env(load_recipe(TINY, overrides), launcher)[0]["CUDA_DEVICE_MAX_CONNECTIONS"]
    assert (setting.value, setting.source) == expected


def test_late_cuda_context_refuses_a_changed_cuda_device_max_connections():
    recipe = load_recipe(TINY, ["parallel.tensor=2"])
    refusals, _ = late_application(resolve_env(recipe, {})[0], {}, Facts(cuda_initialized=True))
    assert ["CUDA_DEVICE_MAX_CONNECTIONS"] in [names for names, _, _ in refusals]


def test_cli_swaps_router_fusion_when_swaps_are_on():
    swapped = _bitdet("recipe", "validate", os.path.join(DATA, "router_fusion.yaml"), "determinism.swaps=true")
    assert swapped.returncode == 0, swapped.stderr
    assert "1 swapped" in swapped.stdout and "moe_aux_loss" in swapped.stdout


def _bound(symbol):
    """What ``module:attr`` or ``module:Class.attr`` holds itself (a class's own attribute, not inherited)."""
    from megatron_bitdet.compat.patching import split_symbol

    module, attr = split_symbol(symbol)
    owner = importlib.import_module(module)
    for part in attr.split("."):
        owner = vars(owner)[part]
    return owner


def test_enable_installs_the_swaps_it_records(clean_env, torch_state):
    """What enable() reports as swapped is installed (a Megatron-LM script gets it without bitdet train):
    megatron's own call sites reach the deterministic variant, and the manifest lists the patch."""
    from megatron.core.transformer.moe import router

    from megatron_bitdet.compat.patching import (
        applied_patches,
        load_declarations,
        megatron_core_version,
        revert_patches,
    )
    from megatron_bitdet.kernels import moe_aux

    for name in ("TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_MAX_AUTOTUNE_GEMM"):
        clean_env.setenv(name, "0")  # inductor may already be imported by an earlier test
    before = {p["id"] for p in applied_patches()}
    recipe = load_recipe(TINY, ["model.moe.router_fusion=true", "determinism.threads=1"])
    try:
        enforcement = enable(recipe)
        assert [s["swap"] for s in enforcement.rules.swaps] == ["moe_aux_loss"]
        assert router.switch_load_balancing_loss_func is moe_aux.switch_load_balancing_loss_func
        # the loss and the tracker's reduction (moe_utils' function before 0.18, the tracker class's
        # _sync_metrics from 0.18: the swaps the declaration applies to the installed version)
        [declaration] = load_declarations(ids=["moe_aux_loss"])
        swaps = [s for s in declaration.swaps if s.applies(megatron_core_version())]
        assert len(swaps) == 2
        assert all(_bound(t) is _bound(s.replacement) for s in swaps for t in s.targets)
        assert [p["id"] for p in enforcement.patches] == ["moe_aux_loss"]
        assert [p["id"] for p in build_manifest(recipe, enforcement, world_size=1)["patches"]] == ["moe_aux_loss"]
    finally:
        revert_patches([p["id"] for p in applied_patches() if p["id"] not in before])
