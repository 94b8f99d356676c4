"""Megatron-LM's production flags under bitdet's entry point (issue 38, item 6): each runs twice byte-identical
and holds a resume (``verify-resume --megatron-lm`` exit 0), or is refused before any rank starts naming the
flag and the fix. Flags are combined onto as few launch lines as run together (each 2-rank launch is slow):

- PRODUCTION (pretrain_mamba.py): the overlap pair with the distributed optimizer under a ``--recipe`` with
  ``determinism.reductions: topology_invariant``, selective recompute, two blended datasets made by
  Megatron-LM's own ``tools/preprocess_data.py`` with ``--split``, ``--async-save`` (which Megatron turns off
  without ``--use-persistent-ckpt-worker``; with it, a row of what this machine cannot run); the resume chain stops
  each segment through ``--exit-interval`` (Megatron saves there) and resumes it with ``--load``;
- VPP (pretrain_gpt.py): PP 2 with a virtual pipeline, full recompute (megatron-core's MambaStack asserts
  the virtual pipeline away: pretrain_mamba.py with it is a refusal test);
- TP2 (pretrain_mamba.py): train.sh's TP 2 + sequence parallel + bf16 + the overlap pair without
  topology-invariant reductions;
- the Mamba virtual pipeline: a refusal (megatron-core's MambaStack asserts it away inside the ranks).
"""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bitdet.cli import main as bitdet
from test_megatron_lm import GPT, HYBRID, MAMBA, REPO, last_json, line_recipe, script
from test_megatron_lm_lines import TRAIN_SH_SPEC, apply_fixes, machine_section, replace, train_sh

pytestmark = pytest.mark.timeout(1800)  # a session fixture makes two 2-rank launches in one test's setup
megatron_lm = pytest.mark.megatron_lm  # conftest: skipped naming why without a checkout; a failure under .ci/run

# Megatron-LM's tool, unmodified, with the CPU seams its imports need where CUDA is absent (as the ranks')
PREPROCESS = ("import runpy, sys\nfrom megatron_bitdet.compat.cpu_backend import training\ntraining.install()\n"
              "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


def preprocess(corpus: Path) -> str:
    """``corpus`` (JSONL) through tools/preprocess_data.py with NullTokenizer (text: space-separated ids,
    no hub): the --data-path prefix of the .bin/.idx pair it writes."""
    tool = os.path.join(os.environ["MEGATRON_LM_PATH"], "tools", "preprocess_data.py")
    prefix = str(corpus.with_suffix(""))
    env = {**os.environ, "PYTHONPATH": os.environ["MEGATRON_LM_PATH"]}
    done = subprocess.run([sys.executable, "-c", PREPROCESS, tool, "--input", str(corpus), "--output-prefix", prefix,
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--workers", "1",
                           "--append-eod"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return prefix + "_text_document"


@pytest.fixture(scope="session")
def blended(tmp_path_factory) -> list[str]:
    """Two corpora of random token ids, preprocessed: ``--data-path 0.5 A 0.5 B --split 90,10,0``."""
    root = tmp_path_factory.mktemp("megatron_lm_data")
    rng = random.Random(0)
    prefixes = []
    for name in ("a", "b"):
        docs = [" ".join(str(rng.randrange(1, 250)) for _ in range(rng.randrange(30, 120))) for _ in range(40)]
        corpus = root / f"{name}.jsonl"
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        prefixes.append(preprocess(corpus))
        assert Path(prefixes[-1] + ".bin").stat().st_size > 0
    return ["--data-path", "0.5", prefixes[0], "0.5", prefixes[1], "--split", "90,10,0"]


OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]  # with the line's --use-distributed-optimizer


def production_line(blended: list, recipe: Path) -> list[str]:
    line = replace(replace(MAMBA, "--mock-data", 0, blended), "--eval-iters", 1, ["--eval-iters", "1"])
    return [*line, *OVERLAP, "--recompute-granularity", "selective", "--async-save", "--recipe", str(recipe)]


VPP = [*replace(replace(GPT, "--num-layers", 1, ["--num-layers", "4"]), "--expert-model-parallel-size", 1, []),
       "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "2",
       "--num-layers-per-virtual-pipeline-stage", "1", "--recompute-granularity", "full", "--recompute-method",
       "uniform", "--recompute-num-layers", "1"]
TP2 = [*replace(MAMBA, "--expert-model-parallel-size", 1, []), "--tensor-model-parallel-size", "2",
       "--sequence-parallel", "--bf16", *OVERLAP]


def twins(root: Path, name: str, line: list) -> tuple[dict, list]:
    """Run a (snapshots as step 3 begins: the resume's reference) and run b of ``line``."""
    runs = {k: root / k for k in ("a", "b")}
    rcs = [bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(d), script(name), *line,
                   *(["--snapshot-at", "2"] if k == "a" else [])]) for k, d in runs.items()]
    return runs, rcs


