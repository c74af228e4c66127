"""No module in epp/ over 600 lines, no function over 80, none over 60 on the request path.

A module past that size holds more than one responsibility, and a function past that length
more than one step; both are where changes collide and reviews miss things. The request path
(what runs between a request's headers and its answer) is held to less because every feature
passes through it. Generated gRPC code (epp/_proto) is not ours to size.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EPP = ROOT / "epp"
IGNORED = {"_proto"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

MAX_REQUEST_PATH_LINES = 60
# The packages and modules a request runs through before it is answered.
REQUEST_PATH = (
    "epp/extproc/",
    "epp/router.py",
    "epp/request/",
    "epp/lifecycle.py",
    "epp/generation.py",
    "epp/hooks/request/",
    "epp/admission/",
    "epp/scheduling/",
)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, length in lines) of every function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            end = node.end_lineno or node.lineno
            yield name, node.lineno, end - node.lineno + 1
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def oversized(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Modules over :data:`MAX_MODULE_LINES` and functions over :data:`MAX_FUNCTION_LINES`
    under ``root``: ``path`` -> lines and ``path::qualname`` -> lines, paths relative to
    ``root``'s parent."""
    modules: dict[str, int] = {}
    functions: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        if IGNORED & set(path.relative_to(root).parts):
            continue
        name = path.relative_to(root.parent).as_posix()
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            modules[name] = lines
        for qualname, _, length in _functions(ast.parse(text, str(path))):
            limit = MAX_REQUEST_PATH_LINES if name.startswith(REQUEST_PATH) else MAX_FUNCTION_LINES
            if length > limit:
                functions[f"{name}::{qualname}"] = length
    return modules, functions


def test_no_module_or_function_in_epp_is_oversized() -> None:
    modules, functions = oversized(EPP)
    problems = [
        f"{name}: {lines} lines (limit {MAX_MODULE_LINES}): split it along its responsibilities"
        for name, lines in modules.items()
    ]
    problems += [
        f"{name}: {lines} lines (limit {MAX_FUNCTION_LINES}, {MAX_REQUEST_PATH_LINES} on the "
        "request path): split it into steps"
        for name, lines in functions.items()
    ]
    assert not problems, "\n".join(["", *problems])


def test_the_walk_finds_long_modules_and_functions(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "_proto").mkdir(parents=True)
    (root / "_proto" / "generated.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    body = "".join(f"        x = {i}\n" for i in range(MAX_FUNCTION_LINES - 2))
    (root / "small.py").write_text(
        f"class A:\n    def fits(self) -> None:\n{body}\n"
        f"    async def long(self) -> None:\n{body}"
        "        def inner() -> None:\n            pass\n"
    )
    (root / "big.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    modules, functions = oversized(root)
    assert modules == {"pkg/big.py": MAX_MODULE_LINES + 1}
    assert functions == {"pkg/small.py::A.long": MAX_FUNCTION_LINES + 1}


def test_the_request_path_is_held_to_the_lower_limit(tmp_path: Path) -> None:
    root = tmp_path / "epp"
    (root / "extproc").mkdir(parents=True)
    body = "".join(f"    x = {i}\n" for i in range(MAX_REQUEST_PATH_LINES))
    source = f"def step() -> None:\n{body}"
    (root / "extproc" / "stream.py").write_text(source)
    (root / "discovery.py").write_text(source)
    _, functions = oversized(root)
    assert functions == {"epp/extproc/stream.py::step": MAX_REQUEST_PATH_LINES + 1}
