"""Ctrl-C and preemption with real signals on real processes: the first SIGINT/SIGTERM/SIGUSR1 finishes
the step, saves a complete checkpoint (also with periodic checkpoints off), says how to resume and exits
130/143/138; resuming continues exactly (1 process, and 2 processes where only the launcher is
signalled, as Kubernetes does, or every process of the job, as SLURM does)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.distributed.checkpoint.store import FAULT_ENV, HOLD_MESSAGE, complete_checkpoints
from tests.conftest import run_app

# Runs that would not end by themselves (max_steps far away; a constant rate, so the schedule does not
# depend on max_steps), logging every step so the test sees training under way.
ENDLESS = ("trainer.max_epochs=-1", "trainer.max_steps=1000000", "scheduler=constant", "trainer.log_every_n_steps=1",
           "logging.trackers=[]", "logging.progress_bar=false", "logging.print_config=false",
           "early_stopping.patience=null", "checkpoint.export=last")


def process_table() -> dict[int, list[str]]:
    """Every process's ``/proc/<pid>/stat`` fields after its name: state, parent, process group, ..."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            table[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
    return table


def workers_of(launcher: int) -> list[int]:
    """The worker processes of ``python -m app hardware=multi_cpu``: the children of its fork server."""
    parents = {pid: int(fields[1]) for pid, fields in process_table().items()}
    children = [pid for pid, parent in parents.items() if parent == launcher]
    return sorted(pid for pid, parent in parents.items() if parent in children)


# Periodic checkpoints off: only the signal saves.
NO_PERIODIC = ("checkpoint.every_n_steps=null", "checkpoint.every_epoch=false")


