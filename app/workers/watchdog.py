"""Bound the end of a multi-process run whose rank failed: the survivors get a short grace, then SIGKILL.

torch's elastic agent, once a worker has failed, sends the others SIGTERM and waits 30 s (a fixed
default of its process context, not the launcher's ``shutdown_timeout``) before SIGKILL. A rank
that cannot answer SIGTERM (stopped with SIGSTOP, or hung) so kept a failed run alive for the
collective timeout plus those 30 s. This watchdog runs in the launching process: as soon as a
worker has recorded an error (its ``error.json`` in the launcher's log folder), it kills the workers
that are stopped at once and gives the others ``grace_s`` to exit by themselves before killing them
too, remembering which ranks it had to kill and in what state they were, so the failure report can
name a hung rank.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

PID_FILE = "pid-{rank}"


def record_pid(pid_dir: str | None, rank: int) -> None:
    """Called by each worker at start: where the watchdog finds it."""
    if pid_dir is not None:
        (Path(pid_dir) / PID_FILE.format(rank=rank)).write_text(str(os.getpid()))


def process_state(pid: int) -> str | None:
    """The state letter of a live process (``R``, ``S``, ``T`` stopped, ``Z`` zombie…), None when gone.
    Without /proc, a process that exists counts as running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return "R"


class Watchdog(threading.Thread):
    def __init__(self, log_dir: Path, pid_dir: Path, grace_s: float):
        super().__init__(name="app-worker-watchdog", daemon=True)
        self.log_dir, self.pid_dir, self.grace_s = log_dir, pid_dir, grace_s
        self.killed: dict[int, tuple[int, str]] = {}
        """rank -> (pid, state letter it was in) of every worker this watchdog killed."""
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=5)

    def _pids(self) -> dict[int, int]:
        pids = {}
        for path in self.pid_dir.glob(PID_FILE.format(rank="*")):
            try:
                pids[int(path.name.rsplit("-", 1)[1])] = int(path.read_text())
            except ValueError:
                continue
        return pids

    def run(self) -> None:
        failed_at: float | None = None
        while not self._done.wait(0.2):
            if failed_at is None:
                if next(self.log_dir.rglob("error.json"), None) is not None:
                    failed_at = time.monotonic()
                continue
            grace_over = time.monotonic() - failed_at >= self.grace_s
            for rank, pid in sorted(self._pids().items()):
                state = process_state(pid)
                # A stopped process can neither exit nor take SIGTERM: it goes at once, the rest
                # after the grace. SIGKILL works on a stopped process too.
                if state is None or state == "Z" or rank in self.killed or (state != "T" and not grace_over):
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed[rank] = (pid, state)
            if grace_over:
                return

    def hung_ranks_message(self, timeout_s: float | None) -> str | None:
        """One sentence naming the ranks that had to be killed, when a peer's collective timed out."""
        if not self.killed:
            return None
        parts = [f"rank {rank} (process {pid}, {'stopped' if state == 'T' else 'not exiting'})"
                 for rank, (pid, state) in sorted(self.killed.items())]
        after = f" after {timeout_s:g} s (hardware.collective_timeout_s)" if timeout_s is not None else ""
        return f"{', '.join(parts)} stopped responding: the other ranks' collectives timed out{after}, so it was killed."
