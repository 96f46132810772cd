"""The command-line front: ``python -m app [overrides]``, from the raw command line to the launch.

- ``__init__.py``: :func:`main`, the entry (``app/__main__.py``): output safe against a closed pipe and
  Ctrl-C answered in one sentence from the first moment, an exit without the interpreter's teardown;
- ``argv.py``: every rewrite of the command line before Hydra, as one ordered pipeline of named steps
  (``--config-dir``, a sweep over tasks, ``resume=``, SLURM's and torchrun's ranks, the named run folder);
- ``job.py``: Hydra's ``main``: the composed config typed once and checked, the job's run folder held,
  the launch (``app.launching.launch``);
- ``exits.py``: the one sentence and exit status of every refusal, failure or interruption;
- ``configure.py``: the schemas in Hydra's ConfigStore, and the composed config as dataclasses;
- ``hydra_errors.py``: Hydra's composition errors as the app's one sentence;
- ``help.py``: ``python -m app --help``, built from ``conf/`` and the schemas.

Nothing below this package imports it: it is the top layer (``tests/test_import_graph.py``).
"""

from __future__ import annotations

from typing import NoReturn

from app.cli.exits import exit_interrupted, exit_without_teardown
from app.console.output import protect_output
from app.interrupts import Interrupted, interrupt_outside_training


def main() -> NoReturn:
    """``python -m app``: the command line through :func:`app.cli.job.run_command_line`, then the exit."""
    protect_output()  # before anything writes: a pipe closed by Ctrl-C (| tee) drops output, never the run
    interrupt_outside_training()  # from the first moment: Ctrl-C during start-up is no traceback
    try:
        try:
            from app.cli.job import run_command_line

            run_command_line()
        except Interrupted as err:
            exit_interrupted(err)
    except SystemExit as end:  # fail(), an interrupt, Hydra's own errors
        exit_without_teardown(end.code)
    exit_without_teardown(0)  # an uncaught exception instead ends the usual way, with its traceback
