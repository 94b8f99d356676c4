"""Shipped patches: installed as package data megatron_bitdet.patches; found through megatron_bitdet.resources."""
