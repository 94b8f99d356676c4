"""NVIDIA's launch scripts in Megatron-LM's ``examples/`` (issue 50 item 8), shrunk to CPU sizes with only sizes,
tokenizer and data changed: ``--check``'s every line is asserted (each violation and each row of what this machine
cannot run, with its fix), and the line with exactly the fixes ``--check`` printed, and nothing else, trains in 2
real gloo ranks (exit 0). A line that passes ``--check`` and then fails in a rank fails here.

Sources, all at Megatron-LM core_v0.16.1:
- ``examples/gpt3/train_gpt3_175b_distributed.sh``: read from the checkout, its arrays expanded by bash as its
  ``torchrun`` line expands them. Megatron's own ``validate_args`` refuses it (``--rampup-batch-size`` with
  ``--train-iters``; core_v0.19.0's script passes its ``--step-batch-size-schedule`` split into words by an
  unquoted array expansion): exit 2 before any rank, naming the refusal.
- ``examples/mamba/train.sh``: read from the checkout (``test_megatron_lm_lines.train_sh``), at TP 2 on 2 ranks,
  one micro-batch (its 4) per step; core_v0.19.0's (``--hybrid-layer-pattern``, its hybrid TE spec) launched as
  it says, through ``pretrain_hybrid.py``.
- ``examples/mixtral/train_mixtral_8x7b_distributed.sh`` (the MoE line resuming with ``--no-load-optim
  --no-load-rng``) and ``examples/llama/train_llama3_8b_h100_fp8.sh`` (FP8, ``--exit-duration-in-mins``,
  ``--profile``): not laid beside the sources, so their words are held below as bash passes them (the Llama
  script's ``"--split '99,1,0'"`` element keeps its quotes), in the script's order, sizes shrunk.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_bitdet.cli import main as bitdet
from test_megatron_lm import HYBRID
from test_megatron_lm_lines import TRAIN_SH_SPEC, machine_section, train_sh

MEGATRON_LM = os.environ.get("MEGATRON_LM_PATH")
pytestmark = [pytest.mark.megatron_lm,  # conftest: skipped naming why without a checkout; a failure under .ci/run
              pytest.mark.timeout(1800)]  # a module fixture makes one 2-rank launch per line

# examples/mixtral/train_mixtral_8x7b_distributed.sh: 32 layers, hidden 4096 (FFN 14336, 32 heads, 8 query groups),
# seq 4096 / 32768 positions, 8 experts, GBS 256, 500000 iterations, PP 4 x EP 8 -> 2 layers, 64 (128, 4, 2), 64,
# 4 experts, GBS 4, 3 iterations, EP 2; Llama2Tokenizer + --data-path -> NullTokenizer + --mock-data
MIXTRAL = [
    "--use-mcore-models", "--disable-bias-linear", "--seq-length", "64", "--max-position-embeddings", "64",
    "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
    "--init-method-std", "0.01", "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
    "--group-query-attention", "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
    "--rotary-base", "1000000",
    "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
    "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall",
    "--overlap-param-gather", "--overlap-grad-reduce",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--mock-data", "--split", "99990,8,2",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "3",
    "--lr-decay-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1.0e-5", "--weight-decay", "0.1",
    "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--bf16",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "2",
    "--use-distributed-optimizer", "--sequence-parallel",
    "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10",
    "--save", "{ckpt}", "--load", "{ckpt}", "--tensorboard-dir", "{ckpt}/tensorboard", "--no-load-optim",
    "--no-load-rng"]
# examples/llama/train_llama3_8b_h100_fp8.sh, its MOCK branch (NullTokenizer, --mock-data: as written, vocab
# 128256 -> 256): 32 layers, hidden 4096 (FFN 14336, 32 heads, 8 groups, kv 128), seq 8192, GBS 128, 1953125000
# samples -> 2 layers, 64 (128, 4, 2, 16), 64, GBS 4, 28 samples (7 iterations: past --profile-step-start 4)
LLAMA = [
    "--use-mcore-models", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
    "--seq-length", "64", "--max-position-embeddings", "64", "--position-embedding-type", "rope",
    "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--swiglu", "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--train-samples", "28", "--lr-decay-samples", "24",
    "--lr-warmup-samples", "4", "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
    "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
    "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather",
    "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--data-cache-path", "{ckpt}/cache",
    "--tiktoken-pattern", "v2", "--split", "'99,1,0'", "--no-create-attention-mask-in-dataloader",
    "--no-mmap-bin-files", "--num-workers", "1",
    "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
    "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6", "--ckpt-format",
    "torch_dist", "--distributed-timeout-minutes", "60", "--save", "{ckpt}/ck", "--load", "{ckpt}/ck",
    "--tensorboard-dir", "{ckpt}/tb"]

TE = ("--transformer-impl transformer_engine (Megatron's default)", "add --transformer-impl local")
ROPE = ("RoPE fusion (on by default with rope)", "add --no-rope-fusion")
GRAD_ACCUM = ("gradient-accumulation fusion (on by default)",
              "add --no-gradient-accumulation-fusion (or install Apex with its CUDA extensions)")
SOFTMAX = ("masked-softmax fusion (on by default) with --bf16/--fp16", "add --no-masked-softmax-fusion")
PERSIST = ("persistent layer norm (on by default)", "add --no-persist-layer-norm")
FP8 = ("--fp8-format hybrid", "drop --fp8-format; drop --fp8-param-gather (FP8 on CPU: bitdet's emulation, bitdet "
       "verify-resume --recipe recipes/nemotron_h_tiny_fp8.yaml)")
# each line: the script, its words, the exit code of --check, its violations (rule, fix) and its rows (what, fix)
EXAMPLES = {
    "mixtral": ("pretrain_gpt.py", MIXTRAL, 2,
                [("resume_skips_restore",
                  "drop --no-load-optim; drop --no-load-rng (or accept it on purpose with --accept-skipped-restore)")],
                [TE, ROPE, GRAD_ACCUM, PERSIST]),
    "llama3_8b_fp8": ("pretrain_gpt.py", LLAMA, 2, [("cross_entropy_loss_fusion", "drop --cross-entropy-loss-fusion")],
                      [TE, ROPE, FP8, GRAD_ACCUM, SOFTMAX, PERSIST,
                       ("--apply-layernorm-1p", "drop --apply-layernorm-1p"),
                       ("--profile (Nsight, from --profile-step-start 4)", "drop --profile")]),
    "mamba_train_sh": (HYBRID, None, 3, [],
                       [(f"--spec {TRAIN_SH_SPEC}",
                         "use --spec megatron_bitdet.megatron_lm.specs local_mamba_stack_spec"), GRAD_ACCUM, SOFTMAX]),
}


def script(name: str) -> str:
    return os.path.join(MEGATRON_LM, name)


def run_bitdet(argv: list) -> tuple[int, str]:
    """``bitdet argv`` in this process: its exit code and what it printed (stdout, then stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bitdet(argv)
    return rc, out.getvalue() + err.getvalue()


def violations(out: str) -> list[tuple[str, str]]:
    """(rule, fix) of each determinism violation --check printed."""
    found, rule = [], None
    for line in out.splitlines():
        s = line.strip()
        if s.startswith("[") and "] " in s and line.startswith("  ["):
            rule = s[1:s.index("]")]
        elif s.startswith("fix: ") and rule:
            found.append((rule, s[len("fix: "):]))
            rule = None
    return found


def rows(out: str) -> list[tuple[str, str]]:
    """(what, fix) of each row of the machine section."""
    return [(row.split(": needs ", 1)[0], row.split("; fix: ", 1)[1]) for row in machine_section(out)]


def with_fixes(words: list, fixes: list[str]) -> list[str]:
    """``words`` with each fix applied as it reads, and nothing else: ``drop FLAG`` (with its values), ``add
    FLAGS``, ``use FLAG VALUES`` (its values replaced); a fix's parenthesis is an alternative, not applied."""
    words = list(words)
    for fix in fixes:
        for step in fix.split(" (", 1)[0].split("; "):
            verb, flag, *values = step.split()
            if verb == "add":
                words += [flag, *values]
                continue
            assert verb in ("drop", "use") and flag in words, step
            i = j = words.index(flag)
            j += 1
            while j < len(words) and not words[j].startswith("--"):
                j += 1
            words[i:j] = [flag, *values] if verb == "use" else []
    return words


def gpt3_words(ckpt: Path) -> list[str]:
    """examples/gpt3/train_gpt3_175b_distributed.sh's pretrain_gpt.py words, as its torchrun line expands them
    (bash runs the script's own assignments), given its five positional paths."""
    text = (Path(MEGATRON_LM) / "examples" / "gpt3" / "train_gpt3_175b_distributed.sh").read_text()
    head, tail = text.split("torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py", 1)
    program = head + "printf '%s\\n' " + tail
    done = subprocess.run(["bash", "-c", program, "gpt3", str(ckpt), str(ckpt / "tb"), "VOCAB", "MERGES", "DATA"],
                          capture_output=True, text=True, check=True)
    return done.stdout.split()


def shrink(words: list, sizes: dict) -> list[str]:
    """``words`` with each flag's values replaced (``None``: the flag and its values dropped)."""
    for flag, values in sizes.items():
        words = with_fixes(words, [f"drop {flag}" if values is None else f"use {flag} {values}"])
    return words


@pytest.fixture(scope="module", params=list(EXAMPLES))
def example(request, tmp_path_factory):
    """One example line: --check as written (with --deterministic-mode), the line with exactly its fixes, --check of
    that, and one 2-rank launch of it."""
    name = request.param
    root = tmp_path_factory.mktemp(f"example_{name}")
    entry, words, *_ = EXAMPLES[name]
    with pytest.MonkeyPatch.context() as env:
        if words is None:  # train.sh exports it; Megatron's validate_args asserts it for TP > 1
            env.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            line = [*train_sh(root, TENSOR_MODEL_PARALLEL_SIZE="2", GLOBAL_BATCH_SIZE="4", TRAIN_SAMPLES="8",
                              LR_WARMUP_SAMPLES="2", LR_DECAY_SAMPLES="6"), "--deterministic-mode"]
        else:
            line = [w.format(ckpt=root / "ckpt") for w in words] + ["--deterministic-mode"]
        check = ["megatron-lm", "--check", "--nproc", "2", script(entry)]
        first = run_bitdet([*check, *line])
        fixed = with_fixes(line, [fix for _, fix in violations(first[1]) + rows(first[1])])
        second = run_bitdet([*check, *fixed])
        launch = run_bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(root / "run"), script(entry), *fixed])
    return dict(name=name, line=line, first=first, fixed=fixed, second=second, launch=launch, run=root / "run")


