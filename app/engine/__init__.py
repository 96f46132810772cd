"""The engine: the code that runs inside a worker once the runtime exists.

``run.py`` builds the run (``build.py``: task, model, optimizer, schedule, loaders through the
Accelerator) and drives ``loop.py``, the one training loop, with its stop triggers (``triggers.py``,
``divergence.py``; why it stopped: ``stop_reason.py``), evaluation and metrics, progress (``progress.py``), weight averaging and test
predictions. ``checkpoint.py`` is the checkpoint *policy* (when to save, what to keep, which checkpoint
``resume=`` means, which weights are exported); how checkpoints are written and read lives in
``app/distributed/checkpoint/``, and how processes are started in ``app/launching/`` and ``app/workers/``.

The engine never names a device type or a collective library, and imports nothing specific to one
(``tests/test_engine.py``, ``tests/test_import_graph.py``): that is the runtime's business.
"""