def interrupt_once_training(run_dir: Path, sig: int, *args: str, one_worker: bool = False, group: bool = False,
                            ) -> subprocess.CompletedProcess[str]:
    """Start a run, let it train a few steps, then send ``sig`` to it (or to one of its workers only, or
    to every process of the job: its own session's process group)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "app", *ENDLESS, *args, f"hydra.run.dir={run_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=group)
    wait_for_training(proc, run_dir)
    if group:
        os.killpg(proc.pid, sig)
    elif one_worker:
        workers = workers_of(proc.pid)
        if len(workers) != 2:
            proc.kill()
            raise AssertionError(f"expected 2 workers under the launcher, found {workers}")
        os.kill(workers[-1], sig)
    else:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for_training(proc: subprocess.Popen[str], run_dir: Path, steps: int = 3) -> None:
    """Until the run has logged ``steps`` more training losses (or ended, or two minutes passed)."""
    metrics = run_dir / "metrics.jsonl"
    logged_before = metrics.read_text().count("train/loss") if metrics.exists() else 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("train/loss") >= logged_before + steps:
            return
        time.sleep(0.05)


def interrupted_step(proc: subprocess.CompletedProcess[str], run_dir: Path) -> int:
    found = re.search(rf"interrupted \((SIGINT|SIGTERM|SIGUSR1)\) at step (\d+); resume with: python -m app "
                      rf"resume={re.escape(str(run_dir))}", proc.stdout + proc.stderr)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    step = int(found.group(2))
    newest = complete_checkpoints(run_dir / "checkpoints")[-1][1]
    assert newest.step == step
    assert not (run_dir / "model").exists()  # an interrupted run exports nothing
    return step


@pytest.mark.signals
@pytest.mark.timeout(420)  # five runs; under heavy load each can take a minute
def test_sigint_sigterm_and_sigusr1_save_exit_130_143_138_and_resume_exactly(tmp_path):
    run = tmp_path / "run"
    proc = interrupt_once_training(run, signal.SIGINT)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    first = interrupted_step(proc, run)

    # Periodic checkpoints off: the signal's own checkpoint is what the printed resume continues.
    proc = interrupt_once_training(run, signal.SIGTERM, f"resume={run}", *NO_PERIODIC)
    assert proc.returncode == 143, proc.stderr[-3000:]
    second = interrupted_step(proc, run)
    assert second > first

    # SIGUSR1: what SLURM sends before a time limit (--signal=USR1@<s>) and with scancel --signal=USR1.
    proc = interrupt_once_training(run, signal.SIGUSR1, f"resume={run}", *NO_PERIODIC)
    assert proc.returncode == 138, proc.stderr[-3000:]
    assert "SIGUSR1: stopping after the current step and saving a checkpoint" in proc.stderr
    third = interrupted_step(proc, run)
    assert third > second

    # Resumed to a few steps more, it ends where an uninterrupted run ends, bit for bit.
    target = third + 3
    run_app(f"resume={run}", f"trainer.max_steps={target}", cwd=tmp_path, check=True, timeout=120)
    reference = tmp_path / "reference"
    run_app(*ENDLESS, f"trainer.max_steps={target}", f"hydra.run.dir={reference}", cwd=tmp_path, check=True,
            timeout=120)
    assert (run / "model" / "model.safetensors").read_bytes() == (reference / "model" / "model.safetensors").read_bytes()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert steps == list(range(1, target + 1))  # each step logged once across the three processes


@pytest.mark.slow
@pytest.mark.signals
@pytest.mark.multiprocess
@pytest.mark.timeout(420)  # five runs; under heavy load each can take a minute
def test_a_signal_to_the_launcher_one_rank_or_all_stops_both_at_one_step_and_resumes_exactly(tmp_path):
    two = ("hardware=multi_cpu", "hardware.num_processes=2")
    run = tmp_path / "run"
    proc = interrupt_once_training(run, signal.SIGTERM, *two, *NO_PERIODIC)
    assert proc.returncode == 143, proc.stderr[-3000:]
    first = interrupted_step(proc, run)
    assert complete_checkpoints(run / "checkpoints")[-1][1].world_size == 2

    # Ctrl-C reaching one worker only (not the launcher, not the other rank): both stop at one step.
    proc = interrupt_once_training(run, signal.SIGINT, *two, f"resume={run}", one_worker=True)
    assert proc.returncode == 130, proc.stderr[-3000:]
    second = interrupted_step(proc, run)
    assert second > first and complete_checkpoints(run / "checkpoints")[-1][1].world_size == 2

    # SIGUSR1 to every process of the job, as SLURM signals a job's processes (the fork server too).
    proc = interrupt_once_training(run, signal.SIGUSR1, *two, f"resume={run}", *NO_PERIODIC, group=True)
    assert proc.returncode == 138, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    step = interrupted_step(proc, run)
    assert step > second and complete_checkpoints(run / "checkpoints")[-1][1].world_size == 2

    target = step + 3
    run_app(f"resume={run}", f"trainer.max_steps={target}", cwd=tmp_path, check=True, timeout=120)
    reference = tmp_path / "reference"
    run_app(*ENDLESS, *two, f"trainer.max_steps={target}", f"hydra.run.dir={reference}", cwd=tmp_path, check=True,
            timeout=120)
    assert (run / "model" / "model.safetensors").read_bytes() == (reference / "model" / "model.safetensors").read_bytes()


def start_app(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    # Its own session, so that a signal can reach every process of the job, as a terminal's Ctrl-C does.
    return subprocess.Popen([sys.executable, "-m", "app", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_a_second_ctrl_c_during_the_checkpoint_exits_at_once_and_leaves_only_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    # One checkpoint every 2 steps; the second save (the interrupt's, or the periodic one it lands in)
    # is held halfway for ever (APP_CHECKPOINT_FAULT=hold:1): the second Ctrl-C surely comes during a
    # write, however loaded the machine, and the first save is its complete predecessor.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", FAULT_ENV: "hold:1"}
    proc = subprocess.Popen([sys.executable, "-m", "app", *ENDLESS, "checkpoint.every_n_steps=2",
                             "checkpoint.total_limit=2", f"hydra.run.dir={run}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not complete_checkpoints(checkpoints) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    before = {path.name for path, _ in complete_checkpoints(checkpoints)}
    assert before == {"checkpoint_0"}, before
    # The next save is held halfway (written in the background, it stops training at the save after
    # it, which waits for it); the Ctrl-C then stops the run, whose final save waits for it too.
    said = wait_for_lines(proc.stderr, [HOLD_MESSAGE])
    proc.send_signal(signal.SIGINT)
    said += wait_for_lines(proc.stderr, ["SIGINT: stopping after the current step"])
    writing = list(checkpoints.glob(".tmp-checkpoint_1-*"))
    assert writing, said  # the held write: its temporary folder, half written
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = said + err
    assert proc.returncode == 130, err[-3000:]
    assert "second interrupt: exiting now" in err and "Traceback" not in err
    assert "resume with" not in out + err  # it did not wait for the checkpoint

    # What is on disk: the checkpoint complete before, still complete; the one being written never
    # appears under a final name (its temporary folder is left, and ignored).
    final = {path.name for path in checkpoints.glob("checkpoint_*")}
    assert final == {path.name for path, _ in complete_checkpoints(checkpoints)} == before
    assert not (run / "model").exists()
    newest = complete_checkpoints(checkpoints)[-1][1].step
    run_app(f"resume={run}", f"trainer.max_steps={newest + 1}", cwd=tmp_path, check=True, timeout=120)
    assert complete_checkpoints(checkpoints)[-1][1].step == newest + 1


@pytest.mark.signals
@pytest.mark.timeout(180)
def test_an_interrupt_before_the_first_evaluation_says_there_was_none(tmp_path):
    # Held at step 2 (APP_FAIL_MODE=hold), long before the first evaluation (an epoch: 45 steps), until the
    # Ctrl-C arrives, however loaded the machine.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "APP_FAIL_AT_STEP": "2", "APP_FAIL_MODE": "hold"}
    proc = subprocess.Popen([sys.executable, "-m", "app", *ENDLESS, f"hydra.run.dir={tmp_path / 'run'}"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    said = wait_for_line(proc, "injected hold")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    out = said + out
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "stopped: interrupted by SIGINT at step 2; no evaluation yet (eval/accuracy not measured)" in out, out
    assert "None" not in out + err


def wait_for_lines(stream, texts: list[str]) -> str:
    """Read ``stream`` line by line until each of ``texts`` was seen (or it ends); what was read."""
    seen = ""
    while not all(text in seen for text in texts):
        line = stream.readline()
        if not line:
            break
        seen += line
    return seen


def wait_until_delivered(pid: int, sig: int, deadline: float) -> None:
    """Until ``sig`` sent to the process is no longer pending in the kernel (a thread has taken it)."""
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return  # ended
        pending = int(re.search(r"^ShdPnd:\s*([0-9a-f]+)", status, re.MULTILINE).group(1), 16)
        if not pending & (1 << (sig - 1)):
            return
        time.sleep(0.001)
    raise AssertionError(f"signal {sig} still pending in process {pid}")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def wait_for_line(proc: subprocess.Popen[str], text: str) -> str:
    assert proc.stdout is not None
    seen = ""
    while text not in seen:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    return seen


@pytest.mark.signals
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_signal_during_setup_stops_with_one_sentence_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    run_app(*ENDLESS, "trainer.max_steps=4", "checkpoint.every_n_steps=2", f"hydra.run.dir={run}", cwd=tmp_path,
            check=True, timeout=120)
    before = {name: data for name, data in snapshot(run).items() if name != "app.log"}

    # Resuming it: interrupted once the run folder is named, while torch is still being imported.
    for sig, args in ((signal.SIGINT, ()), (signal.SIGTERM, ("hardware=multi_cpu", "hardware.num_processes=2"))):
        proc = start_app(f"resume={run}", "trainer.max_steps=1000", *args)
        said = wait_for_line(proc, "run folder")
        os.killpg(proc.pid, sig)  # every process of the job, as a terminal or a container stop does
        out, err = proc.communicate(timeout=120)
        out = said + out
        assert proc.returncode == 128 + sig, out[-2000:] + err[-3000:]
        assert f"interrupted ({signal.Signals(sig).name}) before the first training step" in out + err
        assert "Traceback" not in out + err and "error" not in (out + err).lower()
        assert {name: data for name, data in snapshot(run).items() if name != "app.log"} == before


# Two Ctrl-C pressed while the main thread is inside C code: CPython runs the Python handler once for
# both. Made deterministic with threads: the main thread blocks SIGINT and waits on a lock (C code
# that no signal interrupts) while a helper thread, which takes both deliveries, sends them.
TWO_PRESSES_DURING_C_CODE = """
import os, signal, threading
from app.interrupts import StopSignals

