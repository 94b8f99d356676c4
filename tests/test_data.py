"""The data pipeline on the real stdlib corpus, real megatron datasets and real files on disk."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_bitdet.errors import BitdetInputError
from megatron_bitdet.train.data import build_train_data
from megatron_bitdet.train.data_cache import file_digest, read_json
from megatron_bitdet.train.launch import launch

CAP = 1 << 20  # 1 MiB of stdlib keeps a build well under a second
TESTS = str(Path(__file__).parent)


def _build(cache_dir, seed=1234, dp_rank=0, dp_size=1, mbs=2, gbs=8, corpus="python-stdlib", **extra):
    cfg = SimpleNamespace(corpus=corpus, tokenizer="byte", cache_dir=str(cache_dir), split="98,1,1",
                          max_bytes=CAP, **extra)
    return build_train_data(cfg, seq_length=64, seed=seed, micro_batch_size=mbs, global_batch_size=gbs,
                            dp_rank=dp_rank, dp_size=dp_size, train_samples=400)


def _raw(batch):
    """A micro-batch as raw bytes per key: equality here is bitwise equality."""
    return {k: None if v is None else (str(v.dtype), tuple(v.shape), v.numpy().tobytes()) for k, v in batch.items()}


def _take(td, n):
    return [_raw(next(td)) for _ in range(n)]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data_cache")


def test_builds_megatron_batches_from_stdlib(cache):
    td = _build(cache)
    meta = read_json(td.corpus_dir / "meta.json")
    assert meta["digest"] == td.corpus_digest and td.corpus_dir.name == td.corpus_digest
    assert meta["documents"] == sorted(meta["documents"]) and meta["documents"][0] == "__future__.py"
    assert not any(p in ("test", "tests", "site-packages") for d in meta["documents"] for p in d.split("/"))
    assert meta["num_bytes"] == CAP
    corpus = (td.corpus_dir / "corpus.bin").read_bytes()
    assert len(corpus) == CAP + len(meta["documents"])  # one EOD (byte 0) per document
    batch = next(td)
    assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
    assert batch["tokens"].shape == (2, 64) and batch["loss_mask"].dtype == torch.float32
    assert batch["attention_mask"].shape == (2, 1, 64, 64) and batch["attention_mask"].dtype == torch.bool
    assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert torch.equal(batch["position_ids"][0], torch.arange(64))
    row = bytes(batch["tokens"][0].tolist())
    assert row in corpus  # real stdlib text, byte for byte
    assert td.state_dict()["consumed_samples"] == 2


def test_second_build_reuses_cache(cache):
    first = _build(cache)
    bin_path = first.corpus_dir / "corpus.bin"
    stamp = (bin_path.stat().st_ino, bin_path.stat().st_mtime_ns, (first.corpus_dir / "meta.json").stat().st_mtime_ns)
    markers = {p: p.stat().st_mtime_ns for p in first.corpus_dir.glob("index/*/complete.json")}
    second = _build(cache)
    assert not second.rebuilt
    assert (bin_path.stat().st_ino, bin_path.stat().st_mtime_ns,
            (first.corpus_dir / "meta.json").stat().st_mtime_ns) == stamp
    assert {p: p.stat().st_mtime_ns for p in first.corpus_dir.glob("index/*/complete.json")} == markers


def test_corrupt_cache_is_rebuilt(tmp_path):
    td = _build(tmp_path)
    reference = _take(td, 3)
    bin_path = td.corpus_dir / "corpus.bin"
    good = file_digest(bin_path)
    data = bytearray(bin_path.read_bytes())
    data[1000] ^= 0x01
    bin_path.write_bytes(data)  # a flipped bit in the token file
    (shuffle,) = td.corpus_dir.glob("index/*/*-train-shuffle_index.npy")
    shuffle.write_bytes(shuffle.read_bytes()[:100])  # a torn megatron index file
    again = _build(tmp_path)
    assert again.rebuilt and file_digest(bin_path) == good
    assert _take(again, 3) == reference


def test_same_seed_is_byte_identical_across_fresh_builds(tmp_path):
    a = _take(_build(tmp_path / "a"), 6)
    b = _take(_build(tmp_path / "b"), 6)
    assert a == b


def test_different_seed_changes_the_order(cache):
    a = _take(_build(cache, seed=1), 4)
    b = _take(_build(cache, seed=2), 4)
    assert [x["tokens"] for x in a] != [x["tokens"] for x in b]


def test_resume_from_state_is_exact(cache):
    uninterrupted = _build(cache)
    _take(uninterrupted, 8)  # two steps of 4 micro-batches
    state = dict(uninterrupted.state_dict())
    assert state["consumed_samples"] == 16
    expected = _take(uninterrupted, 5)
    resumed = _build(cache)
    resumed.load_state_dict(state)
    assert _take(resumed, 5) == expected


def test_load_state_refuses_other_data_or_misaligned_position(cache):
    td = _build(cache)
    with pytest.raises(BitdetInputError, match="seed"):
        td.load_state_dict(_build(cache, seed=99).state_dict())
    with pytest.raises(BitdetInputError, match="multiple of"):
        td.load_state_dict({**td.state_dict(), "consumed_samples": 3})


def test_dp_slices_cover_each_global_batch_exactly_once(cache):
    """megatron's sampler: DP rank r takes slice r of every micro_batch_size * dp_size window."""
    whole = _build(cache, mbs=4, gbs=8)  # one rank sees every sample
    ranks = [_build(cache, mbs=2, gbs=8, dp_rank=r, dp_size=2) for r in range(2)]
    assert ranks[0].num_microbatches == 2 and whole.num_microbatches == 2
    for _ in range(2 * whole.num_microbatches):  # two steps
        full = next(whole)
        parts = [next(td) for td in ranks]
        for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
            assert torch.cat([p[key] for p in parts]).numpy().tobytes() == full[key].numpy().tobytes()
    assert ranks[0].consumed_samples == ranks[1].consumed_samples == whole.consumed_samples == 16


