"""Megatron-LM's own hybrid entry point (``HYBRID``: pretrain_mamba.py of core_v0.16.1, pretrain_hybrid.py of
core_v0.19.0) and pretrain_gpt.py, unmodified, under the bitdet entry point on 2 real gloo ranks: byte-identical
twins, another seed diverging at step 1, the launch-line lint, resume, and
tracing + localize (the ladder included) naming a planted op reached from the launch line (``--spec``).

Needs a Megatron-LM checkout (``MEGATRON_LM_PATH``; ``.ci/run`` points it at ../shared/megatron-lm and
fails if it is missing).
Every launch is made once per session and read by every test that needs it.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from megatron_bitdet.cli import main as bitdet
from test_audit import te_mamba_specs  # noqa: F401 - the TE stand-in spec module, a fixture

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
pytestmark = [
    pytest.mark.megatron_lm,  # conftest: skipped naming why without a checkout; a failure under .ci/run
    pytest.mark.timeout(1800),  # a session fixture makes three 2-rank launches in one test's setup
]

REPO = Path(__file__).resolve().parents[1]


def readme_block() -> list[str]:
    """The README's "Megatron-LM users" commands: the tests run exactly these flags."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Megatron-LM users"):]
    block = section[section.index("```bash\n") + 8:]
    return block[:block.index("```")].splitlines()


README = readme_block()
MAMBA = shlex.split(next(line for line in README if line.startswith("ARGS="))[len("ARGS="):])[0].split()
FUSIONS = shlex.split(next(line for line in README if "--check" in line).split("$ARGS")[1])
COMMON = MAMBA[MAMBA.index("--hidden-size"):]
GPT = ["--num-layers", "2", "--swiglu", "--no-bias-swiglu-fusion", "--position-embedding-type", "rope",
       "--no-rope-fusion", *COMMON]
# --tp-comm-overlap and --moe-grouped-gemm are TE-only: judged here, where TE is absent, never imported
OPTED = {"cross_entropy_loss_fusion", "moe_permute_fusion", "moe_router_fusion", "tp_comm_overlap", "te_grouped_gemm"}


# The checkout's hybrid Mamba/attention/MoE entry point: pretrain_hybrid.py from Megatron-LM 0.18 (megatron-core
# 0.18 renamed MambaModel HybridModel; core_v0.19.0's pretrain_mamba.py is a deprecated wrapper running it, which
# the --check below and the other Megatron-LM test files launch), pretrain_mamba.py before (core_v0.16.1).
HYBRID = "pretrain_hybrid.py" if MEGATRON_LM and os.path.isfile(os.path.join(MEGATRON_LM, "pretrain_hybrid.py")) \
    else "pretrain_mamba.py"


def script(name: str) -> str:
    return os.path.join(MEGATRON_LM, name)


def launch(run_dir: Path, name: str, args: list, *extra: str) -> int:
    return bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(run_dir), script(name), *args, *extra])


def lines(run_dir: Path, rank: int) -> list[dict]:
    path = run_dir / "fingerprints" / f"rank_{rank:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def mamba_runs(tmp_path_factory):
    """The hybrid entry point (M*-E, EP2 alltoall, distributed optimizer, dropout 0.1): twins and seed 4321."""
    root = tmp_path_factory.mktemp("megatron_lm_mamba")
    runs = {k: root / k for k in ("a", "b", "seed")}
    # run a also snapshots its live state as step 3 begins: the verify-resume reference (and a
    # snapshot must not perturb a single bit: a and b are compared byte for byte)
    rcs = {k: launch(d, HYBRID, MAMBA, *{"a": ["--snapshot-at", "2"], "b": [], "seed": ["--seed", "4321"]}[k])
           for k, d in runs.items()}
    return runs, rcs


@pytest.fixture(scope="session")
def gpt_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lm_gpt")
    runs = {k: root / k for k in ("a", "b")}
    return runs, {k: launch(d, "pretrain_gpt.py", GPT) for k, d in runs.items()}


