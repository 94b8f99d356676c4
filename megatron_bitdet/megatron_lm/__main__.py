"""``python -m megatron_bitdet.megatron_lm SCRIPT.py [--deterministic-mode] [--recipe R] <Megatron args>``."""
import sys

from megatron_bitdet.megatron_lm.entry import main

if __name__ == "__main__":  # spawned helpers (dist_checkpointing's save) re-import this module
    sys.exit(main(sys.argv[1:]))
