"""Shipped recipes: installed as package data megatron_bitdet.recipes; found through megatron_bitdet.resources."""
