"""Checkpoints of real 2-rank runs: the round trip is bitwise, corruption and incomplete saves are refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import ITERATIONS, RESUME_AT, train
from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.train.checkpoint import META, iter_dir, resolve_checkpoint
from megatron_bitdet.train.snapshot import snapshot_path


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rank", [0, 1])
def test_round_trip_restores_every_bit(reference_run, resumed_run, rank):
    """Live state after saving K == live state after loading K: parameters, optimizer (main params,
    moments, step), scheduler, every RNG, the data position."""
    assert resumed_run.rc == 0
    # the digest files as written: tensors by chunk digests, floats by their bits, every other value as is
    saved, loaded = ({(c, k): v for c, k, v in json.loads(path.read_text())["leaves"]}
                     for path in (snapshot_path(run.dir, RESUME_AT, rank) for run in (reference_run, resumed_run)))
    assert any(c == "parameters" for c, _ in saved) and any(k.endswith(".exp_avg") for _, k in saved)
    assert sorted(saved) == sorted(loaded)
    differing = [k for k in saved if saved[k] != loaded[k]]
    assert differing == []


def test_latest_names_the_newest_complete_iteration(reference_run):
    root = reference_run.dir / "checkpoints"
    assert (root / "latest").read_text() == f"{ITERATIONS}\n"
    assert resolve_checkpoint(root) == iter_dir(root, ITERATIONS)
    assert sorted(p.name for p in root.iterdir()) == [f"iter_{i:07d}" for i in range(1, ITERATIONS + 1)] + ["latest"]
    assert all((iter_dir(root, i) / META).is_file() for i in range(1, ITERATIONS + 1))


def test_incomplete_checkpoint_is_refused(reference_run, tmp_path):
    """A save that never got its metadata (a crash between the shards and the commit)."""
    root = tmp_path / "checkpoints"
    shutil.copytree(reference_run.dir / "checkpoints", root)
    (iter_dir(root, ITERATIONS) / META).unlink()
    for path in (root, iter_dir(root, ITERATIONS)):  # through 'latest' and directly
        with pytest.raises(BitdetInputError, match=f"iter_{ITERATIONS:07d}: not a complete bitdet checkpoint"):
            resolve_checkpoint(path)


@pytest.mark.timeout(180)
def test_corrupt_checkpoint_fails_the_resume_naming_the_file(reference_run, tmp_path, capfd):
    """One flipped byte in one shard: the resumed run exits 2 and names the file."""
    src = iter_dir(reference_run.dir / "checkpoints", RESUME_AT)
    ckpt = tmp_path / src.name
    shutil.copytree(src, ckpt)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    run = train(tmp_path / "run", load=str(ckpt))
    assert run.rc == 2
    err = capfd.readouterr().err
    assert "checkpoint is corrupt" in err and f"digest mismatch: {shard.name}" in err
    assert not (tmp_path / "run" / "fingerprints").exists()  # refused before the first step


@pytest.mark.parametrize("edit", ["non_utf8", "rewritten", "digest"])
def test_changed_metadata_is_refused_before_launch(reference_run, tmp_path, capsys, edit):
    """bitdet_meta.json as saved, or exit 2 naming it: non-UTF-8 bytes, a re-serialized (whitespace-only
    change) file, or one digest edited to match a tampered shard."""
    from conftest import RECIPE
    from megatron_bitdet.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(iter_dir(reference_run.dir / "checkpoints", RESUME_AT), ckpt)
    meta = ckpt / META
    raw = meta.read_bytes()
    if edit == "non_utf8":
        meta.write_bytes(raw[:40] + b"\xff\xfe" + raw[40:])
    elif edit == "rewritten":
        meta.write_bytes(raw.replace(b"\n", b"\r\n"))
    else:
        name = sorted(p.name for p in ckpt.glob("*.distcp"))[0]
        meta.write_bytes(raw.replace(json.loads(raw)["files"][name].encode(), b"0" * 32))
    args = ["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
            "--load", str(ckpt), f"training.iterations={ITERATIONS}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{meta}" in err and "corrupt checkpoint metadata" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_recipe_of_other_shapes_is_refused_before_launch(saved_checkpoint, tmp_path, capsys):
    """``--load`` of a hidden-64, 4-expert checkpoint with hidden 128 and 8 experts: exit 2 naming the
    checkpoint's metadata, each key and both values (megatron's CheckpointingException inside the ranks
    before), nothing started."""
    from conftest import RECIPE
    from megatron_bitdet.cli import main

    args = ["train", "--recipe", str(RECIPE), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
            "--load", str(saved_checkpoint), f"training.iterations={ITERATIONS}", "model.hidden_size=128",
            "model.moe.num_experts=8", "model.hidden_dropout=0.1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{saved_checkpoint / META}" in err and "parameter shapes differ from this one's in 2 key(s)" in err, err
    assert "model.hidden_size: checkpoint 64, this recipe 128" in err
    assert "model.moe.num_experts: checkpoint 4, this recipe 8" in err and "hidden_dropout" not in err
    assert not (tmp_path / "run").exists()


class Wrapped:  # what restore_adam_steps reads of megatron's optimizer: ``.optimizer``
    def __init__(self, inner):
        self.optimizer = inner


def test_restored_torch_adam_step_is_per_param():
    """torch Adam: the per-param step is set, the group copy megatron serializes dropped (the FusedAdam
    layout, whose step is the group's: tests/test_fused_adam_resume.py)."""
    from megatron_bitdet.compat.checkpoint import restore_adam_steps

    p = torch.nn.Parameter(torch.ones(2))
    inner = torch.optim.Adam([p])
    p.grad = torch.ones(2)
    for _ in range(3):
        inner.step()
    saved = inner.state_dict()
    saved["param_groups"][0]["step"] = 3.0  # megatron's serialized copy
    inner.load_state_dict(saved)
    restore_adam_steps(Wrapped(inner), {"param_groups": saved["param_groups"]})
    assert "step" not in inner.param_groups[0] and inner.state[p]["step"].item() == 3.0
