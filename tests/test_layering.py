"""The package's imports follow docs/ARCHITECTURE.md's layering (module-level and function-level imports).

docs/ARCHITECTURE.md's picture, bottom up: ``checkpoint`` -> ``models`` -> ``export`` -> ``engine`` ->
``bundle`` -> ``runtime`` -> ``serve``, with ``ops`` under ``models`` (and under
``checkpoint``'s RoPE config) and "no module imports from a layer below it in the picture"
(the runtime never imports export; models never import runtime). The runtime reads bundles
(:mod:`edgebuild.bundle.manifest`) but never builds them, so it may not import ``export``,
``engine`` (but for the plugin-library facts of :mod:`edgebuild.engine.plugin_library`) or
``bundle.build``. :data:`DEPENDS` writes that picture as data: each unit and the units it may
import directly; what those may import is allowed too (transitive closure). A module belongs
to the unit of its longest matching prefix in :data:`UNITS`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module prefix -> unit (longest prefix wins)
UNITS = {
    "edgebuild": "root",  # the package itself: __version__
    "edgebuild.errors": "errors",
    "edgebuild.ops": "ops",
    "edgebuild.checkpoint": "checkpoint",
    "edgebuild.models": "models",
    "edgebuild.speculative": "speculative",
    "edgebuild.recipe": "recipe",
    "edgebuild.quantize": "quantize",
    "edgebuild.export": "export",
    "edgebuild.engine": "engine",
    "edgebuild.engine.plugin_library": "plugin_library",
    "edgebuild.bundle": "bundle",
    "edgebuild.bundle.manifest": "manifest",
    "edgebuild.runtime": "runtime",
    "edgebuild.serve": "serve",
    "edgebuild.doctor": "doctor",
    "edgebuild.inspect": "app",
    "edgebuild.example": "app",
    "edgebuild.cli": "app",
    "edgebuild.cli_options": "app",  # options shared by the two entry points
    "edgebuild.deploy": "app",
    "edgebuild.serve.cli": "app",  # the entry point composes serve, bundle and runtime
    "edgebuild.serve.__main__": "app",
    "edgebuild.__main__": "app",  # python -m edgebuild = the edgebuild command
}

# unit -> units it may import directly (docs/ARCHITECTURE.md, the flow).
DEPENDS: dict[str, tuple[str, ...]] = {
    "root": (),
    "errors": (),
    "ops": ("errors",),  # custom ops: CPU reference + ONNX translation
    "checkpoint": ("ops",),  # weight sources, quant formats, pairing (RoPE config from ops)
    "models": ("checkpoint",),
    "speculative": ("checkpoint",),  # neutral: speculative config + method registry
    "recipe": ("speculative",),  # what to build (speculative section checked by the registry)
    "quantize": ("checkpoint",),
    "export": ("models", "root"),
    "plugin_library": ("errors",),  # plugin-library facts shared by engine, runtime, doctor
    "engine": ("export", "recipe", "plugin_library"),
    "manifest": ("errors",),  # bundle format: what the runtime reads
    "bundle": ("engine", "manifest", "quantize"),
    "runtime": ("models", "recipe", "manifest", "plugin_library"),  # never export / engine
    "serve": ("runtime",),
    "doctor": ("runtime", "plugin_library"),
    "app": ("serve", "bundle", "doctor"),  # CLI, inspect, example: everything
}


def unit_of(module: str, units: dict[str, str]) -> str | None:
    """The unit of dotted ``module`` (longest prefix in ``units``), None outside the package."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        unit = units.get(".".join(parts[:n]))
        if unit is not None:
            return unit
    return None


def allowed(depends: dict[str, tuple[str, ...]]) -> dict[str, set[str]]:
    """{unit: every unit it may import}: itself, the root and the transitive closure."""
    out: dict[str, set[str]] = {}

    def reach(unit: str) -> set[str]:
        if unit not in out:
            out[unit] = {unit, "root"}
            for dep in depends[unit]:
                out[unit] |= reach(dep)
        return out[unit]

    for unit in depends:
        reach(unit)
    return out


def module_name(path: Path, src_root: Path) -> str:
    rel = path.relative_to(src_root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth (functions too).

    ``from a.b import c`` counts as an import of ``a.b.c`` (a submodule, or a name of ``a.b``:
    :func:`unit_of` maps both to the right unit); relative imports are resolved.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")
                pkg = pkg if is_pkg else pkg[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            out += [
                (f"{base}.{a.name}" if a.name != "*" else base, node.lineno) for a in node.names
            ]
    return out


def violations(
    src_root: Path, package: str, units: dict[str, str], depends: dict[str, tuple[str, ...]]
) -> list[str]:
    """Every import in ``src_root/package`` that leaves its unit's allowed set, as messages."""
    ok = allowed(depends)
    found: dict[tuple[Path, int, str], str] = {}
    for path in sorted((src_root / package).rglob("*.py")):
        module = module_name(path, src_root)
        here = unit_of(module, units)
        assert here is not None, f"{module} has no unit in UNITS; add it"
        for target, line in imports_of(path, module):
            there = unit_of(target, units)
            if there is None or there in ok[here]:
                continue
            rel = path.relative_to(src_root)
            shown = (
                target.rpartition(".")[0]
                if unit_of(target.rpartition(".")[0], units) == there
                else target
            )
            found.setdefault((rel, line, there), f"{rel}:{line}: {here} imports {shown} ({there})")
    return list(found.values())


def test_every_import_follows_the_layering_of_design_md():
    found = violations(ROOT, "edgebuild", UNITS, DEPENDS)
    assert not found, "imports against docs/ARCHITECTURE.md's layering:\n" + "\n".join(found)


def test_every_unit_of_the_rules_is_known():
    assert set(UNITS.values()) == set(DEPENDS)
    for deps in DEPENDS.values():
        assert set(deps) <= set(DEPENDS)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_check_catches_an_upward_import(tmp_path):
    units = {"pkg": "root", "pkg.low": "low", "pkg.high": "high", "pkg.side": "side"}
    depends = {"root": (), "low": (), "high": ("low",), "side": ("low",)}
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/config.py": "def f():\n    from pkg.high.run import x\n",  # upward, in a def
            "high/__init__.py": "",
            "high/run.py": "from pkg.low.config import f\nx = 1\n",  # downward: fine
            "side/__init__.py": "",
            "side/other.py": "from ..high import run\n",  # relative, into a sibling
        },
    )
    found = violations(src, "pkg", units, depends)
    assert len(found) == 2
    assert found[0].startswith("pkg/low/config.py:2: low imports pkg.high.run (high)")
    assert "side imports pkg.high" in found[1]


def test_the_check_passes_a_tree_without_upward_imports(tmp_path):
    units = {"pkg": "root", "pkg.low": "low", "pkg.high": "high"}
    depends = {"root": (), "low": (), "high": ("low",)}
    src = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "low.py": "import os\n",
            "high.py": "import pkg.low\nfrom pkg import low\n",
        },
    )
    assert violations(src, "pkg", units, depends) == []
