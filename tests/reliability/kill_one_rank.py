"""`dtp prune` for torchrun whose rank 1 kills itself with SIGKILL at its Nth training
step (DTP_TEST_KILL_AT_STEP) in the first attempt only: a node lost mid-epoch, for
test_run_safety.py. The restarted attempt runs unchanged."""

import os
import signal
import sys

from dtp_kernels import cli
from dtp_kernels.pipeline import train

if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    kill_at, calls = int(os.environ["DTP_TEST_KILL_AT_STEP"]), [0]
    real_step = train.training_step

    def step_then_die(*args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(*args, **kwargs)

    train.training_step = step_then_die

sys.exit(cli.main(sys.argv[1:]))
