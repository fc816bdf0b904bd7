"""An exit report for the clean-exit checks (tests/recipes/test_clean_exit.py, the exit section of
scripts/gpu_check.sh): with this folder on PYTHONPATH, each torchrun worker writes at its very
end whether its process group is still up, into EXIT_REPORT_DIR/rank<RANK>. Registered before
the script runs, so it runs after every exit hook the script and the library register (the
teardown has run by then). A file per rank: reports on the shared stderr pipe interleave."""

import atexit
import os
import sys


def _report():
    dist = sys.modules.get("torch.distributed")
    up = bool(dist is not None and dist.is_available() and dist.is_initialized())
    with open(os.path.join(os.environ["EXIT_REPORT_DIR"], "rank" + os.environ["RANK"]), "w") as report:
        report.write(f"process group up: {up}")


if "RANK" in os.environ and "EXIT_REPORT_DIR" in os.environ:  # torchrun's workers, not torchrun itself
    atexit.register(_report)
