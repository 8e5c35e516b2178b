"""The benchmark scripts' outputs and options (their GPU measurements run on the GPU machines)."""

from __future__ import annotations

import json
import statistics

import pytest

from bigbatch.bench.common import write_json
from bigbatch.bench.memory import main as memory_main
from bigbatch.bench.ring import merge_ranks


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_results_are_standard_json_with_unmeasured_figures_null(tmp_path):
    path = write_json(tmp_path / "r.json", {"rate": float("nan"), "rows": [{"gib": [float("inf"), 1.5]}], "n": 3})
    assert _strict(path.read_text()) == {"n": 3, "rate": None, "rows": [{"gib": [None, 1.5]}]}


def test_a_ring_row_is_its_slowest_rank():
    ranks = [{"status": "ok", "median_ms": 10.0, "times_ms": [9.0, 10.0, 11.0], "extra_gib": 1.0},
             {"status": "ok", "median_ms": 12.0, "times_ms": [12.0, 11.5, 13.0], "extra_gib": 0.5}]
    row = merge_ranks(ranks)
    assert row["median_ms"] == 12.0 and statistics.median(row["times_ms"]) == row["median_ms"]
    assert row["extra_gib"] == 1.0 and [r["median_ms"] for r in row["per_rank"]] == [10.0, 12.0]
    # not every rank completed it: no ring time, the failing rank's status and error
    failed = merge_ranks([ranks[0], {"status": "oom", "error": "CUDA out of memory"}])
    assert failed["status"] == "oom" and failed["error"] == "rank 1: CUDA out of memory"
    assert "median_ms" not in failed and failed["per_rank"][0]["median_ms"] == 10.0


@pytest.mark.parametrize("args, needle", [
    (["--extra", "4096"], "expected BxD cases like 32768x64, got '4096'"),
    (["--batches", "0"], "--batches: expected a positive integer, got '0'"),
    (["--dims", "-3"], "--dims: expected a positive integer, got '-3'"),
    (["--extra", "64x0"], "expected a positive integer, got '0'"),
])
def test_memory_bench_options_are_checked(args, needle, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        memory_main([*args, "--out", str(tmp_path / "m.json")])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_only_the_committed_grid_writes_the_committed_results(tmp_path, monkeypatch, capsys):
    """`clip --tune`, `siglip --batch 8192 65536`, `memory --batches ...` (their docstrings' own
    examples) and `ring --cpu-smoke` on a GPU host wrote over the committed JSON the README's tables
    come from: any run off the committed grid now writes to the temporary directory unless --out says."""
    import argparse

    from bigbatch.bench.common import output_path

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tune", action="store_true")
    p.add_argument("--extra", type=lambda s: [int(x) for x in s.split(",")], default="3,4")  # a typed string default
    p.add_argument("--out", default=None)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert output_path(p, p.parse_args([]), "benchmarks/results/x.json", "x.json", ["batch", "tune", "extra"]) == "benchmarks/results/x.json"
    for argv in (["--batch", "2"], ["--tune"]):
        assert output_path(p, p.parse_args(argv), "benchmarks/results/x.json", "x.json", ["batch", "tune"]) == str(tmp_path / "x.json")
    assert "--batch differs" in capsys.readouterr().out
    assert output_path(p, p.parse_args([]), "benchmarks/results/x.json", "x.json", ["batch"], canonical=False) == str(tmp_path / "x.json")
    assert output_path(p, p.parse_args(["--tune", "--out", "mine.json"]), "c.json", "x.json", ["tune"]) == "mine.json"


@pytest.mark.parametrize("argv", [["--batch", "0"], ["--dim", "-3"], ["--repeat", "0"], ["--batch", "x"]])
def test_siglip_and_ring_refuse_non_positive_sizes(argv, monkeypatch):
    """They crashed after the process group started (ZeroDivisionError, StatisticsError, SIGABRT)."""
    from bigbatch.bench import ring, siglip

    with pytest.raises(SystemExit) as exc:
        siglip.main(argv)
    assert exc.value.code == 2
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ring_argv = [a.replace("--batch", "--batches") for a in argv]
    with pytest.raises(SystemExit) as exc:
        ring.main(ring_argv)
    assert exc.value.code == 2


def test_ring_refuses_a_batch_the_ranks_cannot_share(monkeypatch, capsys):
    """Each rank took B // world rows: at B = 3 on 2 ranks the ring timed 2 rows against a 3-row baseline."""
    from bigbatch.bench import ring

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exc:
        ring.main(["--batches", "4", "3", "--cpu-smoke"])
    assert exc.value.code == 2 and "not divisible by the number of processes (2)" in capsys.readouterr().err


def test_the_benchmarks_default_runs_write_their_committed_files(monkeypatch):
    """Their own default commands must still reach the committed JSON: memory's string default
    --extra (parsed through its type) once sent the default grid to the temporary directory."""
    from bigbatch.bench import memory

    written = []
    monkeypatch.setattr(memory, "run_case", lambda impl, b, d: {"status": "skipped", "reason": "test"})
    monkeypatch.setattr(memory, "write_json", lambda path, payload: written.append(str(path)))
    monkeypatch.setattr(memory, "plot", lambda results, path: None)
    assert memory.main([]) == 0 and written[-1] == "benchmarks/results/memory_cpu.json"
    assert memory.main(["--batches", "64"]) == 0 and written[-1] != "benchmarks/results/memory_cpu.json"


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_gradcache_benchmark_dry_run_checks_exactness(tmp_path, compiled):
    """The gradcache benchmark's own check (GradCache, offloaded, cached_encode against the same
    chunks in one graph, bf16 autocast) on a tiny BERT: bitwise on the CPU, eager and compiled
    (compiled before session 15: 1.2e-5 off, pass 1 ran the no-grad graph; the reference in one
    autocast region for all chunks: 1.1e-4)."""
    pytest.importorskip("transformers")
    from bigbatch.bench.gradcache import main

    out = tmp_path / "gc.json"
    args = ["--tiny", "--cpu", "--batches", "16", "--repeat", "1", "--skip", "public", "offload", "--out", str(out)]
    assert main(args + (["--compile"] if compiled else [])) == 0
    result = _strict(out.read_text())
    check = result["check"]
    assert check["loss"] == check["loss_ref"]
    assert check["grad_rel_err"] <= 1e-6 and check["grad_rel_err_pytorch_norms"] <= 1e-6, check
    assert result["library"] == {"one_pass_layer_norms": 0}  # (CUDA only)
    assert check["offload_grad_rel_err_vs_gradcache"] <= 1e-6 and check["cached_encode_grad_rel_err_vs_gradcache"] <= 1e-6
    assert ("torch.compile" in result["model"]) == compiled
    assert result["rows"][0]["bigbatch"]["status"] == "ok" and result["rows"][0]["full"]["status"] == "ok"
