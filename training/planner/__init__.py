"""The planner (`titan-pipe plan`): which dp x tp x pp layout of a model fits a cluster and runs fastest.

workload.py (the inputs: cluster, layout, workload, assumptions), memory.py (bytes per device),
timing.py (FLOPs, bubble, communication, step time), search.py (enumerate, check, rank: make_plan).
Pure arithmetic over the trainer's own parallel rules; device profiles are the core's.
"""
