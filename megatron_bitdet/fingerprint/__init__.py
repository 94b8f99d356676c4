"""Fingerprints: exact scalar encodings and tensor digests."""
from megatron_bitdet.fingerprint.floatbits import decode_float, encode_float, first_differing_bit, ulp_distance

__all__ = ["encode_float", "decode_float", "ulp_distance", "first_differing_bit"]
