"""Fingerprints: exact scalar encodings and tensor digests."""
from megatron_bitdet.fingerprint.floatbits import decode_float, encode_float, first_differing_bit, ulp_distance
from megatron_bitdet.fingerprint.shards import state_digest
from megatron_bitdet.fingerprint.tensor import (
    BlockedTensor, FingerprintConfig, TensorFingerprint, fingerprint, fingerprint_blocked, pos_digest,
)

__all__ = ["encode_float", "decode_float", "ulp_distance", "first_differing_bit",
           "BlockedTensor", "FingerprintConfig", "TensorFingerprint", "fingerprint", "fingerprint_blocked",
           "pos_digest", "state_digest"]
