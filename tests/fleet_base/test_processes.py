"""`fleet_base.processes` against real child processes (Python interpreters with chosen
SIGTERM handlers), and the package's promise to import only the standard library."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from fleet_base.processes import stop_process, stop_processes
from tests.polling import wait_for

PACKAGE = Path(__file__).resolve().parents[2] / "fleet_base"

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)"
EXITS_3_ON_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))"


def child(setup: str, *, extra: str = "", new_session: bool = False) -> subprocess.Popen[str]:
    """A Python child that runs `setup` (its SIGTERM handler), says it is ready, runs
    `extra` and sleeps; returned once ready, so the handler is in place before any signal."""
    code = f"{setup}\nprint('ready', flush=True)\n{extra}\ntime.sleep(120)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=new_session
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_child_that_ignores_sigterm_is_killed_and_reaped() -> None:
    proc = child(IGNORES_TERM)
    assert stop_process(proc, 0.5) == -signal.SIGKILL
    assert proc.returncode == -signal.SIGKILL  # reaped: waitpid gave Popen its status, no zombie


def test_a_child_that_exits_on_sigterm_is_not_killed() -> None:
    proc = child(EXITS_3_ON_TERM)
    assert stop_process(proc, 30) == 3


def test_an_exited_child_is_only_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    wait_for(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 30, "the child to exit")
    assert stop_process(proc, 0.5) == 7


def test_group_mode_kills_what_the_child_started() -> None:
    spawn = "import subprocess; g = subprocess.Popen(['sleep', '120']); print(g.pid, flush=True)"
    proc = child(IGNORES_TERM, extra=spawn, new_session=True)
    assert proc.stdout is not None
    grandchild = psutil.Process(int(proc.stdout.readline()))
    assert stop_process(proc, 0.5, group=True) == -signal.SIGKILL
    # sleep takes the default SIGTERM action; reparented to init, which reaps it
    wait_for(
        lambda: not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE,
        30,
        "sleep",
        retry_errors=True,
    )


def test_several_children_each_get_their_own_end() -> None:
    procs = [child(IGNORES_TERM), child(EXITS_3_ON_TERM)]
    assert stop_processes(procs, 0.5) == [-signal.SIGKILL, 3]


def test_fleet_base_imports_nothing_of_ours_and_no_torch() -> None:
    """The ground floor: every layer imports it, so it may import no layer and nothing heavy."""
    ours = {"kernels", "engine", "agent", "control_plane", "bench", "tests"}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in ours | {"torch", "triton"}, f"{path.name} imports {name}"