@pytest.mark.megatron_lm
def test_check_names_every_problem_of_the_line_with_its_fix(example):
    """As written, the line's --check: exactly the expected violations and rows (each a fact: the rows' own tests
    in test_megatron_lm_lines / below launch or build without the fix and see it fail), every one at once."""
    _, _, code, expected_violations, expected_rows = EXAMPLES[example["name"]]
    rc, out = example["first"]
    assert rc == code, out
    assert violations(out) == expected_violations, out
    assert rows(out) == expected_rows, out


@pytest.mark.megatron_lm
def test_the_line_with_exactly_the_printed_fixes_passes_check_and_trains(example):
    rc, out = example["second"]
    assert rc == 0 and not machine_section(out) and "OK megatron-lm:" in out, out
    rc, out = example["launch"]
    assert rc == 0, out[-4000:]
    fingerprints = (example["run"] / "fingerprints" / "rank_00000.jsonl").read_text().splitlines()
    expected = {"mixtral": 3, "llama3_8b_fp8": 7, "mamba_train_sh": 2}[example["name"]]  # the line's schedule
    assert [json.loads(x)["step"] for x in fingerprints] == list(range(1, expected + 1))


@pytest.mark.megatron_lm
@pytest.mark.parametrize("example", ["mixtral"], indirect=True)
def test_a_swapped_grouped_gemm_is_no_row_while_the_line_has_a_violation(example):
    """--moe-grouped-gemm: bitdet swaps the experts for its deterministic grouped GEMM, so the row (validate_args
    reads the CUDA device's compute capability) is no fact of this line, whatever else --check refuses in it (it
    was listed while the line had any violation): the fixed line keeps the flag and trains, the swap recorded."""
    assert "swapped [te_grouped_gemm]" in example["first"][1]
    assert "--moe-grouped-gemm" in example["fixed"]
    manifest = json.loads((example["run"] / "manifest.json").read_text())
    assert [s["id"] for s in manifest["rules"]["swaps"]] == ["te_grouped_gemm"]


