"""``python -m megatron_bitdet.megatron_lm SCRIPT.py [--deterministic-mode] [--recipe R] <Megatron args>``."""
import sys

from megatron_bitdet.megatron_lm.entry import main

sys.exit(main(sys.argv[1:]))
