"""Child processes and the restart policy that keeps them running.

``epp dev`` (:class:`epp.devstack.Stack`) and ``epp serve --workers`` (:mod:`epp.workers`)
supervise their processes the same way, like compose's ``restart: unless-stopped``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# The restart policy of `epp dev`, as compose's `restart: unless-stopped` applies it: the first
# restart after 100 ms, the delay doubling while the process keeps dying (up to 10 s), back to
# 100 ms once a run lasted 10 s.
RESTART_FIRST_DELAY = 0.1
RESTART_MAX_DELAY = 10.0
RESTART_RESET_AFTER = 10.0


@dataclass
class Proc:
    """A child process with its log file; it can be started again with the same command."""

    name: str
    popen: subprocess.Popen[bytes]
    # None: the output goes to this process's own stdout (epp serve --workers).
    log: Path | None
    argv: list[str]
    env: dict[str, str] | None = None
    started: float = field(default_factory=time.monotonic)
    restarts: int = 0
    # Set by stop(): a process stopped on purpose is never restarted ("unless-stopped").
    stopped: bool = False
    # While dead and waiting for its restart: when it is due, and the current backoff.
    restart_due: float | None = None
    restart_delay: float = 0.0

    @classmethod
    def start(
        cls, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None
    ) -> Proc:
        """Start ``argv`` in its own session, output to ``workdir/<name>.log``."""
        log = workdir / f"{name}.log"
        return cls(name, cls._popen(argv, log, env), log, argv, env)

    @classmethod
    def inherit(cls, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Start ``argv`` writing to this process's stdout and stderr."""
        return cls(name, cls._popen(argv, None, env), None, argv, env)

    @staticmethod
    def _popen(
        argv: list[str], log: Path | None, env: dict[str, str] | None
    ) -> subprocess.Popen[bytes]:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if log is None:
            return subprocess.Popen(argv, env=full_env, start_new_session=True)
        # Appended, so a restarted process's log follows the crash it recovers from.
        with open(log, "ab") as out:
            return subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,
            )

    def respawn(self) -> None:
        """Start the same command again (the old process must be gone)."""
        self.popen = self._popen(self.argv, self.log, self.env)
        self.started = time.monotonic()
        self.restarts += 1
        self.restart_due = None

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        if self.log is None:
            return ""
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped = True
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would end it: the supervisor restarts it (unlike stop())."""
        if self.alive():
            self.popen.kill()
            self.popen.wait()


def supervise(
    procs: Iterable[Proc], report: Callable[[str], None], now: float | None = None
) -> None:
    """One round of the restart policy (see RESTART_FIRST_DELAY): report each process found
    dead, with its exit code and log tail, and start it again once its delay has passed."""
    now = time.monotonic() if now is None else now
    for proc in list(procs):
        if proc.stopped or proc.alive():
            continue
        if proc.restart_due is None:
            ran = now - proc.started
            proc.restart_delay = (
                RESTART_FIRST_DELAY
                if ran >= RESTART_RESET_AFTER or not proc.restart_delay
                else min(2 * proc.restart_delay, RESTART_MAX_DELAY)
            )
            proc.restart_due = now + proc.restart_delay
            where = f"; log {proc.log}:\n{proc.tail(5)}" if proc.log is not None else ""
            report(
                f"{proc.name} exited with code {proc.popen.returncode} after {ran:.1f} s; "
                f"restarting it in {proc.restart_delay:.1f} s{where}"
            )
        elif now >= proc.restart_due:
            proc.respawn()
            report(f"{proc.name} restarted (pid {proc.popen.pid}, restart {proc.restarts})")
