"""A Hydra-configured training application with an Accelerator-compatible runtime."""