def test_text_directory_corpus_and_bad_inputs(tmp_path):
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("alpha beta gamma\n" * 200)
    (docs / "sub" / "b.py").write_text("print('hello')\n" * 200)
    (docs / "skip.bin").write_bytes(b"\0\1\2")  # not .txt/.py: ignored
    td = _build(tmp_path / "cache", corpus=str(docs))
    assert read_json(td.corpus_dir / "meta.json")["documents"] == ["a.txt", "sub/b.py"]
    assert bytes(next(td)["tokens"][0].tolist()) in (td.corpus_dir / "corpus.bin").read_bytes()
    with pytest.raises(BitdetInputError, match="neither"):
        _build(tmp_path / "cache", corpus=str(tmp_path / "missing"))
    (docs / "nul.txt").write_bytes(b"has a \0 byte")
    with pytest.raises(BitdetInputError, match="NUL"):
        _build(tmp_path / "cache", corpus=str(docs))
    with pytest.raises(BitdetInputError, match="multiple of"):
        _build(tmp_path / "cache", mbs=3, gbs=8)
    with pytest.raises(BitdetInputError, match="tokenizer"):
        build_train_data({"tokenizer": "gpt2"}, seq_length=8, seed=0, micro_batch_size=1,
                         global_batch_size=1, dp_rank=0, dp_size=1, train_samples=1, cache_dir=tmp_path)


@pytest.mark.timeout(180)
def test_two_gloo_ranks_build_one_fresh_cache_together(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))}
    rc = launch("dist_workers:build_data", 2, {"cache_dir": str(tmp_path / "cache"), "out": str(out),
                                               "max_bytes": CAP, "steps": 2}, env=env)
    assert rc == 0
    got = [torch.load(out / f"rank_{r}.pt", weights_only=True) for r in range(2)]
    assert got[0]["digest"] == got[1]["digest"]
    assert got[0]["state"] == got[1]["state"] and got[0]["state"]["consumed_samples"] == 16
    # the same build in one process, rank by rank, reading the cache the two ranks wrote
    cfg = {"corpus": "python-stdlib", "max_bytes": CAP}
    for r in range(2):
        td = build_train_data(cfg, seq_length=32, seed=7, micro_batch_size=2, global_batch_size=8,
                              dp_rank=r, dp_size=2, train_samples=64, cache_dir=tmp_path / "cache")
        assert not td.rebuilt  # the ranks left a complete, verified cache
        expected = [next(td)["tokens"] for _ in range(len(got[r]["tokens"]))]
        assert [t.numpy().tobytes() for t in got[r]["tokens"]] == [t.numpy().tobytes() for t in expected]


_RACER = """
import json, sys, time
from pathlib import Path
from megatron_bitdet.train.data import build_train_data
me, cache, sync = sys.argv[1], sys.argv[2], Path(sys.argv[3])
(sync / f"ready_{me}").touch()
while len(list(sync.glob("ready_*"))) < 2:  # start both builds at the same moment
    time.sleep(0.005)
td = build_train_data({"corpus": "python-stdlib"}, seq_length=64, seed=3, micro_batch_size=2,
                      global_batch_size=4, dp_rank=0, dp_size=1, train_samples=64, cache_dir=cache)
print(json.dumps({"rebuilt": td.rebuilt, "tokens": next(td)["tokens"].tolist()}))
"""


@pytest.mark.timeout(120)
def test_two_processes_racing_on_one_fresh_cache(tmp_path):
    """Independent runs (no torch.distributed) serialize on the lock: one builds, the other reuses."""
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(i), str(tmp_path / "cache"), str(sync)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=100) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["rebuilt"] for r in results) == [False, True]
    assert results[0]["tokens"] == results[1]["tokens"]
