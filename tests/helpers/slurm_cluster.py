"""A real SLURM cluster on this machine, for the tests: ``munged``, ``slurmctld`` and two ``slurmd``.

Everything lives in one temporary folder (configuration, munge key and socket, state, spool, logs,
pid files) and listens on free ports, so it neither needs nor touches ``/etc/slurm`` or a cluster
already running here; clients find it through ``SLURM_CONF``. Accounting is off (no ``slurmdbd``),
as on many small clusters: ``sacct`` fails there.

- node ``<host name>``: this machine, with its cores and memory; partition ``main`` (the default);
- node ``localhost``: a second ``slurmd`` on the same machine (and the same cores), so that a job can
  span two nodes (``--nodes=2``, partition ``two_nodes``); SLURM treats it as a node of its own: its
  tasks get ``SLURM_NODEID`` 1 and the node list names both.
- a requeued job may start again 6 s after its requeue (``cred_expire=5``; SLURM's default is 120 s)
  and the scheduler looks at pending jobs every second: the same behaviour, in test time.

``stop`` cancels the cluster's jobs, then ends the daemons it started, by the pids in their pid files.

As a script (root only)::

    python tests/helpers/slurm_cluster.py start        # prints the folder and export SLURM_CONF=...
    python tests/helpers/slurm_cluster.py stop FOLDER
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo")
SECOND_NODE = "localhost"
START_TIMEOUT_S = 60.0


def unavailable() -> str | None:
    """Why a cluster cannot be started here (None: it can)."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                "(.ci/run does)")
    if os.geteuid() != 0:
        return "starting a SLURM cluster needs root (slurmd starts the tasks of jobs)"
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def memory_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


@dataclass
class SlurmCluster:
    folder: Path
    nodes: tuple[str, ...]

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment of a client of this cluster (sbatch, squeue, a job's scontrol)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(command), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    # -- start ---------------------------------------------------------------------------------------
    @classmethod
    def start(cls, folder: Path | None = None) -> SlurmCluster:
        """Write the configuration, start the daemons and wait until every node is idle."""
        if folder is None:
            folder = Path(tempfile.mkdtemp(prefix="app-slurm-"))
        host = socket.gethostname().split(".")[0]
        nodes = (host,) if host == SECOND_NODE else (host, SECOND_NODE)
        cluster = cls(folder, nodes)
        try:
            cluster._write_files(host)
            cluster._start_daemons()
            cluster._wait_idle()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_files(self, host: str) -> None:
        f = self.folder
        # munged refuses a socket in a folder that others cannot enter, or a key others can read.
        f.chmod(0o755)
        for name, mode in (("run", 0o755), ("key", 0o700), ("state", 0o700), ("log", 0o755), ("spool", 0o755)):
            (f / name).mkdir(exist_ok=True)
            (f / name).chmod(mode)
        for node in self.nodes:
            (f / "spool" / node).mkdir(exist_ok=True)
        key = f / "key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        cpus, memory = os.cpu_count() or 1, memory_mb()
        ports = [free_port() for _ in range(1 + len(self.nodes))]
        node_lines = [f"NodeName={node} NodeHostname={host} Port={port} CPUs={cpus} RealMemory={memory} "
                      "State=UNKNOWN" for node, port in zip(self.nodes, ports[1:])]
        partitions = [f"PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP"]
        if len(self.nodes) > 1:
            partitions.append(f"PartitionName=two_nodes Nodes={','.join(self.nodes)} MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join([
            f"ClusterName=apptest{os.getpid()}",
            f"SlurmctldHost={host}",
            f"SlurmctldPort={ports[0]}",
            # Job ids of this cluster's own: a job's MASTER_PORT is derived from its id (app/launching/slurm.py),
            # and two clusters numbering from 1 (two xdist workers, or a previous session's straggler) would
            # give two jobs one port (ids up to 12,000: ports below the ephemeral range, 32768 up).
            f"FirstJobId={random.randrange(1000, 12000)}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job waits before it may start again.
            f"AuthInfo=socket={f / 'run' / 'munge.socket'},cred_expire=5",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool' / '%n'}",
            f"SlurmctldPidFile={f / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'run' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log' / 'slurmd-%n.log'}",
            *node_lines,
            *partitions,
        ]) + "\n")

    def _start_daemons(self) -> None:
        f = self.folder
        # Each daemonizes itself and writes its pid file; the commands return once it is up.
        self.run("munged", f"--socket={f / 'run' / 'munge.socket'}", f"--key-file={f / 'key' / 'munge.key'}",
                 f"--pid-file={f / 'run' / 'munged.pid'}", f"--log-file={f / 'log' / 'munged.log'}",
                 f"--seed-file={f / 'key' / 'munged.seed'}")
        self.run("slurmctld", "-f", str(self.conf))
        for node in self.nodes:
            self.run("slurmd", "-f", str(self.conf), "-N", node)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            shown = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in shown.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(node) == "idle" for node in self.nodes):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the SLURM nodes did not become idle in {START_TIMEOUT_S:.0f} s (sinfo: {states}); "
                           f"logs in {self.folder / 'log'}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        tails = []
        for log in sorted((self.folder / "log").glob("*.log")):
            tails.append(f"== {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(tails)

    # -- stop ----------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel the cluster's jobs, then end the daemons started here (by their pid files)."""
        if (self.folder / "run" / "slurmctld.pid").exists():
            self.run("scancel", "--user", str(os.geteuid()), check=False)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                queued = self.run("squeue", "-h", "-o", "%i", check=False)
                if queued.returncode != 0 or not queued.stdout.strip():
                    break
                time.sleep(0.2)
        run = self.folder / "run"
        pid_files = [run / f"slurmd-{node}.pid" for node in self.nodes] + [run / "slurmctld.pid", run / "munged.pid"]
        for pid_file in pid_files:
            stop_daemon(pid_file)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def stop_daemon(pid_file: Path, timeout_s: float = 15.0) -> None:
    """SIGTERM the daemon whose pid the file holds (if that process is still the daemon), wait, SIGKILL."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    daemon = pid_file.name.split("-")[0].split(".")[0]  # slurmd-<node>.pid, slurmctld.pid, munged.pid
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return  # ended already
    if not Path(command).name.startswith(daemon):
        return  # the pid was reused by another process
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
            break  # ended; its parent (init) reaps it
        time.sleep(0.05)
    else:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if argv[:1] == ["start"]:
        reason = unavailable()
        if reason:
            print(reason, file=sys.stderr)
            return 1
        cluster = SlurmCluster.start(Path(argv[1]) if len(argv) > 1 else None)
        print(f"SLURM cluster in {cluster.folder} (nodes {', '.join(cluster.nodes)})\nexport SLURM_CONF={cluster.conf}")
        return 0
    if argv[:1] == ["stop"] and len(argv) == 2:
        folder = Path(argv[1])
        nodes = tuple(p.name for p in (folder / "spool").iterdir()) if (folder / "spool").is_dir() else ()
        SlurmCluster(folder, nodes).stop()
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
