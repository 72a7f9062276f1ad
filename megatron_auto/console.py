"""The ``megatron-auto`` console script's entry point (also ``python -m megatron_auto``;
``python -m megatron_auto.cli`` runs the same commands without these settings).

``megatron_auto.cli.main`` does the work and returns the exit status; it is what tests and
other Python code call. This wrapper only adds what a short-lived process may do and a library
call must not, and only for the planning commands (``PLANNING_COMMANDS``), which never import
torch and write everything they produce before ``main`` returns:

- ``OPENBLAS_NUM_THREADS=1`` unless the caller set it, before numpy is first imported (this
  module imports nothing of the package until then). numpy's OpenBLAS starts one thread per
  core when it loads and joins them at exit, although the planner never calls into BLAS (its
  arrays are small and element-wise); the pool costs more than the rest of numpy's import
  (docs/cli.md, start-up). The profiler and training subcommands keep the machine's threads.
- ``os._exit`` after stdout, stderr and the logging handlers are flushed: the plan file is
  closed and renamed into place by then (``atomicfile``), and the interpreter's teardown
  (freeing every module and array one by one) is work nobody waits for. A flush that fails
  (e.g. a closed pipe) falls back to the ordinary exit, which reports it as before.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn, Sequence

# The subcommands that run without torch (tests/test_torch_free.py) and return only after their
# output is written.
PLANNING_COMMANDS = ("plan", "evaluate", "explain", "import-galvatron")


def _flushed() -> bool:
    """Flush stdout, stderr and logging's handlers; False if any of them failed."""
    try:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        if "logging" in sys.modules:
            import logging  # already loaded: never imported just to shut it down
            logging.shutdown()  # flushes and closes every handler, as at normal exit
    except (OSError, ValueError):
        return False
    return True


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """Run ``megatron-auto`` with ``argv`` (default ``sys.argv[1:]``) and exit with its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    planning = bool(args) and args[0] in PLANNING_COMMANDS
    if planning and "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    # imported here, after the thread setting: cli loads the planner and with it numpy
    from .cli import main as cli_main
    code = cli_main(args)
    if planning and _flushed():
        os._exit(code)
    sys.exit(code)
