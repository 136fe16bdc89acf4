"""The import contracts of pyproject.toml ([tool.importlinter]; docs/architecture.md §2): layers only look down, and
no pass file imports another pass — checked with import-linter's ``lint-imports``.

import-linter finds a package's modules by walking its folder, but ``moeplan.passes``, ``moeplan.cost_models`` and
``moeplan.targets`` live in the repository's top-level ``passes/``, ``cost_models/`` and ``targets/`` (mapped by
pyproject.toml's ``package-dir``). So each check runs on a folder of symbolic links that puts them where the import
system finds them: ``moeplan/<each file>`` and ``moeplan/{passes,cost_models,targets}``.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import moeplan
import moeplan.cost_models
import moeplan.passes
import moeplan.targets

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"
SUBPACKAGES = {"passes": moeplan.passes, "cost_models": moeplan.cost_models, "targets": moeplan.targets}


def link_tree(at: Path, *, patch: tuple[str, str] | None = None) -> Path:
    """``at/moeplan`` as the installed package (links); ``patch`` = (path inside the package, text to append) makes
    that one file a changed copy instead of a link."""
    pkg = at / "moeplan"
    pkg.mkdir(parents=True)
    sources = {p.name: p for p in Path(moeplan.__file__).parent.iterdir() if p.name != "__pycache__"}
    sources |= {name: Path(sub.__file__).parent for name, sub in SUBPACKAGES.items()}
    for name, src in sources.items():
        if patch and patch[0].split("/")[0] == name and "/" in patch[0]:
            (pkg / name).mkdir()
            for p in src.iterdir():
                if p.name != "__pycache__":
                    (pkg / name / p.name).symlink_to(p)
        else:
            (pkg / name).symlink_to(src)
    if patch:
        path = pkg / patch[0]
        text = path.read_text()
        path.unlink()
        path.write_text(text + patch[1])
    return at


def lint(at: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(at)}
    return subprocess.run([str(LINT), str(ROOT / "pyproject.toml")], cwd=at, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_import_contracts_hold(tmp_path):
    res = lint(link_tree(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Contracts: 2 kept, 0 broken." in res.stdout


def test_an_upward_import_breaks_them(tmp_path):
    """A cost model that imports the compile driver, and a pass that imports another pass, are each refused."""
    up = lint(link_tree(tmp_path / "up", patch=("cost_models/comm.py", "\nimport moeplan.compile  # noqa\n")))
    assert up.returncode == 1 and "moeplan.cost_models.comm -> moeplan.compile" in up.stdout, up.stdout
    side = lint(link_tree(tmp_path / "side", patch=("passes/simulate.py", "\nimport moeplan.passes.shard  # noqa\n")))
    assert side.returncode == 1 and "moeplan.passes.simulate -> moeplan.passes.shard" in side.stdout, side.stdout