def test_mamba_twins_byte_identical_and_compare_match(mamba_runs, capsys):
    runs, rcs = mamba_runs
    assert rcs == {"a": 0, "b": 0, "seed": 0}
    for rank in (0, 1):
        a = (runs["a"] / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert a == (runs["b"] / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert [s["step"] for s in lines(runs["a"], rank)] == [1, 2, 3]
    assert bitdet(["compare", str(runs["a"]), str(runs["b"])]) == 0
    assert "MATCH" in capsys.readouterr().out


def test_mamba_other_seed_diverges_at_step_1(mamba_runs, capsys):
    runs, _ = mamba_runs
    capsys.readouterr()
    # the seed is part of the validation scope: comparing across it needs --force
    assert bitdet(["compare", str(runs["a"]), str(runs["seed"])]) == 2
    capsys.readouterr()
    assert bitdet(["compare", "--force", "--json", str(runs["a"]), str(runs["seed"])]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first_divergence"]["step"] == 1 and report["first_divergence"]["ranks"] == [0, 1]


def test_mamba_fingerprints_and_manifest_describe_what_megatron_built(mamba_runs):
    runs, _ = mamba_runs
    for rank in (0, 1):
        step = lines(runs["a"], rank)[0]
        assert {"loss", "lm_loss", "aux_loss", "grad_norm", "lr"} <= set(step["metrics"])
        # the only MoE layer is the 4th: its load-balancing loss, per layer, on every rank
        assert "aux_loss/load_balancing_loss/layer_04" in step["metrics"]
        # the digests bitdet train's lines carry: the module buffers too (fp32 here: no precision digests)
        assert set(step["digests"]) == {"params", "grads", "buffers"}
    manifest = json.loads((runs["a"] / "manifest.json").read_text())
    model, parallel = manifest["recipe"]["model"], manifest["recipe"]["parallel"]
    assert model["hybrid_pattern"] == "M*-E" and model["hidden_dropout"] == 0.1 and model["spec"] == "local"
    assert parallel["expert"] == 2 and parallel["distributed_optimizer"] is True
    assert manifest["scope"]["deterministic_mode"] is True and manifest["scope"]["world_size"] == 2
    patches = {p["id"] for p in manifest["patches"]}
    assert {"ssd_scan", "gated_rmsnorm", "causal_conv1d", "moe_aux_loss", "local_final_norm"} <= patches
    # eager_jit_fuser: megatron's torch.compile'd fused functions run eagerly (no Inductor C++ build per rank)
    assert {"allow_no_cuda", "model_parallel_groups", "batch_invariant_kernels", "eager_jit_fuser"} <= set(
        manifest["cpu_backend_seams"])
    assert manifest["env"]["NCCL_ALGO"]["value"] == "Ring"
    # after the build, what runs per rule: the mixers took the split path (megatron's default memory-
    # efficient path would call one fused conv+scan function), so the conv is the swapped one
    built = manifest["rules"]["built"]
    assert [f["runs"] for f in built["causal_conv1d_old"]] == ["megatron_bitdet.kernels.causal_conv1d:causal_conv1d_fn"]
    assert built["causal_conv1d_old"][0]["position"].endswith("decoder.layers.0.mixer.conv")
    assert [f["runs"] for f in built["te_grouped_gemm"]] == ["megatron.core.transformer.moe.experts:SequentialMLP"]
    assert [f["runs"] for f in built["moe_router_fusion"]] == ["megatron_bitdet.kernels.moe_aux:switch_load_balancing_loss_func"]
    assert (runs["a"] / "logs" / "rank_00001.log").is_file()


def test_gpt_twins_byte_identical(gpt_runs, capsys):
    runs, rcs = gpt_runs
    assert rcs == {"a": 0, "b": 0}
    for rank in (0, 1):
        a = (runs["a"] / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert a and a == (runs["b"] / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
    assert bitdet(["compare", str(runs["a"]), str(runs["b"])]) == 0
    manifest = json.loads((runs["a"] / "manifest.json").read_text())
    assert manifest["recipe"]["model"]["hybrid_pattern"] == "*E*E"  # a GPT layer: attention, then MoE


def test_check_lists_every_violation_at_once(capsys):
    rc = bitdet(["megatron-lm", "--check", script(HYBRID), *MAMBA, *FUSIONS])
    out = capsys.readouterr().out
    assert rc == 2
    for rule in OPTED:
        assert f"[{rule}]" in out
    # refused together; the router fusion has a deterministic variant, listed as swapped. The local spec
    # holds SequentialMLP whatever --moe-grouped-gemm says: the audit names what runs, and nothing fires
    assert "3 feature(s) have no deterministic path" in out
    assert "swapped [moe_router_fusion]" in out and "swapped [te_grouped_gemm]" not in out
    assert "runs [te_grouped_gemm] moe_layer.mlp.experts: megatron.core.transformer.moe.experts:SequentialMLP" in out


def line_recipe(path: Path, determinism: str) -> Path:
    """A recipe agreeing with the README's launch line, with the given determinism section."""
    path.write_text(
        "name: line\nmodel: {hybrid_pattern: 'M*-E', hidden_size: 64, ffn_hidden_size: 128,\n"
        "  num_attention_heads: 4, seq_length: 64, vocab_size: 256, moe: {num_experts: 4, ffn_hidden_size: 64}}\n"
        f"determinism: {determinism}\n")
    return path


def opt_out_recipe(path: Path, rules) -> Path:
    return line_recipe(path, f"{{opt_out: [{', '.join(sorted(rules))}]}}")


def test_check_refuses_an_opt_out_megatron_itself_asserts_then_passes_and_records_the_rest(tmp_path, capsys):
    """Megatron-LM's validate_args asserts --cross-entropy-loss-fusion off in deterministic mode: the
    launch line dies there whatever the recipe accepts, so --check cannot pass it."""
    recipe = opt_out_recipe(tmp_path / "opt_out.yaml", OPTED)
    rc = bitdet(["megatron-lm", "--check", script(HYBRID), *MAMBA, *FUSIONS, "--recipe", str(recipe)])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert "1 feature(s) have no deterministic path" in out
    assert "[cross_entropy_loss_fusion] model.cross_entropy_loss_fusion is true, opted out at" in out
    assert "Megatron-LM's validate_args asserts it off in deterministic mode" in out
    others = OPTED - {"cross_entropy_loss_fusion"}
    fusions = [f for f in FUSIONS if f != "--cross-entropy-loss-fusion"]
    rc = bitdet(["megatron-lm", "--check", "--run-dir", str(tmp_path / "run"), script(HYBRID),
                 *MAMBA, *fusions, "--recipe", str(opt_out_recipe(tmp_path / "others.yaml", others))])
    out = capsys.readouterr().out
    # the rules pass; the opted-out TE fusions cannot run on this machine (their own section, exit 3)
    assert rc == 3, out
    assert "  --moe-permute-fusion: needs Transformer Engine" in out
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    # te_grouped_gemm does not fire (the local spec holds SequentialMLP), so its opt-out records nothing
    assert {o["id"] for o in manifest["rules"]["opt_outs"]} == others - {"te_grouped_gemm"}
    assert all(f"opted out [{rule}]" in out for rule in others - {"te_grouped_gemm"})
    assert manifest["megatron_lm"]["check"] is True


TE_SPEC = ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]


def te_spec_line() -> list:
    """The README's launch line on megatron-core's own TE Mamba spec (no --moe-grouped-gemm)."""
    i = MAMBA.index("--spec")
    return [*MAMBA[:i], *TE_SPEC, *MAMBA[i + 3:]]


@pytest.mark.parametrize("stand_in", [False, True], ids=["cpu", "te_stand_in"])
def test_check_names_the_grouped_experts_class_of_megatrons_te_mamba_spec(stand_in, tmp_path, capsys, request,
                                                                        monkeypatch):
    """The spec builds its experts at import whatever the flags say: TEGroupedMLP with TE (test_audit's TE
    grouped-linear stand-in, the spec module executed afresh with it), and here (TE absent) the legacy GroupedMLP
    before megatron-core 0.17; --check names that class as swapped, the manifest records GroupedProbMLP running
    there; without swaps it is refused by name. From 0.17 (no GroupedMLP, ``partial`` builders) the spec here
    holds SequentialMLP on local linears: deterministic, clear, and recorded as what runs."""
    from megatron_bitdet.compat.builders import partial_builders

    if stand_in:
        monkeypatch.setitem(sys.modules, TE_SPEC[1], request.getfixturevalue("te_mamba_specs"))
    rc = bitdet(["megatron-lm", "--check", "--run-dir", str(tmp_path / "run"), script(HYBRID),
                 *te_spec_line()])
    out = capsys.readouterr().out
    assert rc == 3, out  # the rules pass; the TE spec cannot run on this machine (exit 3, its own section)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    if not stand_in and partial_builders():
        sequential = "megatron.core.transformer.moe.experts:SequentialMLP"
        assert f"runs [te_grouped_gemm] moe_layer.mlp.experts: {sequential}\n" in out and " 0 swapped" in out, out
        assert manifest["rules"]["runs"]["te_grouped_gemm"] == [
            {"position": "moe_layer.mlp.experts", "runs": sequential, "source": None}]
        assert manifest["recipe"]["model"]["moe"]["expert_impl"] == "sequential"
        return
    expected = "TEGroupedMLP" if stand_in else "GroupedMLP"
    assert (f"swapped [te_grouped_gemm] moe_layer.mlp.experts is megatron.core.transformer.moe.experts:{expected}"
            " -> deterministic variant 'grouped_gemm_dprob'") in out
    [runs] = manifest["rules"]["runs"]["te_grouped_gemm"]
    assert runs == {"position": "moe_layer.mlp.experts", "runs": "megatron_bitdet.kernels.grouped_mlp:GroupedProbMLP",
                    "source": None}
    assert manifest["recipe"]["model"]["moe"]["expert_impl"] == "te_grouped"
    assert manifest["recipe"]["model"]["spec"] == "te" and manifest["megatron_lm"]["spec_family"] == "te"
    recipe = line_recipe(tmp_path / "no_swaps.yaml", "{swaps: false}")
    rc = bitdet(["megatron-lm", "--check", script(HYBRID), *te_spec_line(), "--recipe", str(recipe)])
    out = capsys.readouterr().out
    assert rc == 2
    assert f"[te_grouped_gemm] moe_layer.mlp.experts is megatron.core.transformer.moe.experts:{expected}" in out


@pytest.mark.parametrize("entry", sorted({HYBRID, "pretrain_mamba.py"}))  # core_v0.19.0: the deprecated wrapper too
def test_check_clean_line_exits_0(entry, capsys):
    assert bitdet(["megatron-lm", "--check", script(entry), *MAMBA]) == 0
    assert "OK " in capsys.readouterr().out


def resumes(ckpt: Path) -> list[str]:
    """The launch line saving into the folder it loads: every launch after the first resumes."""
    return ["--save", str(ckpt), "--save-interval", "2", "--load", str(ckpt)]


def test_a_resume_skipping_restored_state_is_refused_before_any_rank_unless_accepted(tmp_path, capsys):
    """--no-load-optim on a line that resumes: --check exits 2 naming the flag and its fix; the launch exits 2
    before any rank starts; --accept-skipped-restore passes it, recorded in the manifest as an opt-out; without
    --load the flag skips nothing."""
    line = [*MAMBA, *resumes(tmp_path / "ckpt"), "--no-load-optim"]
    assert bitdet(["megatron-lm", "--check", script(HYBRID), *line]) == 2
    out = capsys.readouterr().out
    assert "[resume_skips_restore] the line resumes (--load) with --no-load-optim: the optimizer" in out
    assert "fix: drop --no-load-optim (or accept it on purpose with --accept-skipped-restore)" in out
    assert launch(tmp_path / "run", HYBRID, line) == 2
    assert "[resume_skips_restore]" in capsys.readouterr().err and not (tmp_path / "run" / "logs").exists()
    run = tmp_path / "accepted"
    assert bitdet(["megatron-lm", "--check", "--run-dir", str(run), script(HYBRID), *line,
                   "--accept-skipped-restore"]) == 0
    [opt_out] = json.loads((run / "manifest.json").read_text())["rules"]["opt_outs"]
    assert opt_out["id"] == "resume_skips_restore" and opt_out["where"] == "the launch line (--accept-skipped-restore)"
    assert bitdet(["megatron-lm", "--check", script(HYBRID), *MAMBA, "--no-load-optim"]) == 0


def test_a_typo_exits_2_before_any_rank_naming_the_flag_meant(tmp_path, capsys):
    """The whole line is parsed by the script's own parser in the launcher first: one line naming the unknown
    flag and the one meant, exit 2, no rank started (no log). Timed in CPU seconds of this process (the
    preflight runs here), which the machine's load does not stretch."""
    import time

    start = time.process_time()
    assert launch(tmp_path / "run", HYBRID, [*MAMBA, "--hiden-size", "64"]) == 2
    assert time.process_time() - start < 10
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "bitdet megatron-lm: error: the launch line: unknown flag --hiden-size (did you mean --hidden-size?)"
    assert not (tmp_path / "run").exists()
    assert launch(tmp_path / "run", HYBRID, [*MAMBA, "--hidden-size", "x"]) == 2
    assert "the launch line: argument --hidden-size: invalid int value: 'x'" in capsys.readouterr().err


def test_every_refusal_of_a_line_comes_in_one_report_megatrons_bare_assert_with_its_source_line(tmp_path, capsys):
    """--save without --save-interval (Megatron's bare ``assert args.save_interval is not None``), a flag without
    a deterministic path and a resume skipping its optimizer: one report, each named."""
    line = [*MAMBA, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"), "--no-load-optim",
            "--cross-entropy-loss-fusion"]
    assert bitdet(["megatron-lm", "--check", script(HYBRID), *line]) == 2
    err = capsys.readouterr().err
    assert re.search(r"validate_args refuses this launch line: megatron/training/arguments\.py:\d+: "
                     r"assert args\.save_interval is not None\n", err), err
    assert "[cross_entropy_loss_fusion] --cross-entropy-loss-fusion is set" in err
    assert "[resume_skips_restore] the line resumes (--load) with --no-load-optim" in err


def test_dp_invariant_reductions_are_refused_where_megatron_lms_loop_does_not_install_them(tmp_path, capsys):
    """Fail closed: under the Megatron-LM loop the mode is installed for plain DDP only
    (test_megatron_lm_dp_invariant.py); this line's distributed optimizer and EP 2 are named, each with its fix."""
    recipe = line_recipe(tmp_path / "dp.yaml", "{reductions: dp_invariant, virtual_dp: 1}")
    assert bitdet(["megatron-lm", "--check", script(HYBRID), *MAMBA, "--recipe", str(recipe)]) == 2
    out = capsys.readouterr().out
    assert (f"[reductions_not_installed] determinism.reductions is dp_invariant ({recipe}:4) with "
            "--use-distributed-optimizer; --expert-model-parallel-size 2") in out
    assert "fix: drop --use-distributed-optimizer; use --expert-model-parallel-size 1" in out


def test_recipe_disagreeing_with_a_flag_is_refused_naming_both(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nmodel: {hybrid_pattern: 'M*-E', hidden_size: 128, ffn_hidden_size: 128,\n"
                      "  num_attention_heads: 4, seq_length: 64, vocab_size: 256, moe: {num_experts: 4,\n"
                      "  ffn_hidden_size: 64}}\n")
    rc = bitdet(["megatron-lm", "--check", script(HYBRID), *MAMBA, "--recipe", str(recipe)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{recipe}:2: model.hidden_size" in err and "--hidden-size gives 64" in err


def last_json(captured) -> dict:
    """The report printed last (the ranks' own output streams to the same console before it); when there
    is none, the failure shows the command's stderr (which says why)."""
    out = captured.out
    assert out.startswith("{\n") or "\n{\n" in out, f"no JSON report on stdout; stderr:\n{captured.err[-6000:]}"
    return json.loads(out[out.rindex("\n{\n") + 1:] if not out.startswith("{\n") else out)


def verify_resume(mamba_runs, out: Path, *extra: str, line=MAMBA) -> int:
    runs, rcs = mamba_runs
    assert rcs["a"] == 0
    return bitdet(["verify-resume", "--megatron-lm", script(HYBRID), "--resume-at", "2", "--nproc", "2",
                   "--out", str(out), "--reference", str(runs["a"]), "--json", *extra,
                   "--", *line])


def test_verify_resume_holds_on_megatron_checkpoints_with_dropout_and_distopt(mamba_runs, tmp_path, capsys):
    """The line as a production job writes it, resuming from its own folder with --no-load-optim: the
    workflow drops those flags, each with a note, and its own chain holds."""
    capsys.readouterr()
    rc = verify_resume(mamba_runs, tmp_path, line=[*MAMBA, *resumes(tmp_path / "job"), "--no-load-optim"])
    captured = capsys.readouterr()
    report = last_json(captured)
    assert rc == 0 and report["holds"], report
    for flag in ("--save", "--load", "--no-load-optim"):
        assert f"[bitdet] note: verify-resume drops {flag} from the line" in captured.err
    assert "drops --no-load-optim from the line: each launch restores everything its checkpoint holds" in captured.err
    components = {c["component"] for c in report["checks"]}
    assert {"parameters", "optimizer", "scheduler", "data", "rng.torch_cpu", "rng.tracker"} <= components
    assert all(c["equal"] for c in report["checks"]) and {c["rank"] for c in report["checks"]} == {0, 1}
    assert [p["steps_compared"] for p in report["points"]] == [[1, 2], [3]]
    # snapshots are digest files: no full-state file in the reference or the chain, no second pass
    runs, _ = mamba_runs
    snapshots = [p for d in (tmp_path, runs["a"]) for p in Path(d).rglob("*") if "snapshots" in p.parts and p.is_file()]
    assert snapshots and all(p.suffix == ".json" for p in snapshots), snapshots
    assert not list(tmp_path.glob("second_pass_*"))


def test_a_wall_clock_stop_saves_and_the_same_line_resumes_bitwise(mamba_runs, tmp_path):
    """--exit-duration-in-mins, as a job with a time limit sets it: after every step Megatron compares the
    elapsed minutes with it (all-reduce MAX: every rank stops at the same step), saves and exits 0. Megatron
    reads an int (0 disables it), so -1 stops at the first check, as a job's limit would at a later one. The
    same line launched again resumes from that save: one step per launch, each byte for byte the
    uninterrupted run's (run b); the manifest records the stop as wall-clock (and, with Megatron's SIGTERM handler
    installed, as signal driven too)."""
    runs, rcs = mamba_runs
    assert rcs["b"] == 0
    line = [*MAMBA, *resumes(tmp_path / "ckpt"), "--exit-duration-in-mins", "-1", "--exit-signal-handler"]
    launches = [tmp_path / f"launch{k}" for k in (1, 2)]
    for run in launches:
        assert launch(run, HYBRID, line) == 0
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    for rank in (0, 1):
        whole = (runs["b"] / "fingerprints" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
        assert [(run / "fingerprints" / f"rank_{rank:05d}.jsonl").read_text().splitlines() for run in launches] == \
            [[whole[0]], [whole[1]]]
    manifest = json.loads((launches[1] / "manifest.json").read_text())
    assert manifest["megatron_lm"]["stop"] == ["wall_clock: --exit-duration-in-mins -1",
                                               "signal: --exit-signal-handler (SIGTERM)"]


@pytest.mark.slow  # three launches, one of them over a minute: the default suite stops at the first check (above)
def test_a_one_minute_wall_clock_stop_lands_where_the_clock_says_and_resumes_bitwise(tmp_path):
    """A real time limit: --exit-duration-in-mins 1 on a long schedule stops both ranks at the same step S, the
    first after a minute from the script's start, saved there; the same line resumed runs S+1 and S+2; an
    uninterrupted launch to S+2 agrees with both, line for line."""
    line = [*MAMBA[:MAMBA.index("--train-iters")], "--train-iters", "100000",
            *MAMBA[MAMBA.index("--train-iters") + 2:]]
    ckpt, first, second, whole = (tmp_path / d for d in ("ckpt", "first", "second", "whole"))
    job = ["--save", str(ckpt), "--save-interval", "100000", "--load", str(ckpt)]  # saved only where it stops
    assert launch(first, HYBRID, line, *job, "--exit-duration-in-mins", "1") == 0
    stop = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert launch(second, HYBRID, line, *job, "--exit-interval", str(stop + 2)) == 0
    assert launch(whole, HYBRID, line, "--exit-interval", str(stop + 2)) == 0
    for rank in (0, 1):
        read = lambda run: (run / "fingerprints" / f"rank_{rank:05d}.jsonl").read_text().splitlines()  # noqa: E731
        assert len(read(first)) == stop and read(first) + read(second) == read(whole)


def test_verify_resume_names_a_skipped_rng_restore_and_the_first_divergent_step(mamba_runs, tmp_path, capsys):
    capsys.readouterr()
    rc = verify_resume(mamba_runs, tmp_path, "--skip-restore", "rng")
    report = last_json(capsys.readouterr())
    assert rc == 1 and not report["holds"]
    (resumed,) = [p for p in report["points"] if p["step"] == 2]
    assert "rng.torch_cpu" in resumed["failing_components"]
    assert {"parameters", "optimizer"}.isdisjoint(resumed["failing_components"])
    assert report["first_output_divergence"] == {"2": 3}  # dropout draws from the unrestored generator
    # the generator's state differs by digest; a targeted second pass (both sides re-run to 2, keeping just
    # the differing tensors) counts its elements as a full-state comparison did
    bad = [c for c in report["checks"] if c["component"] == "rng.torch_cpu" and not c["equal"]]
    assert bad and all("elements differ" in c["detail"] and not c["by_digest"] for c in bad), bad
    from megatron_bitdet.rundir import snapshot_full_path
    from megatron_bitdet.train.snapshot import read_full

    kept = read_full(snapshot_full_path(tmp_path / "second_pass_0000002" / "reference", 2, 0))
    assert set(kept) == {(c["component"], c["key"]) for c in report["checks"]
                         if c["rank"] == 0 and "elements differ" in c["detail"]}


def test_verify_resume_refuses_a_reference_of_another_launch_line_before_any_segment(mamba_runs, tmp_path, capsys):
    """A reused reference must be the same line's uninterrupted run: one launched with another seed
    made every segment read as broken (the fresh one first); now exit 2 naming the first differing flag."""
    runs, rcs = mamba_runs
    assert rcs["seed"] == 0
    capsys.readouterr()
    rc = bitdet(["verify-resume", "--megatron-lm", script(HYBRID), "--resume-at", "2", "--nproc", "2",
                 "--out", str(tmp_path / "out"), "--reference", str(runs["seed"]), "--", *MAMBA])
    err = capsys.readouterr().err
    assert rc == 2 and "the reference was launched with another line" in err and "--seed 4321" in err, err
    rc = bitdet(["verify-resume", "--megatron-lm", script("pretrain_gpt.py"), "--resume-at", "2", "--nproc", "2",
                 "--out", str(tmp_path / "out"), "--reference", str(runs["a"]), "--", *MAMBA])
    assert rc == 2 and f"{HYBRID}, not " in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- tracing and localize on Megatron-LM runs
PLANT = shlex.split(next(line for line in README if line.startswith("PLANT="))[len("PLANT="):].split("#")[0])[0].split()
TRACE = next(line for line in README if "--trace " in line and "$PLANT" in line).split("$PLANT")[1].split()
ATOMIC = "bitdet_example.atomic_sum.default"  # the planted op (examples.planted_nondeterminism), as the dispatcher names it
FC2 = "decoder.layers.2.mlp.linear_fc2"      # M*-E: the dense MLP layer is the third


def planted_pair(root: Path, *extra: str) -> dict:
    """Two launches of the README's line with the planted layer spec, from the repository root (the
    ranks import ``examples.`` from there, as a user's ranks import their own spec module); side by side,
    as the ladder re-runs pairs."""
    from concurrent.futures import ThreadPoolExecutor

    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = {k: pool.submit(launch, root / k, HYBRID, MAMBA, *PLANT, *extra) for k in ("a", "b")}
            return {k: f.result() for k, f in futures.items()}
    finally:
        os.chdir(cwd)


def trace_lines(run_dir: Path, rank: int) -> list[bytes]:
    from megatron_bitdet.trace import open_trace, trace_path

    return [raw for _, raw in open_trace(trace_path(run_dir, rank)).lines()]


@pytest.fixture(scope="session")
def planted_runs(tmp_path_factory):
    """Fingerprints only: what `bitdet localize` climbs the ladder from."""
    root = tmp_path_factory.mktemp("megatron_lm_planted")
    return root, planted_pair(root)


@pytest.fixture(scope="session")
def traced_runs(tmp_path_factory):
    """Launched with the README's tracing flags (--trace op --trace-steps 1-1)."""
    root = tmp_path_factory.mktemp("megatron_lm_traced")
    return root, planted_pair(root, *TRACE)


def test_localize_ladder_names_the_planted_op_in_megatron_lm_runs(planted_runs, capsys, monkeypatch):
    """Fingerprint-only runs: the ladder re-launches both from their manifests (script + launch line)
    traced at op level, names the planted op and its module, then the kernel rung captures the op in two
    more re-launches and replays it in isolation."""
    root, rcs = planted_runs
    assert rcs == {"a": 0, "b": 0}
    for k in ("a", "b"):
        assert not (root / k / "traces").exists()
        assert json.loads((root / k / "manifest.json").read_text())["trace"] is None
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    rc = bitdet(["localize", str(root / "a"), str(root / "b"), "--levels", "op", "--json"])
    out = last_json(capsys.readouterr())
    assert rc == 1 and out["diverged"] and out["reproduced"], out
    assert out["first_step"] == 1 and [r["level"] for r in out["rungs"]] == ["op"]
    c = out["culprit"]
    assert (c["op"], c["module"], c["step"], c["phase"], c["classification"]) == (
        ATOMIC, FC2, 1, "forward", "producer")
    rerun = json.loads((root / "a" / "ladder" / "op" / "manifest.json").read_text())
    assert rerun["megatron_lm"]["script"] == script(HYBRID)
    assert rerun["trace"]["level"] == "op" and rerun["trace"]["steps"] == [1, 1]
    tail = rerun["argv"][rerun["argv"].index("--exit-interval"):]
    assert tail[:2] == ["--exit-interval", "1"] and "--trace" in tail  # stopped after the divergent step
    k = out["kernel"]
    assert k["status"] == "replayed", k
    assert k["op"] == ATOMIC and k["rank"] == c["rank"] and k["event_id"] == c["event_id"]
    assert k["mechanism"] == "order_inside_kernel"
    for run in ("a", "b"):
        assert (root / run / "ladder" / "kernel" / "captures" / f"rank_{c['rank']:05d}.capture.pt").is_file()


def test_trace_flags_on_a_megatron_lm_launch_line_write_traces(traced_runs):
    """The tracing flags bitdet train takes work on Megatron-LM's loop: the window's step traced on every
    rank with bitdet train's phases and megatron's module paths as scopes, in the trace format."""
    from megatron_bitdet.trace import open_trace, trace_path

    root, rcs = traced_runs
    assert rcs == {"a": 0, "b": 0}
    manifest = json.loads((root / "a" / "manifest.json").read_text())
    assert manifest["trace"] == {"level": "op", "steps": [1, 1], "ranks": None, "hash": "fast"}
    for rank in (0, 1):
        header = open_trace(trace_path(root / "a", rank)).header
        assert header["level"] == "op" and header["world_size"] == 2
        assert header["manifest_digest"] == manifest["recipe_digest"]
        records = [json.loads(raw) for raw in trace_lines(root / "a", rank)]
        assert {r["step"] for r in records} == {1}
        assert {"forward", "backward", "grad_reduce", "optimizer"} <= {r["phase"] for r in records}
        assert any(r["scope"] == FC2 and r["name"] == ATOMIC for r in records)
        assert any(r["name"] == "optimizer.step" for r in records) and any(r["name"] == "grad_buffers" for r in records)
        assert [s["step"] for s in lines(root / "a", rank)] == [1, 2, 3]  # the run itself went on


def test_localize_on_megatron_lm_traces_names_the_planted_op(traced_runs, capsys):
    root, _ = traced_runs
    capsys.readouterr()
    assert bitdet(["localize", str(root / "a"), str(root / "b"), "--json"]) == 1
    c = json.loads(capsys.readouterr().out)["culprit"]
    assert (c["op"], c["module"], c["step"], c["classification"]) == (ATOMIC, FC2, 1, "producer")


def test_localize_clean_megatron_lm_twins_exit_0(mamba_runs, capsys):
    runs, _ = mamba_runs
    capsys.readouterr()
    assert bitdet(["localize", str(runs["a"]), str(runs["b"])]) == 0
    assert "fingerprints match over 3 steps" in capsys.readouterr().out


def test_bad_trace_flags_are_refused_before_any_rank_starts(tmp_path, capsys):
    rc = launch(tmp_path / "t", HYBRID, MAMBA, "--trace", "op", "--trace-steps", "3-1")
    assert rc == 2 and "--trace-steps 3-1: need 1 <= A <= B" in capsys.readouterr().err
    rc = launch(tmp_path / "t", HYBRID, MAMBA, "--trace", "module", "--trace-capture", "0:1/forward/x/y#0")
    assert rc == 2 and "needs --trace op" in capsys.readouterr().err
    assert not (tmp_path / "t" / "logs").exists()


def test_a_rerun_line_drops_the_originals_outputs_and_adds_the_window():
    from megatron_bitdet.megatron_lm.launch import rerun_args
    from megatron_bitdet.trace import TraceConfig
    from megatron_bitdet.trace.options import trace_settings
    from megatron_bitdet.megatron_lm.options import preparse

    line = [*MAMBA, "--save", "ck", "--save-interval=2", "--run-dir", "r", "--snapshot-at", "2", *TRACE,
            "--tensorboard-dir", "tb"]
    trace = TraceConfig("op", (2, 2), frozenset({1}), capture={"rank": 1, "event_id": "2/forward/a.b/aten.mm.default#0"})
    out = rerun_args(line, stop_at=2, trace=trace)
    assert out[:len(MAMBA)] == MAMBA
    assert out[len(MAMBA):len(MAMBA) + 2] == ["--exit-interval", "2"]
    assert trace_settings(preparse(out)) == trace  # the flags read back as the same window and capture
    assert not {"--save", "--save-interval=2", "--run-dir", "--snapshot-at", "--tensorboard-dir"} & set(out)


def readme_command(prefix: str, out: Path, *extra: str) -> list[str]:
    """The README command starting with ``prefix`` as argv, exactly as written: $MEGATRON_LM_PATH and
    $ARGS expanded, its --out pointed at ``out``, ``extra`` options put before the launch line's --."""
    words = shlex.split(next(line for line in README if line.startswith(prefix)).split("#")[0])
    words = [w.replace("$MEGATRON_LM_PATH", MEGATRON_LM) for w in words]
    words[words.index("--out") + 1] = str(out)
    dashes = words.index("--")
    assert words[dashes + 1:] == ["$ARGS"]
    return [*words[1:dashes], *extra, "--", *MAMBA]


def verdict_rows(html: str) -> list[tuple[str, str]]:
    return re.findall(r"<tr class='verdict (holds|broken)'><td>([^<]*)</td><td class='status'>[^<]*</td>"
                      r"<td>([^<]*)</td>", html)


def test_prove_on_a_megatron_lm_launch_line_holds_prints_the_verdicts_and_writes_the_report(tmp_path, capsys):
    """The README's prove: run A (snapshots at 2), run B, the resume chain 0->2->3 against A, A vs B,
    the tax against one launch without --deterministic-mode, report.html."""
    capsys.readouterr()
    rc = bitdet(readme_command("bitdet prove", tmp_path, "--json"))
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "bitdet prove: verdicts" in out and "every guarantee holds" in out
    rows = verdict_rows((tmp_path / "report.html").read_text())
    assert [(state, guarantee.split(" (")[0]) for state, guarantee, _ in rows] == [
        ("holds", "independent reproducibility"), ("holds", "bitwise checkpoint resume"),
        ("holds", "replicas agree within run A")]
    assert rows[0][2].startswith("3 steps × 2 ranks × 6 metrics + 3 digests: bit-identical")
    for rank in (0, 1):
        a = (tmp_path / "run_a" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert a == (tmp_path / "run_b" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
    payload = json.loads((tmp_path / "prove.json").read_text())
    assert payload["resume"]["resume_at"] == [2]
    assert [p["steps_compared"] for p in payload["resume"]["points"]] == [[1, 2], [3]]
    assert {c["rank"] for c in payload["resume"]["checks"]} == {0, 1}
    tax = payload["tax"]
    assert tax["steps"] == [2, 3] and set(tax["deterministic_ms"]) == {"run A", "run B"}
    assert all(len(v) == 2 and min(v) > 0 for v in [*tax["deterministic_ms"].values(), tax["baseline_ms"]])
    baseline = json.loads((tmp_path / "tax" / "baseline" / "manifest.json").read_text())
    assert baseline["scope"]["deterministic_mode"] is False and "--deterministic-mode" not in baseline["argv"]
    html = (tmp_path / "report.html").read_text()
    assert "Determinism tax" in html and "sequential launches, not interleaved" in html


@pytest.mark.slow  # its parts run by default: the skipped-rng verify-resume above, the holds prove, test_prove's broken exit
def test_prove_on_a_megatron_lm_launch_line_reports_a_skipped_restore_as_broken(tmp_path, capsys):
    capsys.readouterr()
    rc = bitdet(readme_command("bitdet prove", tmp_path, "--no-tax", "--skip-restore", "rng"))
    out = capsys.readouterr().out
    assert rc == 1, out[-3000:]
    assert "a guarantee is BROKEN" in out
    html = (tmp_path / "report.html").read_text()
    rows = verdict_rows(html)
    assert [state for state, _, _ in rows] == ["holds", "broken", "holds"]
    assert "rng.torch_cpu" in rows[1][2] and "outputs first differ at step 3" in rows[1][2]
    assert "1 of 3 guarantees BROKEN" in html and "--no-load-rng" in html


def test_prove_refuses_a_launch_line_it_cannot_prove_before_any_rank_starts(tmp_path, capsys):
    line = [a for a in MAMBA if a != "--deterministic-mode"]
    base = ["prove", "--megatron-lm", script(HYBRID), "--out", str(tmp_path)]
    assert bitdet([*base, "--", *line]) == 2
    assert "no --deterministic-mode" in capsys.readouterr().err
    assert bitdet([*base, "--recipe", "nemotron_h_tiny", "--", *MAMBA, "--recipe", "r.yaml"]) == 2
    capsys.readouterr()
    assert bitdet([*base, "--recipe", str(tmp_path / "missing.yaml"), "--", *MAMBA]) == 2  # passed on the line
    assert "missing.yaml" in capsys.readouterr().err
    capsys.readouterr()
    # --train-iters 3: nothing after 3; a pasted --save is dropped with a note (prove sets each launch's own)
    assert bitdet([*base, "--resume-at", "3", "--", *MAMBA, "--save", "x"]) == 2
    assert "[bitdet] note: prove drops --save from the line" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_readme_commands_are_the_ones_tested():
    """Each README command is one this file runs (same subcommand, options and $ARGS; paths aside)."""
    commands = [line.split("#")[0].strip() for line in README if line.startswith("bitdet ")]
    assert [c.split()[:2] for c in commands] == [
        ["bitdet", "megatron-lm"], ["bitdet", "megatron-lm"], ["bitdet", "compare"], ["bitdet", "verify-resume"],
        ["bitdet", "megatron-lm"], ["bitdet", "prove"], ["bitdet", "megatron-lm"], ["bitdet", "megatron-lm"],
        ["bitdet", "localize"], ["bitdet", "megatron-lm"], ["bitdet", "megatron-lm"], ["bitdet", "localize"],
        ["bitdet", "localize"]]
    assert commands[0].endswith("$ARGS --snapshot-at 2") and commands[1].endswith("pretrain_mamba.py $ARGS")
    assert "--resume-at 2 --reference runs/mlm_a" in commands[3] and commands[3].endswith("-- $ARGS")
    assert "--seed" in MAMBA and "--deterministic-mode" in MAMBA and "M*-E" in MAMBA
    assert commands[5].startswith("bitdet prove --megatron-lm") and commands[5].endswith("-- $ARGS")
    # localize: planted fingerprint-only runs through the ladder (op rung + kernel rung), planted traced runs
    # directly, the clean twins (tests below)
    assert commands[6].endswith("pretrain_mamba.py $ARGS $PLANT") and commands[7].endswith("pretrain_mamba.py $ARGS $PLANT")
    assert commands[8] == "bitdet localize runs/mlm_p1 runs/mlm_p2 --levels op"
    assert commands[9].endswith("$ARGS $PLANT --trace op --trace-steps 1-1") and commands[10].endswith(
        "$ARGS $PLANT --trace op --trace-steps 1-1")
    assert commands[11] == "bitdet localize runs/mlm_t1 runs/mlm_t2"
    assert commands[12] == "bitdet localize runs/mlm_a runs/mlm_b"
    assert PLANT == ["--spec", "examples.planted_megatron_lm", "planted_mamba_stack_spec"]
    assert TRACE == ["--trace", "op", "--trace-steps", "1-1"]


@pytest.mark.parametrize("key, value, message", [
    ("megatron_lm", {"script": "/nowhere/pretrain_mamba.py"}, "megatron_lm.script: /nowhere/pretrain_mamba.py does not exist"),
    ("argv", "pretrain_mamba.py --seed 1", "argv: expected a list of strings"),
    ("megatron_lm", ["x"], "megatron_lm.script: expected"),
])
def test_ladder_refuses_a_megatron_lm_manifest_it_cannot_relaunch_from(planted_runs, tmp_path, capsys, monkeypatch,
                                                                        key, value, message):
    """Before any rank starts, naming the manifest and the key."""
    import shutil

    monkeypatch.chdir(REPO)
    root, _ = planted_runs
    bad = tmp_path / "b"
    shutil.copytree(root / "b", bad, ignore=shutil.ignore_patterns("ladder"))
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest[key] = value
    (bad / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert bitdet(["localize", str(root / "a"), str(bad), "--levels", "op"]) == 2
    err = capsys.readouterr().err
    assert f"{bad / 'manifest.json'}: {message}" in err
    assert not (bad / "ladder").exists()


def test_tracing_a_megatron_lm_run_changes_no_bit(mamba_runs, tmp_path, capsys):
    """The README's line traced at op level over two steps writes the untraced twin's fingerprints byte for byte."""
    runs, _ = mamba_runs
    assert launch(tmp_path / "t", HYBRID, MAMBA, "--trace", "op", "--trace-steps", "1-2") == 0
    assert {r["step"] for r in map(json.loads, trace_lines(tmp_path / "t", 0))} == {1, 2}
    for rank in (0, 1):
        traced = (tmp_path / "t" / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
        assert traced and traced == (runs["b"] / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes()
    capsys.readouterr()
    assert bitdet(["compare", str(runs["b"]), str(tmp_path / "t")]) == 0
