"""The package's layers import downwards only: rwkvx.runtime (device, compiler, op records, GEMMs) imports
nothing of rwkvx outside itself, and the kernel families (rwkvx.cu) never import the GPU model built on
them (rwkvx.arena, rwkvx.step, rwkvx.model, rwkvx.decoder). Read from the sources, without importing."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rwkvx

PACKAGE = Path(rwkvx.__file__).parent
MODEL_LAYERS = ("rwkvx.arena", "rwkvx.step", "rwkvx.model", "rwkvx.decoder")


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = ".".join(("rwkvx", *path.relative_to(PACKAGE).parent.parts))
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def sources(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def test_imported_modules_resolves_relative_imports():
    names = imported_modules(PACKAGE / "runtime" / "gemm.py")
    assert "rwkvx.runtime.ops" in names and "rwkvx.runtime.ops.Gemm" in names
    assert "rwkvx.runtime.ops" in imported_modules(PACKAGE / "dist" / "step.py")      # from ..runtime.ops


@pytest.mark.parametrize("path", sources("runtime"), ids=lambda p: p.name)
def test_runtime_imports_nothing_above_it(path):
    above = {n for n in imported_modules(path) if within(n, "rwkvx") and not within(n, "rwkvx.runtime")}
    assert not above, f"{path.name} imports {sorted(above)}"


@pytest.mark.parametrize("path", sources("cu"), ids=lambda p: str(p.relative_to(PACKAGE / "cu")))
def test_kernel_families_do_not_import_the_model(path):
    model = {n for n in imported_modules(path) if any(within(n, layer) for layer in MODEL_LAYERS)}
    assert not model, f"{path} imports {sorted(model)}"
