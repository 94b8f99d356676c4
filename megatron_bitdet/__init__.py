"""megatron-bitdet: bitwise-deterministic pretraining for NVIDIA Megatron Core."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy, so `import megatron_bitdet` stays cheap (no torch) for the CLI and tools
    if name in ("enable", "add_args"):
        from megatron_bitdet import enforce

        return getattr(enforce, name)
    raise AttributeError(f"module 'megatron_bitdet' has no attribute {name!r}")
