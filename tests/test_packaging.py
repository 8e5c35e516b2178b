"""The wheel built from this checkout: the package with its PEP 561 marker, nothing else."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_package_and_its_type_marker(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds
    src = tmp_path / "src_copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    dist = tmp_path / "dist"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = dist.glob("bigbatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "bigbatch/py.typed" in names
    assert "bigbatch/gradcache/engine.py" in names and "bigbatch/backends/triton_softmax.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "experiments/"))]
