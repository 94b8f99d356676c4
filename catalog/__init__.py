"""Shipped data: the catalog of known nondeterminism sources (megatron_bitdet.catalog)."""
