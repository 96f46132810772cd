"""Sweeps on Hydra's own plugins: the launchers run the jobs (basic, joblib, submitit); this package
only adds what a resumed sweep needs (finished jobs read back, not run again) and an Optuna search
whose trials keep their job folders across runs of the same command. The sweeper classes Hydra
instantiates live in ``hydra_plugins/app_sweepers`` (Hydra only loads plugins from there)."""
