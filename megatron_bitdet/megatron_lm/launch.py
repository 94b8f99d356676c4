"""Start N local ranks of a Megatron-LM script under the entry point (``train.launch``, as ``bitdet train``)."""
from __future__ import annotations

import os

from megatron_bitdet.errors import BitdetError


def launch_line(script: str, megatron_args: list, *, nproc: int, run_dir=None) -> int:
    """Run ``script`` on ``nproc`` ranks; the canonical env is in each rank's environment from its
    first instruction (with ``--deterministic-mode``). Returns the exit code."""
    from megatron_bitdet.megatron_lm import entry
    from megatron_bitdet.megatron_lm.options import DEFAULT_RUN_DIR, preparse
    from megatron_bitdet.train.launch import launch

    entry.split_argv([script])  # the script must exist: exit 2 before any rank starts
    argv = list(megatron_args) + (["--run-dir", str(run_dir)] if run_dir else [])
    opts = preparse(argv)
    env = {"PYTHONUNBUFFERED": "1"}
    if opts.deterministic_mode:
        env.update(entry.canonical_env(entry.load_base_recipe(opts)))
    return launch("megatron_bitdet.megatron_lm.entry:rank_worker", nproc,
                  {"script": os.path.abspath(script), "argv": argv},
                  run_dir=opts.run_dir or DEFAULT_RUN_DIR, env=env, console_rank=-1)


def launch_or_fail(script: str, megatron_args: list, *, nproc: int, run_dir, what: str) -> None:
    rc = launch_line(script, megatron_args, nproc=nproc, run_dir=run_dir)
    if rc != 0:
        raise BitdetError(f"{what} failed (exit code {rc}); logs: {os.path.join(str(run_dir), 'logs')}")
