"""The per-step digests (fingerprint.shards) on CPU tensors: the device path (pos64r, what runs on a
GPU) and the host fast path give the same chunks and slices; a replica's check of a chunk equals its
owner's; one flipped bit, a permutation, a moved zero are seen; the result does not depend on the
block size the rows are read in."""
import warnings

import pytest
import torch

from megatron_bitdet.fingerprint import shards
from megatron_bitdet.fingerprint.shards import (CHECK_CHUNKS, ROW_BYTES, Job, Layout, Pending, chunk_rows,
                                                slice_rows, state_digest)


@pytest.fixture(params=["device", "host"])
def path(request, monkeypatch):
    """Both digest paths: ``device`` runs pos64r's torch ops on the CPU tensors (BITDET_DIGESTS=device)."""
    monkeypatch.setattr(shards, "DEVICE_PATH_ON_CPU", request.param == "device")
    return request.param


def digest_rows(tensors, lo=None, hi=None, chunks=1):
    """[(first byte, end byte, hex)] of rows [lo, hi) of a region, in ``chunks`` chunks."""
    layout = Layout.of(tensors)
    lo, hi = 0 if lo is None else lo, layout.rows if hi is None else hi
    pending = Pending()
    pending.launch([Job(list(tensors), layout, lo, hi, chunk_rows(lo, hi, chunks))])
    (_, parts), = pending.resolve()
    return parts


def test_state_digest_covers_names_order_dtype_shape_and_bytes(path):
    a, b = torch.randn(10), torch.randn(10)
    base = state_digest([("a", a), ("b", b)])
    assert base.startswith("pos64r:" if path == "device" else "xxh3_64:")
    assert base == state_digest([("a", a.clone()), ("b", b.clone())])
    assert base != state_digest([("b", b), ("a", a)])
    assert base != state_digest([("x", a), ("b", b)])
    b2 = b.clone()
    b2.view(torch.int32)[9] ^= 1
    assert base != state_digest([("a", a), ("b", b2)])
    assert state_digest([a.view(2, 5)]) != state_digest([a])
    assert state_digest([a]) != state_digest([a.view(torch.int32)])


@pytest.mark.parametrize("size,dtype", [(179456, torch.float32), (100003, torch.bfloat16), (5, torch.float32)])
def test_every_slice_chunk_equals_the_replicas_check_of_it(path, size, dtype):
    """What a replica digests as its check (one chunk of another member's slice) is bit for bit what
    the owner digested for that chunk: the reader compares the two strings."""
    x = torch.randn(size).to(dtype)
    rows = Layout.of([x]).rows
    for members in (1, 2, 3, 4):
        covered = []
        for index in range(members):
            lo, hi = slice_rows(rows, index, members)
            own = digest_rows([x], lo, hi, CHECK_CHUNKS)
            checks = [p for a, b in chunk_rows(lo, hi, CHECK_CHUNKS) for p in digest_rows([x], a, b)]
            assert own == checks
            covered += [(a, b) for a, b, _ in own]
        # the members' chunks tile the buffer's bytes exactly once
        assert [b for _, b in covered[:-1]] == [a for a, _ in covered[1:]]
        assert covered[0][0] == 0 and covered[-1][1] == size * x.element_size()


def test_a_region_of_many_tensors_misaligned_ones_included(path):
    """Main params and params without the distributed optimizer are lists of tensors, some not
    8-byte aligned: each tensor's rows are its own, the last zero-padded, and still every byte counts."""
    base = torch.randn(3001)
    tensors = [base[1:1001], torch.randn(600).to(torch.bfloat16), base[1001:3001]]
    layout = Layout.of(tensors)
    assert layout.rows == 1 + 1 + 2 and layout.total == 1000 * 4 + 600 * 2 + 2000 * 4
    whole = digest_rows(tensors, chunks=4)
    assert [(a, b) for a, b, _ in whole] == [(0, 4000), (4000, 5200), (5200, 5200 + 4096), (5200 + 4096, 13200)]
    for i, t in enumerate(tensors):
        flipped = [u.clone() for u in tensors]
        flipped[i].view(torch.uint8)[-1] ^= 0x80
        changed = [p != q for p, q in zip(whole, digest_rows(flipped, chunks=4))]
        assert changed == [j == layout.first_row[i] + (t.numel() * t.element_size() - 1) // ROW_BYTES
                           for j in range(4)]


