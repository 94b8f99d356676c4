"""Bits independent of the data-parallel size (issue 40): ``determinism.reductions: dp_invariant``.

Real gloo runs of the tiny hybrid recipe (M / * / E layers, EP 1, dropout on so that the RNG a hosted
virtual rank starts from matters) at DP 1, 2 and 4 with virtual_dp 4, at the recipe's 2 torch threads (4
ranks of 2 threads oversubscribe this machine's cores), must write the same metrics and logical digests at
every step, and ``bitdet compare`` must say MATCH across them; without the mode the
DP 1 and DP 4 runs differ and compare refuses them for scope. The pieces the invariance rests on (the
tree's composition, the exact grad-norm sum, the logical digest, the sampler) are checked directly;
EP 2 at DP 2 and DP 4 (strided hosting keeps the EP groups) is a slow case.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import RECIPE
from megatron_bitdet.cli import main as bitdet
from megatron_bitdet.fingerprint import logical
from megatron_bitdet.kernels.moe_aux import tree_sum
from megatron_bitdet.kernels.reductions import exact_square_sum, rank_order_sum
from megatron_bitdet.recipe import load_recipe
from megatron_bitdet.train.data import TrainData
from megatron_bitdet.train.run import RunOptions, launch_training

V = 4
OVERRIDES = ["training.iterations=2", "training.lr_schedule.warmup_iters=0", "determinism.threads=2",
             "parallel.expert=1", "model.hidden_dropout=0.1"]
INVARIANT = ["determinism.reductions=dp_invariant", f"determinism.virtual_dp={V}"]


def _train(run_dir: Path, nproc: int, extra: list[str], **worker) -> Path:
    """``worker``: a rank entry of tests/ (``worker=``, ``worker_args=``) instead of bitdet train's."""
    recipe = load_recipe(str(RECIPE), [*OVERRIDES, *extra])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        mp.delenv("BITDET_EMULATED_RING", raising=False)
        if worker:
            mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                   os.environ.get("PYTHONPATH")])))
        assert launch_training(recipe, RunOptions(nproc=nproc, run_dir=str(run_dir)), **worker) == 0, run_dir / "logs"
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp_invariant")
    out = {f"inv{n}": _train(root / f"inv{n}", n, INVARIANT) for n in (1, 2, 4)}
    out.update({f"native{n}": _train(root / f"native{n}", n, []) for n in (1, 4)})
    return out


def _lines(run_dir: Path) -> list[list[dict]]:
    """Every rank's fingerprint lines."""
    files = sorted((run_dir / "fingerprints").glob("rank_*.jsonl"))
    return [[json.loads(x) for x in f.read_text().splitlines()] for f in files]


def _logical(run_dir: Path) -> list[tuple]:
    """Per step: rank 0's metrics and the logical digests (every rank's partials added)."""
    ranks = _lines(run_dir)
    steps = []
    for i, line in enumerate(ranks[0]):
        assert all(r[i]["metrics"] == line["metrics"] for r in ranks), f"{run_dir}: ranks disagree on a metric"
        names = sorted(k for k in line["digests"] if k.startswith("logical_"))
        steps.append((line["step"], line["metrics"],
                      {k: logical.combine_partials([r[i]["digests"][k] for r in ranks]) for k in names}))
    return steps