@pytest.fixture(scope="session")
def production_runs(tmp_path_factory, blended):
    root = tmp_path_factory.mktemp("megatron_lm_production")
    line = production_line(blended, line_recipe(root / "topology_invariant.yaml", "{reductions: topology_invariant}"))
    return (line, *twins(root, "pretrain_mamba.py", line))


@pytest.fixture(scope="session")
def vpp_runs(tmp_path_factory):
    return (VPP, *twins(tmp_path_factory.mktemp("megatron_lm_vpp"), "pretrain_gpt.py", VPP))


@pytest.fixture(scope="session")
def tp2_runs(tmp_path_factory):
    """train.sh exports CUDA_DEVICE_MAX_CONNECTIONS=1; Megatron's validate_args asserts it for TP > 1."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        yield (TP2, *twins(tmp_path_factory.mktemp("megatron_lm_tp2"), "pretrain_mamba.py", TP2))


def assert_twins(runs: dict, rcs: list) -> dict:
    """Byte-identical fingerprints on both ranks over the 3 steps; returns run a's manifest."""
    assert rcs == [0, 0]
    for rank in (0, 1):
        a, b = ((r / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes() for r in runs.values())
        assert a == b and [json.loads(x)["step"] for x in a.splitlines()] == [1, 2, 3]
    return json.loads((runs["a"] / "manifest.json").read_text())


def assert_megatron_built(run: Path, **values: str) -> None:
    """Megatron's own print of its validated args (rank 0's log) shows each ``name ... value``."""
    printed = (run / "logs" / "rank_00000.log").read_text()
    for name, value in values.items():
        assert re.search(rf"^  {name} \.+ {re.escape(value)}$", printed, re.M), name


def assert_resume_holds(name: str, line: list, reference: Path, out: Path, capsys) -> dict:
    """verify-resume on Megatron-LM's own checkpoints: 0 -> 2 stopped by --exit-interval 2 (saved there),
    2 -> 3 resumed with --load; every restored component and later step equal on both ranks."""
    capsys.readouterr()
    rc = bitdet(["verify-resume", "--megatron-lm", script(name), "--resume-at", "2", "--nproc", "2", "--out", str(out),
                 "--reference", str(reference), "--json", "--", *line])
    report = last_json(capsys.readouterr())
    assert rc == 0 and report["holds"], report
    components = {c["component"] for c in report["checks"]}  # bf16: the fp32 source and the compute copy
    assert {"optimizer", "scheduler", "data"} <= components and components & {"parameters", "fp32_main_params"}
    assert all(c["equal"] for c in report["checks"]) and {c["rank"] for c in report["checks"]} == {0, 1}
    assert [p["steps_compared"] for p in report["points"]] == [[1, 2], [3]]
    first = json.loads((out / "segment_00_0000000-0000002" / "manifest.json").read_text())["argv"]
    assert first[first.index("--exit-interval") + 1] == "2" and "--save" in first
    return first


@megatron_lm
def test_production_line_twins_are_byte_identical(production_runs):
    """Overlap pair + distributed optimizer + topology-invariant reductions + selective recompute + blended
    preprocessed data with --split + --async-save: twice, byte for byte, as the manifest records."""
    _, runs, rcs = production_runs
    manifest = assert_twins(runs, rcs)
    assert manifest["recipe"]["determinism"]["reductions"] == "topology_invariant"
    [reductions] = [p for p in manifest["patches"] if p["id"] == "topology_invariant_reductions"]
    assert any("reduce_scatter" in b for b in reductions["bindings"])
    data_path = manifest["argv"].index("--data-path")
    assert manifest["recipe"]["data"]["corpus"] == " ".join(manifest["argv"][data_path + 1:data_path + 5])
    assert manifest["recipe"]["data"]["split"] == "90,10,0"
    parallel = manifest["recipe"]["parallel"]
    assert parallel["distributed_optimizer"] and parallel["overlap_grad_reduce"] and parallel["overlap_param_gather"]
    # Megatron's validate_args turns --async-save off without --use-persistent-ckpt-worker, whose worker needs
    # CUDA (a row of what this machine cannot run, below): here the line's saves are synchronous
    assert_megatron_built(runs["a"], recompute_granularity="selective", async_save="False",
                          overlap_param_gather="True", split="90,10,0")


@megatron_lm
def test_production_line_resume_holds_through_exit_interval(production_runs, tmp_path, capsys):
    line, runs, rcs = production_runs
    assert rcs[0] == 0
    assert_resume_holds("pretrain_mamba.py", line, runs["a"], tmp_path, capsys)
    checkpoints = tmp_path / "segment_00_0000000-0000002" / "checkpoints"
    assert (checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@megatron_lm
def test_virtual_pipeline_with_full_recompute_twins_and_resume(vpp_runs, tmp_path, capsys):
    """PP 2 with 2 virtual stages per rank (Megatron's interleaved schedule), full recompute."""
    line, runs, rcs = vpp_runs
    manifest = assert_twins(runs, rcs)
    assert manifest["recipe"]["parallel"]["pipeline"] == 2
    assert_megatron_built(runs["a"], virtual_pipeline_model_parallel_size="2", recompute_granularity="full")
    assert_resume_holds("pretrain_gpt.py", line, runs["a"], tmp_path, capsys)


@megatron_lm
def test_tp2_sequence_parallel_bf16_overlap_twins_and_resume(tp2_runs, tmp_path, capsys, monkeypatch):
    """train.sh's production flags at TP 2 on CPU (validate_args' GPU-architecture query answered by the
    seam): sequence parallel, bf16, the overlap pair and the distributed optimizer, without
    topology-invariant reductions: twins byte for byte, and the resume."""
    line, runs, rcs = tp2_runs
    recipe = assert_twins(runs, rcs)["recipe"]
    assert (recipe["parallel"]["tensor"], recipe["parallel"]["sequence_parallel"]) == (2, True)
    assert recipe["model"]["params_dtype"] == "bfloat16"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert_resume_holds("pretrain_mamba.py", line, runs["a"], tmp_path, capsys)


@megatron_lm
def test_async_save_with_its_worker_is_a_row_of_what_this_machine_cannot_run(tmp_path, capsys):
    """--async-save takes effect only with --use-persistent-ckpt-worker (validate_args), and that worker sets a
    CUDA device: --check lists it (exit 3) and the launch exits 2 before any rank starts."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("judges a machine without CUDA")
    line = [*MAMBA, "--async-save", "--use-persistent-ckpt-worker"]
    assert bitdet(["megatron-lm", "--check", "--nproc", "2", script("pretrain_mamba.py"), *line]) == 3
    [row] = machine_section(capsys.readouterr().out)
    assert row.startswith("--async-save --use-persistent-ckpt-worker: needs a CUDA device")
    assert row.endswith("fix: drop --use-persistent-ckpt-worker (Megatron then turns --async-save off and saves "
                        "synchronously)")
    assert bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(tmp_path / "run"), script("pretrain_mamba.py"),
                   *line]) == 2
    assert "no rank started" in capsys.readouterr().err and not (tmp_path / "run" / "logs").exists()


@megatron_lm
@pytest.mark.parametrize("name, line, flag, fix", [
    (HYBRID, [*replace(MAMBA, "--expert-model-parallel-size", 1, []), "--pipeline-model-parallel-size",
              "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage",
     # megatron-core 0.16.1's MambaStack asserts it inside the ranks: bitdet's refusal; 0.18's HybridStack takes
     # virtual stages from the pattern's | segments, and core_v0.19.0's validate_args refuses the flag itself
     "describe a number of pipeline segments in --hybrid-layer-pattern" if HYBRID == "pretrain_hybrid.py"
     else "fix: drop it (pretrain_gpt.py takes it)"),
], ids=["mamba_vpp"])
def test_refused_before_any_rank_starts_naming_the_flag_and_the_fix(name, line, flag, fix, tmp_path, capsys):
    """A line the ranks would refuse (0.16.1: MambaStack's assert; 0.19: Megatron's validate_args): exit 2
    before any rank starts (--check too), naming the flag and the fix."""
    assert bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(tmp_path / "run"), script(name), *line]) == 2
    err = capsys.readouterr().err
    assert flag in err and fix in err, err
    assert not (tmp_path / "run" / "logs").exists()
    assert bitdet(["megatron-lm", "--check", "--nproc", "2", script(name), *line]) == 2
    assert fix in capsys.readouterr().err


def test_bitdet_train_overlap_keys_twins_and_resume(tmp_path):
    """bitdet's own loop with ``parallel.overlap_grad_reduce`` / ``overlap_param_gather`` (distributed
    optimizer, EP 2): twice byte for byte, and the resume holds component by component."""
    from megatron_bitdet.recipe import load_recipe
    from megatron_bitdet.workflows.resume import run_reference, verify_resume

    recipe = load_recipe(str(Path(__file__).resolve().parents[1] / "recipes" / "nemotron_h_tiny.yaml"),
                         ["training.iterations=3", "parallel.overlap_grad_reduce=true",
                          "parallel.overlap_param_gather=true"])
    runs = [run_reference(recipe, [2], nproc=2, run_dir=tmp_path / k) for k in ("a", "b")]
    for rank in (0, 1):
        a, b = ((r / "fingerprints" / f"rank_{rank:05d}.jsonl").read_bytes() for r in runs)
        assert a == b and len(a.splitlines()) == 3
    manifest = json.loads((runs[0] / "manifest.json").read_text())
    assert manifest["recipe"]["parallel"]["overlap_param_gather"] is True
    report = verify_resume(recipe, [2], nproc=2, out_dir=tmp_path / "chain", reference_dir=runs[0])
    assert report.holds, report.summary()
    assert [p.steps_compared for p in report.points] == [[1, 2], [3]]


def test_overlap_param_gather_without_its_prerequisites_is_refused_naming_the_key():
    from megatron_bitdet.recipe import RecipeError, load_recipe

    recipe = str(Path(__file__).resolve().parents[1] / "recipes" / "nemotron_h_tiny.yaml")
    with pytest.raises(RecipeError, match="parallel.overlap_param_gather.*needs distributed_optimizer"):
        load_recipe(recipe, ["parallel.overlap_param_gather=true"])


def pasted_block() -> list[str]:
    """The README's second "Megatron-LM users" block: NVIDIA's line pasted, --check, its fixes, the launch."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Megatron-LM users"):]
    block = section.split("```bash\n")[2]
    return block[:block.index("```")].splitlines()


