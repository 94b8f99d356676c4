import sys

from megatron_bitdet.cli import main

sys.exit(main())
