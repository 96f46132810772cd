"""Where the run's human output goes, and what it may hold there: the terminal, a pipe, the run's
``app.log``. Torch-free: the launcher sets it up before any heavy import.

- ``output.py``: the terminal and the pipes: plain lines where no terminal is, a closed pipe that
  never fails a run, one whole line per announcement, whether progress is drawn as bars;
- ``logs.py``: where log records go: the one module that changes the logging handlers (Hydra's job
  logging, a worker's, a parallel sweep job's, the bar's, and other libraries' chatter kept off the
  terminal);
- ``native_stderr.py``: lines a hardware kind's C++ runtime writes to stderr, moved to ``app.log``;
- ``config_tree.py``: the resolved config as a tree, printed once at start.
"""
