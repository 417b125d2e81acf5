"""The repository's top-level names must not hide installed packages.

The repository root is the ``omnirt`` package, so where the root is on ``sys.path`` (pytest puts it
there for ``tests``; ``python -m`` from the root; the benchmarks that import ``tests.server``) its
subpackages are importable under their bare names too, ahead of site-packages, and so are the
benchmark scripts' modules from their own directory. A dependency that imports a package of the
same name then gets ours: transformers 5.25 requires Hugging Face's ``kernels`` and imports it at
start, which our ``kernels/`` hid, and every test failed to collect (CI of 2026-12-03). This says
which name hides which distribution, before anything else fails in a way that hides the cause.
"""

from __future__ import annotations

from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _top_level_names() -> set[str]:
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    return names


def test_no_top_level_name_hides_an_installed_distribution() -> None:
    installed = packages_distributions()
    hidden = {
        name: sorted(set(installed[name]) - {"omnirt"})
        for name in sorted(_top_level_names())
        if set(installed.get(name, ())) - {"omnirt"}
    }
    assert "kernels" in _top_level_names() and "stages" in _top_level_names()
    assert not hidden, (
        f"these names of the repository would be imported in place of installed packages: {hidden}; "
        "pin the dependency that brings them in (pyproject.toml) or rename ours"
    )
