"""What torchrun runs on every rank: ``python -m titan_pipe.training.rank --flow FLOW [--resume]``.

Apart from the trainer so that ``titan_pipe.training.trainer`` is always the imported module (not
``__main__``): whatever patches or inspects the Trainer class sees the one the rank runs.
"""

from titan_pipe.processes.procs import exit_rank
from titan_pipe.training.trainer import main

if __name__ == "__main__":
    exit_rank(main())