def test_device_digest_sees_every_bit_permutations_and_zeros(monkeypatch):
    """pos64r, not an XOR: one flipped bit anywhere, two equal words swapped in place of two others,
    a zero moved, and two flips of the same bit in different words are all seen."""
    monkeypatch.setattr(shards, "DEVICE_PATH_ON_CPU", True)
    x = torch.randn(4096).view(torch.int64)
    base = digest_rows([x])
    for word in (0, 511, 512, 2047):
        for bit in (0, 31, 62, 63):
            y = x.clone()
            y[word] ^= 1 << bit if bit < 63 else -(1 << 63)
            assert digest_rows([y]) != base, (word, bit)
    y = x.clone()
    y[[3, 700]] = y[[700, 3]]
    assert digest_rows([y]) != base
    y = x.clone()
    y[[5, 9]] ^= -(1 << 63)  # the same top bit in two words: a sum or an XOR of words would cancel it
    assert digest_rows([y]) != base
    z = torch.zeros(1024, dtype=torch.int64)
    z2 = z.clone()
    z2[0], z2[1] = 1, 0
    z3 = z.clone()
    z3[1] = 1
    assert len({digest_rows([z])[0][2], digest_rows([z2])[0][2], digest_rows([z3])[0][2]}) == 3


def test_device_digest_does_not_depend_on_the_block_size(monkeypatch):
    """Integer sums are exact: rows read in blocks of 1, 3 or all rows give the same bits."""
    monkeypatch.setattr(shards, "DEVICE_PATH_ON_CPU", True)
    x = torch.randn(50000)
    want = digest_rows([x], chunks=3)
    for rows in (1, 3, 1000):
        monkeypatch.setitem(shards._BLOCK_WORDS, "cpu", rows * shards.ROW_WORDS)
        assert digest_rows([x], chunks=3) == want


