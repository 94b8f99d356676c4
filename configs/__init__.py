"""Shipped configs: installed as package data megatron_bitdet.configs; found through megatron_bitdet.resources."""
