"""The committed ``epp/_proto/`` must be exactly what ``tools/gen_protos.py`` produces now.

Fails when a ``.proto`` under ``protos/`` was edited without regenerating (``make protos``), when a
generated file was edited by hand, or when a stale generated file was left behind.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
GEN_SCRIPT = REPO / "tools" / "gen_protos.py"
COMMITTED = REPO / "epp" / "_proto"


def _committed_files() -> dict[str, bytes]:
    return {
        p.name: p.read_bytes()
        for p in sorted(COMMITTED.iterdir())
        if p.is_file() and p.suffix in (".py", ".pyi")
    }


def _load_gen_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", GEN_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Run the generator exactly as `make protos` does, into a temporary root."""
    out = tmp_path_factory.mktemp("regen")
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    gen_dir = out / "epp" / "_proto"
    return {p.name: p.read_bytes() for p in sorted(gen_dir.iterdir()) if p.is_file()}


def test_generator_version_matches_committed_code() -> None:
    """A different grpcio-tools produces different bytes; say so clearly instead of a diff."""
    text = (COMMITTED / "ext_proc_pb2_grpc.py").read_text()
    match = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text)
    assert match, "ext_proc_pb2_grpc.py lacks GRPC_GENERATED_VERSION"
    installed = importlib.metadata.version("grpcio-tools")
    assert installed == match.group(1), (
        f"epp/_proto/ was generated with grpcio-tools {match.group(1)}, {installed} is installed: "
        "install that version, or regenerate with `make protos` and commit the result"
    )


def test_same_file_set(regenerated: dict[str, bytes]) -> None:
    committed = _committed_files()
    assert sorted(committed) == sorted(regenerated), "run `make protos` and commit epp/_proto/"
    assert {
        "__init__.py",
        "core_pb2.py",
        "ext_proc_pb2.py",
        "ext_proc_pb2_grpc.py",
        "ext_proc_pb2.pyi",
    } <= set(committed)


def test_committed_files_are_byte_identical(regenerated: dict[str, bytes]) -> None:
    committed = _committed_files()
    stale = sorted(n for n in regenerated if committed.get(n) != regenerated[n])
    assert not stale, f"stale generated files {stale}: run `make protos` and commit epp/_proto/"


def test_check_mode_agrees() -> None:
    result = subprocess.run(
        [sys.executable, str(GEN_SCRIPT), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_detects_an_edited_proto(tmp_path: Path) -> None:
    """The comparison is sensitive: changing one field number changes the generated code."""
    gen = _load_gen_module()
    protos = tmp_path / "protos"
    shutil.copytree(REPO / "protos", protos)
    src = protos / "epp" / "_proto" / "ext_proc.proto"
    text = src.read_text()
    edited = text.replace("bool clear_route_cache = 5;", "bool clear_route_cache = 6;")
    assert edited != text
    src.write_text(edited)
    files = gen.generate_files(protos)
    assert files["ext_proc_pb2.py"] != _committed_files()["ext_proc_pb2.py"]
    assert "ext_proc_pb2.py" in gen.stale_files(files, REPO)


def test_detects_a_leftover_file(tmp_path: Path, regenerated: dict[str, bytes]) -> None:
    gen = _load_gen_module()
    dest = tmp_path / "epp" / "_proto"
    dest.mkdir(parents=True)
    for name, content in regenerated.items():
        (dest / name).write_bytes(content)
    assert gen.stale_files(regenerated, tmp_path) == []
    (dest / "old_pb2.py").write_text("# stale\n")
    assert gen.stale_files(regenerated, tmp_path) == ["old_pb2.py"]
    written, removed = gen.write_files(regenerated, tmp_path)
    assert (written, removed) == ([], ["old_pb2.py"])


def test_generated_imports_use_epp_package() -> None:
    grpc_src = (COMMITTED / "ext_proc_pb2_grpc.py").read_text()
    assert "from epp._proto import ext_proc_pb2 as" in grpc_src
    pb2_src = (COMMITTED / "ext_proc_pb2.py").read_text()
    for dep in ("core_pb2", "http_status_pb2", "processing_mode_pb2"):
        assert f"from epp._proto import {dep} as" in pb2_src
    assert not re.search(r"^\s*(from|import) envoy\b", grpc_src + pb2_src, re.MULTILINE)
