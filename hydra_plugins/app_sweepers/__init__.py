"""The app's Hydra sweeper plugins (see resumable.py)."""
