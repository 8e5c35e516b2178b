"""The wheel built from this checkout: the package with its PEP 561 marker, nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_package_and_its_type_marker(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("bigbatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "bigbatch/py.typed" in names
    assert "bigbatch/gradcache/engine.py" in names and "bigbatch/backends/triton_softmax.py" in names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "experiments/"))]