def _compare(a: Path, b: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = bitdet(["compare", str(a), str(b)])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_dp_1_2_4_give_the_same_bits_and_compare_matches(runs, capsys):
    ref = _logical(runs["inv1"])
    assert [s for s, _, _ in ref] == [1, 2]
    step_metrics = ref[0][1]
    assert {"loss", "lm_loss", "grad_norm"} <= step_metrics.keys()
    assert any(k.startswith("aux_loss/") for k in step_metrics), "no MoE aux loss compared"
    # Adam's moments too (the distributed optimizer's shards: no rank holds them whole)
    assert set(ref[0][2]) == {"logical_params", "logical_grads", "logical_exp_avg", "logical_exp_avg_sq"}
    for n in (2, 4):
        assert _logical(runs[f"inv{n}"]) == ref, f"DP {n} differs from DP 1"
    for a, b in (("inv1", "inv4"), ("inv2", "inv4"), ("inv1", "inv2")):
        rc, out = _compare(runs[a], runs[b], capsys)
        assert rc == 0 and "MATCH" in out and "logical digests" in out, out


def test_without_the_mode_dp_1_and_4_differ_and_compare_refuses(runs, capsys):
    one, four = _logical(runs["native1"]), _logical(runs["native4"])
    assert [m for _, m, _ in one] != [m for _, m, _ in four]
    rc, out = _compare(runs["native1"], runs["native4"], capsys)
    assert rc == 2 and "dp: A=1  B=4" in out, out


def _edited(run: Path, to: Path, edit) -> Path:
    """A copy of the run whose manifest ``edit`` changed (the same bits, said to be made otherwise)."""
    shutil.copytree(run, to)
    manifest = json.loads((to / "manifest.json").read_text())
    edit(manifest)
    (to / "manifest.json").write_text(json.dumps(manifest))
    return to


def test_compare_refuses_another_virtual_dp_or_tree_and_catches_a_flipped_partial(runs, tmp_path, capsys):
    other_v = _edited(runs["inv4"], tmp_path / "other_v",
                      lambda m: m["recipe"]["determinism"].update(virtual_dp=2))
    rc, out = _compare(runs["inv1"], other_v, capsys)
    assert rc == 2 and "dp: A=1  B=4" in out, out
    # A run of another cross-virtual-rank structure (before the tree was halves-first over strided hosting,
    # nothing was recorded: its DP 2 vs this DP 4 differed in grads and grad_norm) leaves the scope.
    old_tree = _edited(runs["inv4"], tmp_path / "old_tree", lambda m: m["scope"].pop("dp_invariant_tree"))
    rc, out = _compare(runs["inv2"], old_tree, capsys)
    assert rc == 2 and "dp_invariant_tree: A='pairwise-halves-first" in out and "B=None" in out, out

    flipped = _edited_line(runs["inv4"], tmp_path / "flipped", rank=3, step=2, field=("digests", "logical_grads"))
    rc, out = _compare(runs["inv1"], flipped, capsys)
    assert rc == 1 and "logical_grads" in out and "MATCH" not in out, out


def _edited_line(run, dest, *, rank: int, step: int, field: tuple[str, str]):
    """A copy of ``run`` whose rank file says another last hex digit for ``field`` at ``step`` (1-based)."""
    copy = shutil.copytree(run, dest)
    path = copy / "fingerprints" / f"rank_{rank:05d}.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    section, key = field
    value = lines[step - 1][section][key]
    lines[step - 1][section][key] = value[:-1] + ("0" if value[-1] != "0" else "1")
    path.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    return copy


def test_compare_across_dp_checks_every_ranks_metrics(runs, tmp_path, capsys):
    """Rank 2 of the DP 4 run says another lm_loss at step 2 (its file edited: the ranks' metrics are
    reduced, so only a broken reduction or file makes them differ): compare names rank 2, not only
    the lowest rank's metrics."""
    edited = _edited_line(runs["inv4"], tmp_path / "edited", rank=2, step=2, field=("metrics", "lm_loss"))
    capsys.readouterr()
    assert bitdet(["compare", "--json", str(runs["inv2"]), str(edited)]) == 1
    first = json.loads(capsys.readouterr().out)["first_divergence"]
    assert (first["step"], first["metrics"], first["ranks"]) == (2, ["lm_loss"], [2]), first


def test_a_wrong_moment_at_the_last_step_is_named(runs, tmp_path, capsys):
    """One bit of rank 1's Adam exp_avg shard flipped right after the last step's update (DP 2): the
    step's params are right, so only the moments' logical digest can see it; compare against DP 1 names
    the step and the component."""
    plant = tmp_path / "plant.json"
    planted = _train(tmp_path / "planted", 2, INVARIANT, worker="fingerprint_workers:planted_moment",
                     worker_args={"plant": {"rank": 1, "step": 2, "out": str(plant)}})
    assert json.loads(plant.read_text())["step"] == 2
    capsys.readouterr()
    assert bitdet(["compare", "--json", str(runs["inv1"]), str(planted)]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["diverged_steps"] == [2] and result["first_divergence"]["metrics"] == ["digest:logical_exp_avg"]
    rc, out = _compare(runs["inv1"], planted, capsys)
    assert rc == 1 and "logical_exp_avg" in out and "MATCH" not in out, out


def test_manifest_records_the_virtual_layout(runs):
    def layout(run):
        patches = json.loads((run / "manifest.json").read_text())["patches"]
        (record,) = [p for p in patches if p.get("id") == "dp_invariant_reductions"]
        return record["virtual_layout"]

    two = layout(runs["inv2"])
    assert (two["virtual_dp"], two["dp_size"], two["hosted_per_rank"], two["extra_grad_buffers"]) == (4, 2, 2, 1)
    assert two["hosted_virtual_ranks"] == {"0": [0, 2], "1": [1, 3]} and two["extra_grad_bytes"] > 0
    assert layout(runs["inv1"])["extra_grad_buffers"] == 2
    assert layout(runs["inv4"])["extra_grad_buffers"] == 0


def test_a_dp_that_does_not_divide_v_or_a_v_not_a_power_of_two_is_refused(tmp_path, capsys):
    base = ["train", "--recipe", str(RECIPE), "--run-dir", str(tmp_path / "r")]
    capsys.readouterr()
    assert bitdet([*base, "--nproc", "3", *OVERRIDES, *INVARIANT]) == 2
    assert "determinism.virtual_dp=4 is not divisible by the data-parallel size 3" in capsys.readouterr().err
    assert bitdet([*base, "--nproc", "1", *OVERRIDES, "determinism.reductions=dp_invariant",
                   "determinism.virtual_dp=3"]) == 2
    assert "not a power of two" in capsys.readouterr().err
    assert not (tmp_path / "r" / "fingerprints").exists()


@pytest.mark.slow
def test_tax_reports_the_mode_below_v(tmp_path):
    """At DP 2 < V the deterministic side hosts 2 virtual ranks a rank; the tax steps it beside the same
    recipe with c10d's reductions (plain DP 2) and names the hosting in its note and summary."""
    from megatron_bitdet.workflows.tax import NATIVE_REDUCTIONS, measure_tax

    recipe = load_recipe(str(RECIPE), [*OVERRIDES, *INVARIANT])
    tax = measure_tax(recipe, nproc=2, rounds=2, warmup=0, profile_steps=1, out_dir=tmp_path)
    native = next(s for s in tax.candidates if s.name == NATIVE_REDUCTIONS)
    assert tax.deterministic.invariant_reductions == [True] and native.invariant_reductions == [False]
    label = "dp_invariant reductions (virtual_dp 4, 2 virtual rank(s) per rank: 1 extra grad buffer(s))"
    assert tax.reductions_percent is not None and label in tax.summary()
    assert any(n.startswith(label) and "peak memory" in n for n in tax.notes)


def test_the_tree_composes_over_strided_hosting():
    """A rank's hosted sum (virtual ranks r, r + DP, ...; streamed by GradTree in the order they run)
    feeds the upper levels as those virtual ranks would; a left fold does not decompose."""
    from megatron_bitdet.train.reductions import GradTree, VirtualLayout

    torch.manual_seed(0)
    leaves = torch.randn(8, 4096) * torch.logspace(-4, 4, 8).unsqueeze(1)
    whole = tree_sum(leaves)
    for dp in (1, 2, 4, 8):
        partials = []
        for r in range(dp):
            live = torch.empty(4096)
            tree = GradTree([live])
            for v in VirtualLayout(8, dp, r).runs():
                live.copy_(leaves[v])
                tree.push()
            tree.write_back()
            partials.append(live.clone())
        assert torch.equal(tree_sum(torch.stack(partials)).view(torch.int32), whole.view(torch.int32)), dp
    folded = torch.stack([rank_order_sum(leaves[r::2]) for r in (0, 1)])
    assert not torch.equal(rank_order_sum(folded), rank_order_sum(leaves))


def test_the_square_sum_and_the_logical_digest_ignore_the_split():
    torch.manual_seed(1)
    x = torch.randn(10007) * torch.logspace(-6, 3, 10007)
    splits = [[x], [x[:5000], x[5000:]], [x[:17], x[17:9000], x[9000:]]]
    sums = [exact_square_sum(parts, None) for parts in splits]
    assert len({float.hex(s) for s in sums}) == 1
    assert abs(sums[0] - float((x.double() ** 2).sum())) <= sums[0] * 2 ** -40
    key = logical.name_key("decoder.layers.0.weight")
    digests = {logical.encode(int(sum(logical.partial_sum(p, key, o).item() for p, o in zip(parts, offsets))))
               for parts, offsets in ((splits[0], [0]), (splits[1], [0, 5000]), (splits[2], [0, 17, 9000]))}
    assert len(digests) == 1
    swapped = x.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert logical.encode(int(logical.partial_sum(swapped, key, 0).item())) not in digests


def test_the_sampler_hosts_strided_virtual_ranks():
    """At DP = V each rank draws the usual slice; at DP < V a rank draws its virtual ranks' micro-batches
    in the order it runs them."""
    samples = [{"tokens": torch.tensor([i])} for i in range(64)]
    identity = {"corpus_digest": "x", "global_batch_size": 16}

    def draws(dp, rank):
        data = TrainData(samples, None, identity=identity, micro_batch_size=2, dp_rank=rank, dp_size=dp,
                         corpus_dir=Path("."), rebuilt=False, virtual_dp=V)
        out = [next(data)["tokens"].view(-1).tolist() for _ in range(2 * data.num_microbatches * V // dp)]
        return out, data.consumed_samples

    usual = {r: draws(V, r) for r in range(V)}
    for r in range(V):  # megatron's pretraining sampler: window d of mbs x DP samples, slice r
        assert usual[r] == ([[d * 2 * V + r * 2, d * 2 * V + r * 2 + 1] for d in range(4)], 32)
    runs = {1: {0: [0, 2, 1, 3]}, 2: {0: [0, 2], 1: [1, 3]}}  # strided, in bit-reversed order
    for dp in (1, 2):
        for r in range(dp):
            hosted, consumed = draws(dp, r)
            per_step = [usual[v][0][s * 2:(s + 1) * 2] for s in range(2) for v in runs[dp][r]]
            assert hosted == [b for block in per_step for b in block] and consumed == 32


@pytest.mark.slow
def test_ep_2_at_dp_2_and_4_give_the_same_bits(tmp_path, capsys):
    """Strided hosting: at DP 2 the two ranks running at once are virtual ranks (0, 1), then (2, 3): the
    EP groups of DP 4."""
    two, four = (_train(tmp_path / f"ep{n}", n, [*INVARIANT, "parallel.expert=2"]) for n in (2, 4))
    assert _logical(two) == _logical(four)
    rc, out = _compare(two, four, capsys)
    assert rc == 0 and "MATCH" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["model.params_dtype=bfloat16"], ["parallel.distributed_optimizer=false"]],
                         ids=["bf16_main_params", "replicated_optimizer"])
def test_dp_1_and_2_match_in_bf16_and_without_the_distributed_optimizer(tmp_path, capsys, extra):
    one, two = (_train(tmp_path / f"dp{n}", n, [*INVARIANT, *extra]) for n in (1, 2))
    steps = _logical(one)
    assert steps == _logical(two)
    assert {"logical_exp_avg", "logical_exp_avg_sq"} <= steps[0][2].keys()
    if "bfloat16" in extra[0]:
        assert "logical_main_params" in steps[0][2]
    rc, out = _compare(one, two, capsys)
    assert rc == 0 and "MATCH" in out, out
