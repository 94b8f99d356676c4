"""Megatron-LM's own pretraining (``pretrain_gpt.py``, ``pretrain_mamba.py``), run unmodified under bitdet."""
