"""The backends: what runs the collectives and wraps the model, one class per process layout, behind
the small ``Backend`` interface (``app.distributed.Backend``). A hardware spec (``app/distributed/hardware/``)
builds one; the Accelerator and the engine only call it.

- ``base``: the interface, and the one-device backend (every collective the identity);
- ``torch_distributed``: one process per device on ``torch.distributed``: DDP and FSDP2;
- ``xla_spmd``: PyTorch/XLA through SPMD, one process per host (``hardware=tpu``); ``xla_metrics``:
  what XLA did during a run (compilations, executions, CPU fallbacks).
"""
