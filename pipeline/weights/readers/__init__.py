"""One reader per source format; each turns a checkpoint into the same SourcePlan (pipeline/weights/source_plan.py)."""