@megatron_lm
def test_readme_pasted_nvidia_line_checks_then_trains_as_written(tmp_path, capsys, monkeypatch):
    """The README's line is the checkout's train.sh with the sizes it names; --check prints exactly the rows
    the README shows (exit 3); FIXES is what those rows say to add; with them --check exits 0 and the line
    trains 3 iterations on TP 2 with train.sh's production flags. With core_v0.19.0's checkout: the block with
    the three changes the README names after it."""
    block = pasted_block()
    values = {line.split("=", 1)[0]: shlex.split(line.split("=", 1)[1])[0].split() for line in block
              if line.startswith(("NVIDIA=", "FIXES="))}
    nvidia, fixes = values["NVIDIA"], values["FIXES"]
    sizes = dict(TENSOR_MODEL_PARALLEL_SIZE="2", SEQ_LEN="32", GLOBAL_BATCH_SIZE="4", TRAIN_SAMPLES="12",
                 LR_WARMUP_SAMPLES="4", LR_DECAY_SAMPLES="8")
    shown = block[block.index("#   will not run on this machine:") + 1:]
    rows = [line.lstrip("# ") for line in shown[:next(i for i, x in enumerate(shown) if not x.startswith("#"))]]
    if HYBRID == "pretrain_hybrid.py":  # core_v0.19.0's train.sh: the block with the README's three changes
        changes = " ".join((REPO / "README.md").read_text().split("With Megatron-LM core_v0.19.0's train.sh", 1)[1]
                           .split("\n\n", 1)[0].split())
        pattern = re.search(r"`--hybrid-layer-pattern (\S+)`", changes).group(1)
        old_spec = nvidia[nvidia.index("--spec") + 1:nvidia.index("--spec") + 3]
        assert f"`{TRAIN_SH_SPEC}`" in changes and "`$MEGATRON_LM_PATH/pretrain_hybrid.py`" in changes, changes
        nvidia = replace(nvidia, "--num-layers", 1, ["--hybrid-layer-pattern", pattern])
        nvidia = replace(replace(nvidia, "--hybrid-attention-ratio", 1, []), "--hybrid-mlp-ratio", 1, [])
        nvidia = replace(nvidia, "--spec", 2, ["--spec", *TRAIN_SH_SPEC.split()])
        rows[0] = rows[0].replace(" ".join(old_spec), TRAIN_SH_SPEC)
    assert nvidia == replace(train_sh(Path("runs/nv"), **sizes), "--eval-iters", 1, ["--eval-iters", "1"])
    assert any(line.startswith("export CUDA_DEVICE_MAX_CONNECTIONS=1 ") for line in block)
    assert apply_fixes(nvidia, rows)[len(nvidia) - 3:] == fixes
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    monkeypatch.chdir(tmp_path)
    expand = {"$MEGATRON_LM_PATH/pretrain_mamba.py": [script(HYBRID)], "$NVIDIA": nvidia, "$FIXES": fixes}
    commands = [[x for w in shlex.split(line.split("#")[0])[1:] for x in expand.get(w, [w])]
                for line in block if line.startswith("bitdet ")]
    assert len(commands) == 3
    capsys.readouterr()
    assert bitdet(commands[0]) == 3
    assert machine_section(capsys.readouterr().out) == rows
    assert bitdet(commands[1]) == 0, capsys.readouterr()
    assert bitdet(commands[2]) == 0
    run = tmp_path / "runs" / "nvidia"
    for rank in (0, 1):
        assert [json.loads(x)["step"] for x in (run / "fingerprints" / f"rank_{rank:05d}.jsonl").read_text().splitlines()
                ] == [1, 2, 3]
    recipe = json.loads((run / "manifest.json").read_text())["recipe"]
    assert (recipe["parallel"]["tensor"], recipe["parallel"]["sequence_parallel"]) == (2, True)
    assert recipe["parallel"]["overlap_param_gather"] and recipe["model"]["params_dtype"] == "bfloat16"
