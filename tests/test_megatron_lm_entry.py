"""The Megatron-LM entry point's way of running a script (``entry.run_as_main``), with no Megatron involved."""
from __future__ import annotations

import json
import sys

from megatron_bitdet.megatron_lm.entry import run_as_main


def test_a_script_run_through_runpy_runs_as_the_entry_runs_scripts(tmp_path):
    """Megatron-LM 0.18+'s pretrain_mamba.py runs pretrain_hybrid.py with runpy.run_path(run_name='__main__'),
    which would make the inner script sys.modules['__main__'] while it runs (dist_checkpointing's spawned
    savers re-import that) and load its source past the CPU rewrite: it runs as the entry runs the outer one."""
    inner, outer, out = tmp_path / "inner.py", tmp_path / "outer.py", tmp_path / "seen.json"
    inner.write_text("import json, sys\n"
                     "if __name__ == '__main__':\n"
                     f"    json.dump({{'main_file': getattr(sys.modules['__main__'], '__file__', None), "
                     f"'file': __file__}}, open({str(out)!r}, 'w'))\n")
    outer.write_text("import runpy\nif __name__ == '__main__':\n"
                     f"    runpy.run_path({str(inner)!r}, run_name='__main__')\n")
    run_as_main(str(outer))
    seen = json.loads(out.read_text())
    assert seen["file"] == str(inner)
    assert seen["main_file"] == getattr(sys.modules["__main__"], "__file__", None) != str(inner)
