"""Tensor fingerprints see what an XOR hash cannot: permutations, sign of zero, NaN payloads, fp8 parts."""
import json

import pytest
import torch

from megatron_bitdet.fingerprint.tensor import (
    BlockedTensor, FingerprintConfig, TensorFingerprint, chunk_digests, exact_digest, fingerprint,
    fingerprint_blocked, pos_digest, row_digests, xor_digest,
)


def test_permutation_is_seen_by_pos_digest_but_not_by_xor():
    x = torch.randn(4096, 3)
    p = x[torch.randperm(4096, generator=torch.Generator().manual_seed(0))]
    assert xor_digest(x) == xor_digest(p)  # the XOR blind spot this digest exists for
    assert pos_digest(x) != pos_digest(p)
    assert exact_digest(x) != exact_digest(p)


def test_swapping_two_elements_and_equal_pairs():
    x = torch.arange(10, dtype=torch.float32)
    y = x.clone()
    y[[2, 7]] = y[[7, 2]]
    assert pos_digest(x) != pos_digest(y)
    # equal pairs cancel under XOR; they must not under the positional digest
    assert xor_digest(torch.tensor([5.0, 5.0])) == xor_digest(torch.tensor([0.0, 0.0]))
    assert pos_digest(torch.tensor([5.0, 5.0])) != pos_digest(torch.tensor([0.0, 0.0]))


def test_sign_of_zero_and_nan_payload():
    assert pos_digest(torch.tensor([0.0])) != pos_digest(torch.tensor([-0.0]))
    a = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(a).all() and torch.isnan(b).all()
    assert pos_digest(a) != pos_digest(b)
    assert fingerprint(a) != fingerprint(b)


def test_deterministic_across_calls_and_layouts():
    x = torch.randn(70000)  # several rows plus a tail
    assert pos_digest(x) == pos_digest(x.clone())
    t = torch.randn(33, 17)
    assert pos_digest(t.t()) == pos_digest(t.t().contiguous())  # digest of values in logical order
    assert fingerprint(t.t()).stride != fingerprint(t.t().contiguous()).stride


def test_odd_byte_lengths_and_unaligned_views_are_covered():
    b = torch.arange(13, dtype=torch.uint8)
    c = b.clone()
    c[12] = 99  # last byte lives in the padded tail word
    assert pos_digest(b) != pos_digest(c)
    assert pos_digest(b[1:]) == pos_digest(b[1:].clone())  # storage offset not 8-aligned
    assert pos_digest(torch.zeros(3, dtype=torch.uint8)) != pos_digest(torch.zeros(4, dtype=torch.uint8))


def test_float8_values_and_scales():
    data = torch.randn(4, 64).to(torch.float8_e4m3fn)
    scales = torch.full((4, 2), 127, dtype=torch.uint8)
    fp = fingerprint_blocked(BlockedTensor(data, scales))
    assert fp.values.dtype == "float8_e4m3fn"
    s2 = scales.clone()
    s2[3, 1] = 128
    assert fp.differs_in(fingerprint_blocked(BlockedTensor(data, s2))) == ["scales"]
    d2 = data.clone()
    d2.view(torch.uint8)[0, 0] ^= 1
    assert fp.differs_in(fingerprint_blocked(BlockedTensor(d2, scales))) == ["values"]
    json.dumps(fp.to_json())


def test_per_row_digests_name_the_permuted_rows():
    routing = torch.eye(6, dtype=torch.bool)
    swapped = routing[[0, 1, 3, 2, 4, 5]]
    a = fingerprint(routing, FingerprintConfig(rows=True))
    b = fingerprint(swapped, FingerprintConfig(rows=True))
    assert a.differing_rows(b) == [2, 3]
    assert len(row_digests(torch.randn(5, 3))) == 5  # 12-byte rows are widened, not skipped
    assert chunk_digests(torch.arange(10), 3) != chunk_digests(torch.arange(10).flip(0), 3)


def test_json_round_trip():
    fp = fingerprint(torch.randn(3, 4), FingerprintConfig(exact=True, rows=True, chunks=2))
    back = TensorFingerprint.from_json(json.loads(fp.dumps()))
    assert back == fp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                                   torch.float8_e5m2, torch.complex64])
def test_every_dtype_fingerprints(dtype):
    t = torch.ones(5, 3).to(dtype)
    fp = fingerprint(t, FingerprintConfig(exact=True, rows=True))
    assert fp.numel == 15 and fp.dtype == str(dtype).removeprefix("torch.")