with StopSignals() as stop:
    go = threading.Event()
    def press_twice():
        go.wait()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    helper = threading.Thread(target=press_twice)
    helper.start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    go.set()
    helper.join()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for _ in range(1000):  # back in Python: the handler runs here
        pass
print("still running after", stop.received)
"""

# A forked child (a DataLoader worker; a terminal's Ctrl-C reaches it too) must not write its signal
# arrivals into the parent's delivery log: one Ctrl-C to both would read as two in the parent.
FORKED_CHILD = """
import os, signal
from app.interrupts import StopSignals

with StopSignals() as stop:
    pid = os.fork()
    if pid == 0:
        # In the child: no wakeup fd (it would be the parent's pipe); a signal here stays here.
        inherited = signal.set_wakeup_fd(-1)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(0 if inherited == -1 else 3)
    _, status = os.waitpid(pid, 0)
    os.kill(os.getpid(), signal.SIGINT)  # the parent's first Ctrl-C
    for _ in range(1000):
        pass
print("child exit", os.waitstatus_to_exitcode(status), "parent still running after", stop.received)
"""


def run_script(source: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=60, check=False,
                          cwd=Path(__file__).resolve().parents[1])


@pytest.mark.signals
@pytest.mark.timeout(120)
def test_two_ctrl_c_during_one_long_c_call_are_two_and_exit_at_once():
    done = run_script(TWO_PRESSES_DURING_C_CODE)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "SIGINT: stopping after the current step" in done.stderr
    assert done.stderr.rstrip().endswith("second interrupt: exiting now, without a checkpoint")
    assert "still running" not in done.stdout


@pytest.mark.timeout(120)
def test_a_forked_childs_signals_are_not_counted_as_the_parents():
    done = run_script(FORKED_CHILD)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "child exit 0 parent still running after 2" in done.stdout
    assert "second interrupt" not in done.stderr


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_ctrl_c_with_dataloader_workers_is_said_once_and_saves(tmp_path):
    # The terminal's Ctrl-C reaches the DataLoader's worker processes too (forked, with the training
    # loop's handler): they keep serving batches, say nothing, and are not counted as a second press.
    run = tmp_path / "run"
    proc = start_app(*ENDLESS, "trainer.num_workers=2", f"hydra.run.dir={run}")
    wait_for_training(proc, run)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert err.count("SIGINT: stopping after the current step") == 1, err[-3000:]
    assert "second interrupt" not in err and "Traceback" not in out + err
    interrupted_step(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run)


# DataLoader workers hand each tensor of a batch over as a file descriptor (torch's default sharing
# strategy, through multiprocessing's resource sharer: a connection and a handshake per tensor). With
# 64 tensors a batch the main process is nearly always inside such a handshake when the second Ctrl-C
# exits it: before the workers were killed first, their sharer thread printed a ConnectionResetError
# traceback in 19 of 20 tries.
FD_BATCHES = """
import torch
from torch.utils.data import DataLoader, Dataset
from app.interrupts import StopSignals

