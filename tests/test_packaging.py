"""What a wheel of the package holds: pyproject.toml lists every package folder of rwkvx/ (the oracle is
rwkvx.oracle, from oracle/) and ships every kernel family's CUDA sources; a folder left out would be
missing from a non-editable install, where the editable install the tests run under still finds it."""
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
ROOT = Path(__file__).resolve().parent.parent


def setuptools_config() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "rwkvx").rglob("__init__.py")}
    listed = set(setuptools_config()["packages"])
    assert folders | {"rwkvx.oracle"} == listed, (folders | {"rwkvx.oracle"}) ^ listed


def test_every_kernel_family_ships_its_sources():
    data = setuptools_config()["package-data"]
    for family in (ROOT / "rwkvx" / "cu").iterdir():
        if any(family.glob("*.cu")):
            package = f"rwkvx.cu.{family.name}"
            assert "*.cu" in data.get(package, []), f"{package}: its .cu files are not package data"
