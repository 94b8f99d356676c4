"""Everything that touches megatron-core beyond its public API, in one place (docs/COMPAT.md).

``versions``: the one supported-versions specifier. ``rebind``: the one helper that re-points
megatron's import-time copies of a function. ``cpu_backend``: the CPU seams. ``patching``: the
declared swaps (``patches/*.yaml``). ``collectives``: torch.distributed swaps. ``checkpoint``: the
optimizer-restore workarounds. ``buffers``: megatron's scratch memory. ``builders``: layer-spec builder
shapes. ``args_entry``: where Megatron-LM takes the launch line. ``rng_checkpoint``: the EP ranks'
checkpointed RNG states. ``hybrid_stack``: the hybrid stack's layers as a launch line gives them, and its virtual pipeline.
"""
