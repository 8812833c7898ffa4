"""No function in ``edgebuild/`` is longer than 80 lines (STYLE.md habit 12: no god functions).

A function's length is the span of its ``def`` (``end_lineno - lineno + 1``: signature,
docstring, body, nested functions included; decorators not).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 80

# (file, function) pairs over the limit that may not be split yet, each a named to-do (none now).
ALLOWED_LONG: frozenset[tuple[str, str]] = frozenset({})


def long_functions(src_root: Path, package: str, max_lines: int = MAX_LINES) -> list[str]:
    """``"file:line name (N lines)"`` for every function of ``package`` over ``max_lines``."""
    found = []
    for path in sorted((src_root / package).rglob("*.py")):
        rel = path.relative_to(src_root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), rel)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > max_lines:
                    found.append((rel, node.name, f"{rel}:{node.lineno} {node.name} ({n} lines)"))
    return [msg for rel, name, msg in found if (rel, name) not in ALLOWED_LONG]


def test_no_function_is_longer_than_80_lines():
    found = long_functions(ROOT, "edgebuild")
    assert not found, f"functions over {MAX_LINES} lines (split them):\n" + "\n".join(found)


def test_the_allow_list_names_only_functions_that_are_still_long():
    still_long = set()
    for rel, name in ALLOWED_LONG:
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
                if node.end_lineno - node.lineno + 1 > MAX_LINES:
                    still_long.add((rel, name))
    assert still_long == set(ALLOWED_LONG), "remove split functions from ALLOWED_LONG"


def test_the_check_catches_a_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))  # def + 80 lines = 81
    nested = "".join(f"    {line}\n" for line in body.splitlines())  # as a method's body
    (pkg / "mod.py").write_text(
        f"def short():\n    return 1\n\n\nclass C:\n    async def long(self):\n{nested}"
    )
    assert long_functions(tmp_path, "pkg") == ["pkg/mod.py:6 long (81 lines)"]
    (pkg / "mod.py").write_text(f"def exactly_80():\n{body[: body.rindex('    x79')]}")
    assert long_functions(tmp_path, "pkg") == []
