"""Launching: how a command line becomes running processes and one run folder. Everything here runs
in the process that started the job (or, under torchrun/SLURM, before a rank's Hydra starts); the code
that runs inside a worker is ``app/engine/``.

- ``resume_argv.py``: ``resume=<path>`` rewritten to the original run's overrides and run folder;
- ``torchrun.py``: the ranks of a torchrun job agree on one run folder before Hydra creates any;
- ``slurm.py``: a SLURM task's rank and master, exported as torchrun would; requeued jobs resume;
- ``slurm_requeue.py``: a SLURM job told its time limit is near (SIGUSR1) requeues itself after saving;
- ``slurm_batch.py``, ``slurm_sweep.py``: ``hydra/launcher=slurm``: one batch script per job of a
  sweep (``srun python -m app ...``), followed with ``squeue`` until it ends;
- ``overrides.py``: reading and quoting ``key=value`` overrides on the raw command line;
- ``launch.py``: validate, then run here or start the workers (``launch``), and each worker's logging;
- ``processes.py``: ``python -m app``'s workers (also the tests' and the benchmarks'), started from a fork
  server by ``app/worker_processes.py`` (the one way to start N local processes with torch's elastic
  launcher, and which rank's error a failed run reports; below ``app.distributed``, whose
  ``notebook_launcher`` uses it too; ``worker_errors.py`` keeps its old names importable);
- ``worker_watchdog.py``: survivors of a failed rank get a short grace, then SIGKILL; a hung rank is named.

Nothing is imported here, so reading the command line stays as light as its module.
"""
