"""The training stage: the LLaMA model, its 3D parallelism, checkpoints, the trainer and its launcher,
and the planner (training/planner/).

Entry points (imported on first use, so ``import titan_pipe.model.transformer`` pulls nothing else):
``train`` (titan_pipe.training.launch.run_training: launch torchrun for a flow.yaml) and ``plan``
(titan_pipe.training.planner.search.make_plan: rank the layouts of a workload on a cluster).
"""

_ENTRY_POINTS = {"train": ("titan_pipe.training.launch", "run_training"),
                 "plan": ("titan_pipe.training.planner.search", "make_plan")}


def __getattr__(name: str):
    if name in _ENTRY_POINTS:
        import importlib

        module, attr = _ENTRY_POINTS[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
