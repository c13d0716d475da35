"""The oracle's layout: one twin module per GPU kernel family, named after it; Cython only where loops run;
every plain-Python module loaded from its source, not from a compiled module left over from an older build."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import rwkvx
import rwkvx.oracle

ORACLE = Path(rwkvx.oracle.__file__).parent
FAMILIES = sorted(p.parent.name for p in (Path(rwkvx.__file__).parent / "cu").glob("*/ops.py"))
PYX = sorted(ORACLE.glob("*.pyx"))
PY = sorted(p for p in ORACLE.glob("*.py") if p.name != "__init__.py")


def test_families_found():
    assert {"adamw", "layernorm", "timemix", "wkv7"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_family_has_its_twin_module(family):
    sources = [ORACLE / f"{family}.py", ORACLE / f"{family}.pyx"]
    assert sum(p.exists() for p in sources) == 1, f"rwkvx.oracle.{family}: expected one of {sources}"


@pytest.mark.parametrize("path", PYX, ids=lambda p: p.name)
def test_cython_modules_have_typed_loops(path):
    """A .pyx without C-typed code compiles for nothing: it belongs in a .py file."""
    text = path.read_text(encoding="utf-8")
    assert "cdef " in text and "double[" in text, f"{path.name} has no typed code"


@pytest.mark.parametrize("path", PY, ids=lambda p: p.name)
def test_python_modules_are_loaded_from_source(path):
    module = importlib.import_module(f"rwkvx.oracle.{path.stem}")
    assert Path(module.__file__).suffix == ".py", (
        f"{module.__name__} is loaded from {module.__file__}: a stale compiled module shadows {path.name}")
