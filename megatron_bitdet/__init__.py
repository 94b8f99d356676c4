"""megatron-bitdet: bitwise-deterministic pretraining for NVIDIA Megatron Core."""

__version__ = "0.1.0"
