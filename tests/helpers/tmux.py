"""A real terminal for the tests that check what a user sees: tmux runs a shell command in a detached
session, ``send-keys`` types (Ctrl-C included) and ``capture-pane`` reads the whole screen history."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO


def app_command(*args: str) -> str:
    """``python -m app <args>`` for a shell line, with this checkout on the path and the hub offline."""
    return (f"PYTHONPATH={shlex.quote(str(REPO))} HF_HUB_OFFLINE=1 {shlex.quote(sys.executable)} -m app "
            + " ".join(shlex.quote(a) for a in args))


class Terminal:
    """``with Terminal(folder, "cmd", width=100) as term:`` runs ``cmd`` in ``folder``; the shell then
    prints ``EXIT=<the status of the pipeline's first command>`` and waits."""

    def __init__(self, folder: Path, command: str, width: int = 150, height: int = 50):
        if shutil.which("tmux") is None:
            pytest.skip("tmux is not installed (apt-get install tmux): the terminal test needs a real terminal")
        self.server = f"app-test-{folder.name}-{time.monotonic_ns()}"
        line = f"cd {shlex.quote(str(folder))} && {command}; echo EXIT=${{PIPESTATUS[0]}}; sleep 600"
        subprocess.run(["tmux", "-L", self.server, "new-session", "-d", "-x", str(width), "-y", str(height),
                        "bash", "-c", line], check=True)

    def __enter__(self) -> Terminal:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], check=False)

    def screen(self, *flags: str) -> str:
        """The whole history, wrapped lines joined (``-e``: with the colours' escape sequences)."""
        return subprocess.run(["tmux", "-L", self.server, "capture-pane", "-p", "-J", "-S", "-", *flags],
                              capture_output=True, text=True, check=True).stdout

    def send_keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "-L", self.server, "send-keys", *keys], check=True)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while text not in (screen := self.screen()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return screen

    def wait_for_exit(self, timeout: float = 120) -> str:
        return self.wait_for("EXIT=", timeout)
