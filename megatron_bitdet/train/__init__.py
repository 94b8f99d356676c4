"""Training: launch (spawn / torchrun), data (megatron.core.datasets), loop, checkpoints."""
