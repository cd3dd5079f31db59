"""The training stage: 3D parallelism over the core's model (TP/PP/DP from the sharding table), the
trainer, checkpoints, the launcher, the sharded forward evaluate starts as a process, and the planner
(training/planner/).

Entry points: ``titan_pipe.training.launch.run_training`` (launch torchrun for a flow.yaml),
``titan_pipe.training.planner.search.make_plan`` (rank the layouts of a workload on a cluster),
``python -m titan_pipe.training.sharded_forward`` (titan_pipe.records.sharded_outputs).
"""
