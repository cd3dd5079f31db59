"""A crash on purpose, for the restart and resume tests, kept out of the package.

A test puts this directory on PYTHONPATH (tests/fault_shim.py: ``fault_env``) and sets
``TITAN_PIPE_FAULT=STEP:RANK:PHASE``; Python imports this file at start-up in every process the
test starts (the CLI, torchrun, each rank). In a rank, once ``titan_pipe.training.trainer`` is
imported, the Trainer is patched so that rank RANK exits 1 at step STEP: at the start of the step
(PHASE ``step``), or while writing that step's checkpoint, after its shard file and before the
manifest (PHASE ``checkpoint``, which forces a save at STEP). The fault is one transient failure:
a run that resumed (a retry) does not die again.
"""

from __future__ import annotations

import os
import sys

SPEC = os.environ.get("TITAN_PIPE_FAULT", "")
TARGET = "titan_pipe.training.trainer"


def _parse(spec: str) -> tuple[int, int, str]:
    step, rank, during = spec.split(":")
    if during not in ("step", "checkpoint"):
        raise SystemExit(f"TITAN_PIPE_FAULT={spec!r}: PHASE must be step or checkpoint")
    return int(step), int(rank), during


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _patch(trainer) -> None:
    step_at, rank_at, during = _parse(SPEC)
    cls = trainer.Trainer

    def due(self, step: int) -> bool:
        return self.start == 0 and step == step_at and self.rank == rank_at

    if during == "step":
        train_step = cls.train_step

        def dying_step(self, step):
            if due(self, step):
                _die()
            return train_step(self, step)

        cls.train_step = dying_step
        return

    should_save, save = cls.should_save, cls.save

    def forced(self, step):
        return should_save(self, step) or (self.start == 0 and step == step_at)

    def dying_save(self, step):
        if not due(self, step):
            return save(self, step)
        writer = trainer.ckpt._write_safetensors

        def write_then_die(*a, **k):
            writer(*a, **k)
            _die()

        trainer.ckpt._write_safetensors = write_then_die
        return save(self, step)

    cls.should_save, cls.save = forced, dying_save


class _PatchAfterImport:
    """A finder that hands out the trainer's own spec with a loader that patches after loading."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if SPEC:
    sys.meta_path.insert(0, _PatchAfterImport())
