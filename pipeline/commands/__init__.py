"""The face: one Typer module per command group (train, plan, convert + inspect, export, evaluate,
run + schedule), mounted by titan_pipe.cli. Commands are thin shells over the stages' library
functions; only they turn UserError/ConfigError into messages and exit codes (common.py)."""
