"""Sweeps: Hydra's launchers run the jobs (basic, joblib, submitit); this package adds what a resumed
sweep needs (finished jobs read back, not run again) and our Optuna sweeper on Optuna's ask/tell API
(``optuna_search``: search space in Hydra's syntax, samplers, storage), whose trials keep their job
folders across runs of the same command and can be pruned from their own evaluations
(``trial_pruning``). The sweeper classes Hydra instantiates live in ``hydra_plugins/app_sweepers``
(Hydra only loads plugins from there)."""