@pytest.mark.megatron_lm
@pytest.mark.parametrize("example", ["llama3_8b_fp8"], indirect=True)
def test_llama_line_records_its_stop_and_megatrons_split(example):
    """The fixed Llama line keeps --exit-duration-in-mins (a production stop, recorded) and its quoted
    ``'99,1,0'`` split, which megatron-core reads through its ``[.0-9]+`` pattern and, with mock data, replaces
    by ``1,1,1``: the manifest records what the run read, and no schema error refuses the line."""
    assert "'99,1,0'" in example["fixed"] and "--exit-duration-in-mins" in example["fixed"]
    manifest = json.loads((example["run"] / "manifest.json").read_text())
    assert manifest["recipe"]["data"]["split"] == "1,1,1"
    assert manifest["megatron_lm"]["stop"] == ["wall_clock: --exit-duration-in-mins 235"]


# how the GPT-3 script ramps its batch up, per Megatron-LM tag: the flag, its shrunk value and the refusal.
# core_v0.19.0's schedule is quoted in its array, but the torchrun line expands the array unquoted: bash splits
# it into words, of which Megatron-LM's parser takes the first (the rest: unexpected values)
RAMPUPS = [("--rampup-batch-size", "2 2 4",  # core_v0.16.1: 16 16 5859375
            "Megatron-LM's validate_args refuses this launch line: expected no batch-size rampup for "
            "iteration-based training (megatron/training/arguments.py:"),
           ("--step-batch-size-schedule", "0:2 8:4",  # core_v0.19.0: "0:16 2.4B:320 ... 12B:1536"
            "the launch line: unexpected value 8:4")]


