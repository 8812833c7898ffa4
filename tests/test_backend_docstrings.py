"""Every public function and method in ``edgebuild/runtime/backend.py`` has a docstring
(the ``TargetBackend`` / ``DraftBackend`` protocols are what a new backend implements)."""

from __future__ import annotations

import ast
from pathlib import Path

BACKEND = Path(__file__).resolve().parent.parent / "edgebuild" / "runtime" / "backend.py"


def undocumented(path: Path) -> list[str]:
    """``Class.method`` / ``function`` names without a docstring (dunders and ``_`` names
    are not public)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                if not child.name.startswith("_"):
                    if ast.get_docstring(child) is None:
                        out.append(prefix + child.name)
                    visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                public = not child.name.startswith("_")
                if public and ast.get_docstring(child) is None:
                    out.append(prefix + child.name)

    visit(tree)
    return out


def test_every_public_function_of_the_backend_protocols_has_a_docstring():
    assert undocumented(BACKEND) == []


def test_the_check_finds_a_method_without_a_docstring(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        'class P:\n    """P."""\n\n    def a(self):\n        """A."""\n\n'
        "    def b(self): ...\n\n    def __len__(self): ...\n\n\ndef f():\n    pass\n"
    )
    assert undocumented(path) == ["P.b", "f"]
