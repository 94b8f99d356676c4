"""Test-only Megatron-LM script, run from a folder that links Megatron-LM's ``megatron`` package (the
entry puts the script's folder on sys.path, as for pretrain_mamba.py itself): installs tests/host_sync_recorder.py for this rank (and has each step
write which storages hold the model's state), then runs the script ``$BITDET_RECORDED_SCRIPT``
(pretrain_mamba.py) unmodified as ``__main__``."""
import os
import runpy
import sys

sys.path.append(os.path.dirname(os.environ["BITDET_RECORDED_SCRIPT"]))  # as the entry does for the script it runs
import host_sync_recorder  # noqa: E402  (tests/ is on PYTHONPATH)

if "RANK" in os.environ:  # a rank (the launcher's in-process preflight of the launch line records nothing)
    host_sync_recorder.install(int(os.environ["RANK"]))
    from megatron.training import training  # bitdet's hooks are installed: this wraps theirs

    _bitdet_step = training.train_step

    def train_step(forward_step_func, data_iterator, model, *a, **kw):
        host_sync_recorder.state_storages(model)
        return _bitdet_step(forward_step_func, data_iterator, model, *a, **kw)

    training.train_step = train_step
runpy.run_path(os.environ["BITDET_RECORDED_SCRIPT"], run_name="__main__")