@pytest.mark.megatron_lm
def test_gpt3_175b_line_is_refused_by_megatrons_own_validate_args_before_any_rank(tmp_path):
    """The GPT-3 175B script's batch rampup does not launch: Megatron-LM's own validate_args refuses a rampup with
    --train-iters (core_v0.16.1); core_v0.19.0's step schedule reaches Megatron's parser split into words (above).
    --check and the launch exit 2 naming that refusal, no rank starts. Shrunk: 96
    layers, hidden 12288, 96 heads, seq 2048, GBS 1536, 500000 iterations, TP 8 x PP 16 -> 2, 64, 4, 64, GBS 4,
    3, PP 2; GPT-2 BPE + --data-path -> NullTokenizer + --mock-data."""
    words = gpt3_words(tmp_path / "ckpt")
    [(flag, value, refusal)] = [r for r in RAMPUPS if r[0] in words]
    words = shrink(words, {
        "--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
        "--max-position-embeddings": "64", "--global-batch-size": "4", flag: value, "--train-iters": "3",
        "--lr-decay-iters": "2", "--tensor-model-parallel-size": "1", "--pipeline-model-parallel-size": "2",
        "--data-path": None, "--vocab-file": None, "--merge-file": None})
    assert "--fp16" in words and "--attention-backend" in words and "DATA" not in words
    words += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--deterministic-mode"]
    rc, out = run_bitdet(["megatron-lm", "--check", "--nproc", "2", script("pretrain_gpt.py"), *words])
    assert rc == 2 and refusal in out, out
    rc, out = run_bitdet(["megatron-lm", "--nproc", "2", "--run-dir", str(tmp_path / "run"), script("pretrain_gpt.py"),
                          *words])
    assert rc == 2 and refusal in out, out
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.megatron_lm
def test_a_half_applied_fp8_fix_is_refused_naming_the_flag_left(tmp_path):
    """The FP8 row's fix drops --fp8-param-gather with --fp8-format: left alone it is megatron-core's
    TransformerConfig assert in every rank at model build ('fp8_param must be used together with fp8 mode'),
    which --check names before any rank starts; with only the TE row's fix applied, the FP8 flags are refused with
    the local modules (they would compute no FP8)."""
    line = [w.format(ckpt=tmp_path) for w in LLAMA] + ["--deterministic-mode"]
    check = ["megatron-lm", "--check", "--nproc", "2", script("pretrain_gpt.py")]
    others = [fix for what, fix in EXAMPLES["llama3_8b_fp8"][4] if what != FP8[0]] + \
        [fix for _, fix in EXAMPLES["llama3_8b_fp8"][3]]
    rc, out = run_bitdet([*check, *with_fixes(line, [*others, "drop --fp8-format"])])
    assert rc == 2 and ("Megatron-LM's model config (TransformerConfig) refuses this launch line: fp8_param must be "
                        "used together with fp8 mode. (megatron/core/transformer/transformer_config.py:") in out, out
    rc, out = run_bitdet([*check, *with_fixes(line, others)])
    assert rc == 2 and "--fp8-format hybrid --fp8-recipe delayed with the local spec" in out, out


