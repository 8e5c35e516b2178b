"""bigbatch.train data: ast extraction (docstring removed, dedup, module split, no leakage) and JSONL errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from bigbatch.train.data import (
    DataError,
    builtin_codesearch,
    extract_pairs,
    functions_of_source,
    jsonl_splits,
    load_jsonl,
    split_by_group,
)

MODULE = textwrap.dedent(
    '''
    def documented(a, b):
        """Add two numbers and return the sum.

        Longer description that is not part of the query.
        """
        c = a + b
        return c

    def short_doc(x):
        """Too short."""
        return x

    def trivial(x):
        """This function does nothing at all."""
        pass

    def abstract(x):
        """Subclasses must implement this method."""
        raise NotImplementedError

    def undocumented(x):
        return x * 2

    def one_line(x): "A docstring on the def line is skipped here."; return x

    class Box:
        def method(self, item):
            """Put one item into the box and count it."""
            self.items.append(item)
            self.count += 1

    def test_something():
        """Tests are never training data for code search."""
        assert documented(1, 2) == 3
    '''
)


def test_functions_of_source_strips_docstrings_and_skips_trivial():
    found = dict(functions_of_source(MODULE))
    assert set(found) == {"Add two numbers and return the sum.", "Put one item into the box and count it."}
    code = found["Add two numbers and return the sum."]
    assert code.splitlines()[0] == "def documented(a, b):"
    assert "return c" in code
    assert "Add two numbers" not in code and "Longer description" not in code  # no answer leak
    method = found["Put one item into the box and count it."]
    assert method.startswith("def method(self, item):")  # dedented
    assert "self.count += 1" in method


def _tree(root: Path) -> None:
    """Two packages of several modules, a duplicate function, a tests dir and a broken file."""
    body = "\n\n".join(
        f'def func_{i}(value):\n    """Compute the {i}th special transform of a value."""\n    return value + {i}\n'
        for i in range(3)
    )
    for pkg in ("alpha", "beta"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
        for m in range(6):
            src = body.replace("func_", f"{pkg}_{m}_").replace("special", f"{pkg} {m} special")
            (root / pkg / f"mod{m}.py").write_text(src)
    dup = 'def copied(x):\n    """Return the value doubled for later use."""\n    return x * 2\n'
    (root / "alpha" / "mod0.py").write_text((root / "alpha" / "mod0.py").read_text() + "\n" + dup)
    (root / "beta" / "mod5.py").write_text((root / "beta" / "mod5.py").read_text() + "\n" + dup)
    (root / "alpha" / "tests").mkdir()
    (root / "alpha" / "tests" / "helpers.py").write_text(dup.replace("copied", "in_tests"))
    (root / "alpha" / "broken.py").write_text("def f(:\n")


def test_extract_dedup_skip_tests_and_broken(tmp_path):
    _tree(tmp_path)
    pairs = extract_pairs([tmp_path])
    assert len(pairs) == 2 * 6 * 3 + 1  # 36 distinct functions + one copy of the duplicate
    assert sum("copied" in p.positive for p in pairs) == 1
    assert not any("in_tests" in p.positive for p in pairs)
    assert {p.group for p in pairs} == {f"0:{pkg}.mod{m}" for pkg in ("alpha", "beta") for m in range(6)}
    assert pairs == extract_pairs([tmp_path])  # fixed order
    assert len(extract_pairs([tmp_path], max_pairs=5)) == 5


def test_extract_cache_roundtrip(tmp_path):
    _tree(tmp_path / "src")
    first = extract_pairs([tmp_path / "src"], cache_dir=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.jsonl"))) == 1
    assert extract_pairs([tmp_path / "src"], cache_dir=tmp_path / "cache") == first
    (tmp_path / "src" / "alpha" / "mod9.py").write_text(
        'def new_one(x):\n    """A newly installed function appears."""\n    return -x\n'
    )
    assert len(extract_pairs([tmp_path / "src"], cache_dir=tmp_path / "cache")) == len(first) + 1


def test_split_by_module_no_leakage_and_reproducible(tmp_path):
    _tree(tmp_path)
    splits = builtin_codesearch(roots=[tmp_path], heldout_fraction=0.4, seed=3)
    train_groups = {p.group for p in splits.train}
    held_groups = {p.group for p in splits.heldout}
    assert train_groups and held_groups and not (train_groups & held_groups)
    assert not ({p.positive for p in splits.train} & {p.positive for p in splits.heldout})
    assert not ({p.query for p in splits.train} & {p.query for p in splits.heldout})
    again = builtin_codesearch(roots=[tmp_path], heldout_fraction=0.4, seed=3)
    assert again.train == splits.train and again.heldout == splits.heldout
    other = [builtin_codesearch(roots=[tmp_path], heldout_fraction=0.4, seed=s).heldout for s in range(4, 8)]
    assert any(h != splits.heldout for h in other)  # the seed moves the split


def test_split_on_real_stdlib_package_has_no_leakage():
    import email

    root = Path(email.__file__).parent.parent  # the stdlib; restrict to a few packages for speed
    roots = [root / "email", root / "json", root / "asyncio", root / "xml"]
    pairs = extract_pairs(roots, workers=1)
    assert len(pairs) > 200
    assert extract_pairs(roots, workers=2) == pairs  # parallel parsing keeps the order
    train, held = split_by_group(pairs, 0.3, seed=0)
    assert train and held
    assert not ({p.group for p in train} & {p.group for p in held})
    assert len({p.positive for p in pairs}) == len(pairs) and len({p.query for p in pairs}) == len(pairs)


def test_split_fraction_validated():
    with pytest.raises(ValueError, match="heldout_fraction"):
        split_by_group([], 1.5, 0)


def _write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"query": "q", "positive": "p", "negatives": ["n1", "n2"]})


def test_load_jsonl_ok_and_blank_lines(tmp_path):
    f = _write(tmp_path / "d.jsonl", [GOOD, "", "   ", json.dumps({"query": "a b", "positive": "c"})])
    pairs = load_jsonl(f)
    assert [p.query for p in pairs] == ["q", "a b"]
    assert pairs[0].negatives == ("n1", "n2") and pairs[1].negatives == ()


@pytest.mark.parametrize(
    "lines, pattern",
    [
        ([GOOD, '{"query": "q", "positive": '], r"d\.jsonl:2: malformed JSON"),
        ([GOOD, GOOD, "[1, 2]"], r"d\.jsonl:3: expected a JSON object"),
        ([json.dumps({"positive": "p"})], r'd\.jsonl:1: missing field "query"'),
        ([GOOD, json.dumps({"query": "q"})], r'd\.jsonl:2: missing field "positive"'),
        ([json.dumps({"query": "", "positive": "p"})], r'd\.jsonl:1: field "query" must be a non-empty string'),
        ([json.dumps({"query": "q", "positive": 3})], r'd\.jsonl:1: field "positive" must be a non-empty string'),
        ([json.dumps({"query": "q", "positive": "p", "negatives": "n"})], r'd\.jsonl:1: field "negatives"'),
        ([json.dumps({"query": "q", "positive": "p", "negatives": [1]})], r'd\.jsonl:1: field "negatives"'),
        ([], r"the file is empty"),
        (["", " "], r"the file is empty"),
    ],
)
def test_load_jsonl_errors_name_the_line(tmp_path, lines, pattern):
    f = _write(tmp_path / "d.jsonl", lines)
    with pytest.raises(DataError, match=pattern):
        load_jsonl(f)


def test_load_jsonl_missing_file_and_bad_utf8(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "b.jsonl").write_bytes(b'{"query": "\xff", "positive": "p"}\n')
    with pytest.raises(DataError, match="UTF-8"):
        load_jsonl(tmp_path / "b.jsonl")


def test_bad_utf8_and_lone_surrogates_name_the_line(tmp_path):
    """The UTF-8 error gave a position inside the decoder's read buffer, no line; a JSON-escaped lone
    surrogate passed and crashed a Hugging Face tokenizer later (session 12)."""
    good = json.dumps({"query": "q", "positive": "p"}) + "\n"
    (tmp_path / "b.jsonl").write_bytes(good.encode() * 6000 + b'{"query": "ok \xff", "positive": "p"}\n')
    with pytest.raises(DataError, match=r"b.jsonl:6001: not valid UTF-8 \(byte 0xff at column 15\)"):
        load_jsonl(tmp_path / "b.jsonl")
    (tmp_path / "s.jsonl").write_text(good + '{"query": "q", "positive": "lone \\ud800 half"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"s.jsonl:2: field \"positive\" holds a lone surrogate"):
        load_jsonl(tmp_path / "s.jsonl")


def test_a_byte_order_mark_is_not_part_of_the_first_line(tmp_path):
    """Some Windows editors start a UTF-8 file with a byte-order mark: it was refused as bad JSON."""
    lines = [json.dumps({"query": f"q{i}", "positive": f"p{i}"}) for i in range(3)]
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    assert [p.query for p in load_jsonl(tmp_path / "bom.jsonl")] == ["q0", "q1", "q2"]


def test_an_eval_file_of_one_example_is_refused(tmp_path):
    """One held-out example ranks first among one: recall 1.0 before and after, nothing measured."""
    lines = [json.dumps({"query": f"q{i}", "positive": f"p{i}"}) for i in range(20)]
    with pytest.raises(DataError, match="at least 2 examples"):
        jsonl_splits(_write(tmp_path / "d.jsonl", lines), eval_path=_write(tmp_path / "e.jsonl", lines[:1]))


def test_jsonl_splits_holdout_and_eval_file(tmp_path):
    lines = [json.dumps({"query": f"q{i}", "positive": f"p{i}"}) for i in range(200)]
    f = _write(tmp_path / "d.jsonl", lines)
    s = jsonl_splits(f, heldout_fraction=0.1, seed=0)
    assert len(s.train) + len(s.heldout) == 200 and 5 <= len(s.heldout) <= 40
    assert not ({p.query for p in s.train} & {p.query for p in s.heldout})
    e = _write(tmp_path / "e.jsonl", lines[:3])
    s2 = jsonl_splits(f, eval_path=e)
    assert len(s2.train) == 200 and len(s2.heldout) == 3
    with pytest.raises(DataError, match="too few"):
        jsonl_splits(_write(tmp_path / "tiny.jsonl", lines[:2]), heldout_fraction=0.1)


def test_default_roots_include_importable_site_packages(tmp_path, monkeypatch):
    """A virtual environment made with --system-site-packages imports the base installation's
    site-packages (and the user's): they were not scanned, so such an environment built a much
    smaller default data set. A site-packages directory the Python does not import from is not
    scanned."""
    import site
    import sys

    from bigbatch.train.data import default_roots

    seen, unseen = tmp_path / "base-site", tmp_path / "other-site"
    seen.mkdir()
    unseen.mkdir()
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(seen), str(unseen)])
    monkeypatch.setattr(sys, "path", sys.path + [str(seen)])
    roots = default_roots()
    assert seen in roots and unseen not in roots
    assert len({r.resolve() for r in roots}) == len(roots)


def test_tokenizer_pieces_keep_non_ascii_words():
    """Words in any script are pieces (before: the ASCII-only pattern dropped every non-ASCII
    letter, so Cyrillic or Japanese text gave no ids at all); ASCII identifiers still split at
    underscores and camelCase."""
    from bigbatch.train.tokenizer import HashTokenizer, pieces

    assert pieces("кошка собака") == ["кошка", "собака"]
    assert pieces("naïve Straße café") == ["naïve", "straße", "café"]
    assert pieces("日本語のテキスト") == ["日本語のテキスト"]
    # combining marks continue a word (Python's \w has none); decomposed text is NFC-normalised
    assert pieces("हिन्दी काम தமிழ்") == ["हिन्दी", "काम", "தமிழ்"]
    assert pieces("cafe\u0301") == ["café"]
    # numerals other than decimal digits stay in words, as Python's \w keeps them
    assert pieces("H₂O x² 二〇二四年") == ["h₂o", "x²", "二〇二四年"]
    assert pieces("getSourceSegment get_source_segment HTTPServer x2 42") == [
        "get", "source", "segment", "get", "source", "segment", "http", "server", "x", "2", "42"]
    assert HashTokenizer(buckets=64).ids("кошка") != []


def test_metrics_log_skips_a_torn_last_line_and_names_a_damaged_one(tmp_path):
    """A power cut can leave the last record half written: --resume reads past it (it said only
    "Expecting ',' delimiter" before); a damaged line elsewhere is an error naming the file."""
    import pytest

    from bigbatch.train.metrics import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    assert MetricsLog(path).read() == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl is damaged at line 2 .*--overwrite"):
        MetricsLog(path).read()
