"""Prefect flows and tasks over the stage library functions: `titan-pipe run` / `schedule` (docs/flows.md)."""