def test_the_profile_row_is_megatron_lms_cuda_profiler_call():
    """The --profile row: Megatron-LM's train loop starts Nsight's range with torch.cuda.cudart() at
    --profile-step-start (torch's profiler instead with --use-pytorch-profiler), which raises where torch has no
    CUDA (the Llama line without the fix died there in rank 0); a line that stops before that step has no row."""
    import argparse
    import inspect
    import sys

    import torch

    from megatron_bitdet.compat.cpu_backend import training as cpu_training
    from megatron_bitdet.megatron_lm.machine import missing

    if torch.cuda.is_available():
        pytest.skip("judges a machine without CUDA")
    if MEGATRON_LM not in sys.path:
        sys.path.append(MEGATRON_LM)  # as the entry point puts the script's folder
    cpu_training.install()
    from megatron.training import training

    source = inspect.getsource(training.train)
    assert "elif iteration == args.profile_step_start:" in source
    assert "torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())" in source
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        torch.cuda.cudart()
    runs_here = dict(transformer_impl="local", spec=None, position_embedding_type="none", no_persist_layer_norm=True,
                     profile=True, profile_step_start=4)
    rows = lambda **flags: [r.fix for r in missing(argparse.Namespace(**{**runs_here, **flags}), None,  # noqa: E731
                                                   "pretrain_gpt.py", "*-")]
    assert rows(train_iters=7) == rows(train_iters=None) == ["drop --profile"]  # None: a samples-based schedule
    assert rows(train_iters=4) == rows(train_iters=7, use_pytorch_profiler=True) == []


def test_the_fp8_row_stands_where_the_line_builds_transformer_engines_modules():
    """Without TE, FP8 has no path here: TE's modules do not build (their rows), and with the local ones the line
    is refused (``test_fp8_with_the_local_spec_computes_no_fp8``): a row where the line builds TE's modules, none
    with the local spec (the refusal stands)."""
    import argparse

    from megatron_bitdet.compat.extensions import te_here
    from megatron_bitdet.megatron_lm.machine import missing

    if te_here():
        pytest.skip("judges a machine without Transformer Engine")
    line = dict(spec=None, position_embedding_type="none", no_persist_layer_norm=True, fp8="hybrid")
    rows = lambda **flags: [(r.what, r.fix) for r in missing(argparse.Namespace(**{**line, **flags}),  # noqa: E731
                                                             None, "pretrain_gpt.py", "*-")]
    assert rows(transformer_impl="transformer_engine", fp8_param_gather=True) == [TE, FP8]
    assert rows(transformer_impl="transformer_engine")[1] == (FP8[0], FP8[1].replace("; drop --fp8-param-gather", ""))
    assert rows(transformer_impl="local") == []


def test_the_split_is_read_as_megatron_core_reads_it():
    import argparse

    from megatron_bitdet.megatron_lm.args import megatron_split

    split = lambda **a: megatron_split(argparse.Namespace(**a))  # noqa: E731
    assert split(data_path=["D"], split="'99,1,0'") == split(data_path=["D"], split="99,1") == "99,1,0"
    assert split(data_path=["D"], split="90,10,0") == "90,10,0"
    assert split(mock_data=True, split="'99,1,0'") == "1,1,1"  # no blend: megatron-core's own even split
    assert split(data_path=None, mock_data=False, split="99,1,0") is None
