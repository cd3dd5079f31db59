"""One reader per source format; each turns a checkpoint into the same SourcePlan (convert/source_plan.py)."""
