"""Launching: how a validated config becomes a running job. Everything here runs in the process that
started the job (or, under torchrun/SLURM, in each rank before the engine); the code that runs inside
a worker is ``app/engine/``, and the command line before Hydra is ``app/cli/``'s.

- ``validate.py``: every rule of the run config (the groups', then the hardware kind's), before any
  process group exists;
- ``launch.py``: validate, then run here or start the workers (``app/workers/``);
- ``slurm.py``: a SLURM task's rank and master, exported as torchrun would; requeued jobs resume;
- ``slurm_requeue.py``: a SLURM job told its time limit is near (SIGUSR1) requeues itself after saving;
- ``slurm_batch.py``, ``slurm_sweep.py``: ``hydra/launcher=slurm``: one batch script per job of a
  sweep (``srun python -m app ...``), followed with ``squeue`` until it ends;
- ``hub_kernels.py``: the Hub's kernels off unless asked for, and refused where they cannot run;
- ``overrides.py``: reading and quoting ``key=value`` overrides on the raw command line.

Nothing is imported here, so reading the command line stays as light as its module.
"""
