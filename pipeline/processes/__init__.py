"""The core's processes: child processes that die with their command (procs, guard), one writer per run dir or output (run_lock), host memory."""