class ManyTensors(Dataset):
    def __len__(self):
        return 10**9
    def __getitem__(self, i):
        return [torch.zeros(4) for _ in range(64)]

loader = DataLoader(ManyTensors(), batch_size=None, num_workers=2)
with StopSignals():
    for n, batch in enumerate(loader):
        if n == 5:
            print("ready", flush=True)
"""


@pytest.mark.signals
@pytest.mark.timeout(180)
def test_a_second_ctrl_c_while_a_batch_arrives_from_the_workers_prints_no_worker_traceback():
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", FD_BATCHES], cwd=Path(__file__).resolve().parents[1],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=30)
        group = processes_in_group(proc.pid)
        assert len(group) >= 3, group  # the script and its two workers
        deadline = time.monotonic() + 60
        for press in range(2):
            os.killpg(proc.pid, signal.SIGINT)
            if press == 0:
                for pid in group:
                    wait_until_delivered(pid, signal.SIGINT, deadline)
        _, err = proc.communicate(timeout=60)  # until every writer of the pipes (the workers too) is gone
        assert proc.returncode == 130, err[-3000:]
        assert err.rstrip().endswith("second interrupt: exiting now, without a checkpoint"), err[-3000:]
        assert "Traceback" not in err and "Error" not in err, err[-3000:]


def processes_in_group(pgid: int) -> list[int]:
    """The live processes of a process group (a terminal's job): the run and its DataLoader workers."""
    return [pid for pid, fields in process_table().items() if int(fields[2]) == pgid and fields[0] != "Z"]


@pytest.mark.signals
@pytest.mark.timeout(300)
def test_a_second_ctrl_c_with_dataloader_workers_ends_every_process_at_once(tmp_path):
    run = tmp_path / "run"
    # The larger model: the first Ctrl-C's checkpoint (~50 MB) takes a while to write.
    proc = start_app(*ENDLESS, "trainer.num_workers=2", "task.hidden_sizes=[2048,2048]", f"hydra.run.dir={run}")
    wait_for_training(proc, run)
    deadline = time.monotonic() + 60
    group = processes_in_group(proc.pid)
    assert len(group) >= 3, group  # the run and its two workers
    os.killpg(proc.pid, signal.SIGINT)
    for pid in group:
        wait_until_delivered(pid, signal.SIGINT, deadline)
    # The run held still, so that the second press surely comes before its checkpoint is done.
    proc.send_signal(signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGINT)
    proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert err.count("SIGINT: stopping after the current step") == 1, err[-3000:]
    assert "second interrupt: exiting now" in err and "Traceback" not in out + err
    # The workers end with it (their index queue closes with the run; they ignore the signals
    # themselves), not at their next look at their parent (every 5 s in torch).
    until = time.monotonic() + 3
    while processes_in_group(proc.pid) and time.monotonic() < until:
        time.sleep(0.05)
    assert not processes_in_group(proc.pid)
