"""Which rank's error a failed multi-process run reports: now in ``app/worker_processes.py``, below
``app.distributed`` (whose ``notebook_launcher`` needs it too); the names stay importable from here."""

from app.worker_processes import WorkerFailed, call_blaming_the_cause, is_peer_loss, worker_failure

__all__ = ["WorkerFailed", "call_blaming_the_cause", "is_peer_loss", "worker_failure"]