def test_fused_row_pass_gives_the_eager_bits_and_a_flip_changes_them(monkeypatch):
    """The compiled row pass (what runs on CUDA; C++ here) against the eager blocks, bit for bit, over
    a region of odd sizes, a misaligned view and several row counts (dynamic shapes)."""
    monkeypatch.setattr(shards, "DEVICE_PATH_ON_CPU", True)
    base = torch.randn(70001)
    region = [base, torch.randn(3, 517).to(torch.bfloat16), base[1:4097], torch.arange(9, dtype=torch.int8)]
    monkeypatch.setenv("BITDET_DIGESTS_FUSED", "0")
    monkeypatch.setattr(shards, "_FUSED", {})
    want = [digest_rows(region, chunks=3), digest_rows([base[:5000]]), digest_rows([base[:77]])]
    assert shards.fused_row_pass("cpu") is None
    monkeypatch.setenv("BITDET_DIGESTS_FUSED", "1")
    monkeypatch.setattr(shards, "_FUSED", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [digest_rows(region, chunks=3), digest_rows([base[:5000]]), digest_rows([base[:77]])]
    # a compiler failure falls back with a warning (and the eager bits): here it must not have
    assert not [w for w in seen if "fused digest kernel" in str(w.message)]
    assert shards.fused_row_pass("cpu") is not None and got == want
    flipped = base.clone()
    flipped.view(torch.int32)[1234] ^= 1 << 7
    assert digest_rows([flipped[:5000]]) != want[1]


def _as_v2(step, rank, line):
    line["v"] = 2
    line["digests"] = {k: "xxh3_64:" + v.partition(":")[2][:16] for k, v in line["digests"].items()}
    line["slices"] = [{"kind": "params", "buf": "0.dense.0", "group": "00ff00ff", "index": rank, "of": 2,
                       "sharded": False, "bytes": 64, "parts": [[32 * rank, 32 * rank + 32, "0123456789abcdef"]]}]


def test_v1_files_still_read_but_their_digests_are_not_compared_with_v2(tmp_path):
    """A v1 run (xxh3_128 of whole buffers) against a v2 run: the metrics compare, the digests are
    refused naming both lines (exit 2), never reported as a divergence."""
    from test_compare import write_run

    from megatron_bitdet.analysis.compare import compare_runs
    from megatron_bitdet.errors import BitdetInputError

    v1, v2 = write_run(tmp_path / "v1"), write_run(tmp_path / "v2", edit=_as_v2)
    with pytest.raises(BitdetInputError, match=r"rank_00000\.jsonl:1 and .*rank_00000\.jsonl:1: digest:grads is "
                                               r"xxh3_128 in A but xxh3_64 in B"):
        compare_runs(v1, v2)
    assert compare_runs(v1, v2, metrics=["loss", "lm_loss", "grad_norm"]).verdict == "match"
    assert compare_runs(v2, write_run(tmp_path / "v2b", edit=_as_v2)).verdict == "match"


@pytest.mark.parametrize("slices", [
    {"kind": "params"},
    [{"kind": "params", "buf": "b", "group": "g", "index": 2, "of": 2, "sharded": False, "bytes": 8, "parts": []}],
    [{"kind": "params", "buf": "b", "group": "g", "index": 0, "of": 2, "sharded": False, "bytes": 8,
      "parts": [[8, 8, "00"]]}],
    [{"kind": "params", "buf": "b", "group": "g", "index": 0, "of": 2, "check_of": 5, "parts": []}],
])
def test_a_malformed_v2_slice_record_is_refused_naming_file_and_line(tmp_path, slices):
    from test_compare import write_run

    from megatron_bitdet.analysis.compare import compare_runs
    from megatron_bitdet.errors import BitdetInputError

    def bad(step, rank, line):
        _as_v2(step, rank, line)
        if step == 3 and rank == 1:
            line["slices"] = slices

    with pytest.raises(BitdetInputError, match=r"rank_00001\.jsonl:3: .*slice"):
        compare_runs(write_run(tmp_path / "a", edit=bad), write_run(tmp_path / "b", edit=_as_v2))


def test_check_names_replicas_that_disagree_and_refuses_what_it_cannot_check(tmp_path, capsys):
    """``bitdet check`` on written lines: rank 1's check of rank 0's chunk at step 4 differs (exit 1,
    named); equal everywhere else; a v1 run has nothing to check (exit 2, naming its file and line)."""
    from test_compare import write_run

    from megatron_bitdet.cli import main as bitdet

    def with_checks(step, rank, line):
        _as_v2(step, rank, line)
        owner = 1 - rank
        digest = "0123456789abcdef" if (step, rank) != (4, 1) else "fedcba9876543210"
        line["slices"].append({"kind": "params", "buf": "0.dense.0", "group": "00ff00ff", "index": rank, "of": 2,
                               "check_of": owner, "parts": [[32 * owner, 32 * owner + 32, digest]]})

    assert bitdet(["check", str(write_run(tmp_path / "v1"))]) == 2
    assert "rank_00000.jsonl:1: fingerprint format v1" in capsys.readouterr().err
    assert bitdet(["check", str(write_run(tmp_path / "v2", edit=with_checks))]) == 1
    out = capsys.readouterr().out
    assert "REPLICAS DISAGREE: 1 disagreeing of 10 chunks" in out
    assert ("step 4: params 0.dense.0 bytes 0-32: ranks 0, 1 disagree with no majority: every one a suspect "
            "[rank 0 0123456789abcdef, rank 1 fedcba9876543210]") in out


def test_a_v2_run_compares_with_a_v3_run_on_its_own_slices_not_its_check_records(tmp_path):
    """v2 checked a chunk of the next rank's slice, v3 the step's chunk on every replica: across the two
    versions the check records differ by design and are left out; within one version they count."""
    from test_compare import write_run

    from megatron_bitdet.analysis.compare import compare_runs

    def lines(version, checked):
        def edit(step, rank, line):
            _as_v2(step, rank, line)
            line["v"] = version
            line["slices"].append({"kind": "params", "buf": "0.dense.0", "group": "00ff00ff", "index": rank, "of": 2,
                                   "check_of": checked, "parts": [[32 * checked, 32 * checked + 32, "0123456789abcdef"]]})
        return edit

    v2 = write_run(tmp_path / "v2", edit=lines(2, 0))
    assert compare_runs(v2, write_run(tmp_path / "v3", edit=lines(3, 1))).verdict == "match"
    assert compare_runs(v2, write_run(tmp_path / "v2b", edit=lines(2, 1))).verdict == "diverged"
