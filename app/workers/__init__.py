"""Local worker processes: N processes of this machine, started and watched, and which rank's error a
failed start reports. Below the runtime (``app.distributed.notebook_launcher`` starts its processes
here) and the launchers (``python -m app``'s workers, the tests' and the benchmarks').

- ``elastic.py``: the one place that turns a layout into torch's elastic ``LaunchConfig``, and which
  rank's error to report (the root cause, not a peer that lost its connection); free ports;
- ``processes.py``: ``run_on_processes``: the workers of ``python -m app``, forked from a fork server that
  imported torch and the engine once;
- ``watchdog.py``: survivors of a failed rank get a short grace, then SIGKILL; a hung rank is named.

Torch-free until a process is started.
"""
