"""pyproject.toml's package list: every package of the tree, the kernels under their own name."""

import importlib.util
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on


ROOT = Path(__file__).resolve().parents[1]


def test_every_package_of_the_tree_is_listed():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "slora_batch").rglob("__init__.py")
    }
    assert set(setup["packages"]) == tree | {"slora_kernels"}
    assert setup["package-dir"] == {"slora_kernels": "kernels"}


def test_kernels_import_as_slora_kernels_and_leave_the_name_kernels_free():
    # kernels/ must stay a folder without __init__.py: a regular package there would shadow
    # Hugging Face's "kernels" (which transformers imports) whenever the root is on sys.path
    assert not (ROOT / "kernels" / "__init__.py").exists()
    spec = importlib.util.find_spec("slora_kernels.ref")
    assert spec is not None and Path(spec.origin).parent == ROOT / "kernels"
    found = importlib.util.find_spec("kernels")
    assert found is None or Path(found.origin or "").parent != ROOT / "kernels"
