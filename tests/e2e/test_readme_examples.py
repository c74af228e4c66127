"""The commands of the README and of the documents it sends a newcomer to first (operations,
configuration), parsed from them and run, so a document breaks the build when it drifts from
the code.

- ``make run CONFIG=FILE`` in the README: FILE exists, ``make`` passes it to ``epp dev
  --config``, and the stack below is built from it as ``epp dev`` builds its own.
- Every ``curl`` in a ``sh`` block runs (through bash, pipes included) against a local stack
  like ``make run CONFIG=FILE``'s (Envoy, one epp, three simulated replicas), with
  ``localhost:8080`` (Envoy) and ``localhost:9090`` (epp's metrics port) mapped to the stack's
  ports. A ``curl -i`` must answer the status its comment names (``# 404, ...``) or 200, and
  carry any header the comment names (``# x-served-by: ...``); a pipeline (``| grep ...``)
  must succeed.
- Every ``epp ...`` command names a subcommand and flags ``epp SUB --help`` knows;
  ``epp envoy-config`` runs for real, in each mode the documents list, on the configuration
  reference (the ``yaml`` block of docs/configuration.md), which must therefore load.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from epp.devstack import Stack, dev_overrides

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The README's commands, then those of the documents it links for running and configuring.
DOCUMENTS = [README, ROOT / "docs" / "operations.md"]
CONFIGURATION = ROOT / "docs" / "configuration.md"
EPP = [sys.executable, "-m", "epp"]
# A comment after a command: whitespace, '#', a space.
COMMENT = re.compile(r"\s+#\s(.*)$")


def _blocks(language: str, documents: list[Path] = DOCUMENTS) -> Iterator[str]:
    for document in documents:
        yield from re.findall(rf"```{language}\n(.*?)```", document.read_text(), re.S)


def _commands(program: str, documents: list[Path] = DOCUMENTS) -> list[tuple[str, str]]:
    """(command, comment) for each logical line of a ``sh`` block that runs ``program``."""
    found = []
    for block in _blocks("sh", documents):
        for line in block.replace("\\\n", " ").splitlines():
            line = " ".join(line.split())
            if not line.startswith(program + " "):
                continue
            match = COMMENT.search(line)
            found.append((line[: match.start()] if match else line, match[1] if match else ""))
    return found


CURLS = _commands("curl")
EPP_COMMANDS = _commands("epp")
MAKE_RUNS = _commands("make", [README])


def _run_config() -> Path:
    """The file the README's ``make run CONFIG=FILE`` names (its explain example needs it)."""
    configs = [
        m[1] for c, _ in MAKE_RUNS if (m := re.fullmatch(r"make run CONFIG=(\S+)", c)) is not None
    ]
    assert len(configs) == 1, MAKE_RUNS
    return ROOT / configs[0]


def test_the_readme_still_has_examples_to_run() -> None:
    assert len(_commands("curl", [README])) >= 5
    assert {"make run", "make test"} <= {c for c, _ in MAKE_RUNS}
    assert {c.split()[1] for c, _ in EPP_COMMANDS} >= {"serve", "envoy-config", "sim", "dev"}


def test_make_run_passes_its_config_to_epp_dev() -> None:
    config = _run_config()
    assert config.is_file(), config
    relative = config.relative_to(ROOT).as_posix()
    run = subprocess.run(
        ["make", "-n", "run", f"CONFIG={relative}"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    (dev,) = [line for line in run.stdout.splitlines() if " -m epp dev" in line]
    assert dev.split()[-2:] == ["--config", relative], dev
    # Without CONFIG, make run is a plain epp dev.
    plain = subprocess.run(
        ["make", "-n", "run"], capture_output=True, text=True, timeout=30, cwd=ROOT
    )
    (dev,) = [line for line in plain.stdout.splitlines() if " -m epp dev" in line]
    assert dev.split()[-3:] == ["-m", "epp", "dev"], dev


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Built from the README's make run CONFIG=FILE as epp dev builds its own: the explain
    # examples need routing.explain, and the others must work with it too.
    overrides = dev_overrides(_run_config())
    assert overrides.get("routing", {}).get("explain") is True, overrides
    with Stack(tmp_path_factory.mktemp("readme"), config_extra=overrides) as s:
        s.start()
        yield s


def _local(command: str, stack: Stack) -> str:
    ports = {"8080": str(stack.envoy_port), "9090": str(stack.epp_ports[0][2])}

    def port(match: re.Match[str]) -> str:
        assert match[1] in ports, f"README uses localhost:{match[1]}, which no example stack has"
        return f"127.0.0.1:{ports[match[1]]}"

    return re.sub(r"localhost:(\d+)", port, command)


@pytest.mark.parametrize(("command", "comment"), CURLS, ids=[c for c, _ in CURLS])
def test_readme_curl(stack: Stack, command: str, comment: str) -> None:
    run = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {_local(command, stack)}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, (command, run.stdout, run.stderr)
    assert run.stdout.strip(), command
    if "|" in command:  # the pipeline's own test (grep) decided
        return
    if any(re.fullmatch(r"-[a-zA-Z]*i[a-zA-Z]*", a) for a in shlex.split(command)):
        status = int(run.stdout.split()[1])
        named = re.search(r"\b([1-5]\d\d)\b", comment)
        assert status == (int(named[1]) if named else 200), run.stdout
        if status >= 400:
            assert '"error"' in run.stdout.split("\r\n\r\n", 1)[-1], run.stdout
        for header in re.findall(r"\b(x-[a-z-]+):", comment):
            assert f"\n{header}:" in run.stdout.lower(), (header, run.stdout)


def _flags(command: str) -> tuple[str, list[str]]:
    words = command.split()
    return words[1], [
        w.strip("[]").split("=")[0] for w in words[2:] if w.strip("[").startswith("--")
    ]


@pytest.mark.parametrize(("command", "comment"), EPP_COMMANDS, ids=[c for c, _ in EPP_COMMANDS])
def test_readme_epp_command_flags_exist(command: str, comment: str) -> None:
    sub, flags = _flags(command)
    run = subprocess.run([*EPP, sub, "--help"], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    for flag in flags:
        assert re.search(rf"(^|\s|,){re.escape(flag)}\b", run.stdout), (flag, run.stdout)


def test_readme_envoy_config_renders_the_readme_configuration(tmp_path: Path) -> None:
    (reference,) = list(_blocks("yaml", [CONFIGURATION]))
    config = tmp_path / "epp.yaml"
    config.write_text(reference)
    (command,) = [c for c, _ in EPP_COMMANDS if c.split()[1] == "envoy-config"]
    modes = re.search(r"--mode (\S+)", command)
    assert modes is not None
    for mode in modes[1].split("|"):
        # Optional [--flag VALUE] parts are given: the README's configuration has a
        # Kubernetes pool, whose EDS file needs the directory.
        args = shlex.split(command.split(">")[0].replace("[", "").replace("]", ""))[1:]
        args = [
            config.as_posix()
            if a == "epp.yaml"
            else mode
            if a == modes[1]
            else (tmp_path / "eds").as_posix()
            if a == "DIR"
            else "2"
            if a == "N"
            else a
            for a in args
        ]
        run = subprocess.run(
            [*EPP, *args], capture_output=True, text=True, timeout=60, cwd=README.parent
        )
        assert run.returncode == 0, (mode, run.stderr)
        boot = yaml.safe_load(run.stdout)
        assert boot["static_resources"]["listeners"], mode
