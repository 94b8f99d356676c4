"""Pure-torch deterministic kernels (SSD scan, gated RMSNorm, causal conv1d, MoE); import the submodules."""

# Bound over megatron's ``mamba_mixer.HAVE_MAMBA_SSM`` by the ssd_scan patch: the mixer refuses to
# build without mamba_ssm, but with the swaps in place every kernel it calls is ours.
SSM_KERNELS_AVAILABLE = True
