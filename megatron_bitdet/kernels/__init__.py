"""Pure-torch deterministic kernels (SSD scan, gated RMSNorm, causal conv1d, MoE); import the submodules."""
