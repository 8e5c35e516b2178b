"""Training data: the built-in code-search pairs and the user's JSONL files.

Built-in set: (docstring summary, function source without its docstring) pairs of the
documented functions of the installed Python's standard library and site-packages,
extracted with :mod:`ast`. Pairs are deduplicated (a repeated docstring or a repeated
body is dropped, first one in file order wins) and split by MODULE: a module's
functions are all in the training split or all held out, decided by a seeded stable
hash of the module's dotted name, so the split is reproducible and no held-out function
(nor a sibling from its file) is seen in training.

User set: JSONL, one object per line with "query" and "positive" (non-empty strings)
and optional "negatives" (a list of strings). Every problem is a :class:`DataError`
naming the file and line; loading never touches the output directory.
"""

from __future__ import annotations

import ast
import hashlib
import json
import multiprocessing
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

# Directory names never scanned: tests (their docstrings describe tests, not code),
# vendored copies of other packages (duplicates across the split), caches, bigbatch itself.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "testing", "__pycache__", "_vendor", "vendor",
     "idlelib", "lib2to3", "turtledemo", "bigbatch", "ensurepip"}
)
_MIN_QUERY_WORDS = 3
_MAX_QUERY_CHARS = 400
_MAX_CODE_LINES = 40


class DataError(ValueError):
    """A data file (or the built-in extraction) cannot be used; the message says where and why."""


@dataclass(frozen=True)
class Pair:
    """One training example: a query, its positive, optional hard negatives, and its split group."""

    query: str
    positive: str
    negatives: Tuple[str, ...] = ()
    group: str = ""


@dataclass
class Splits:
    """Training and held-out pairs plus a one-line description of where they came from."""

    train: List[Pair]
    heldout: List[Pair]
    source: str
    info: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- built-in set


def default_roots() -> List[Path]:
    """The standard library and every site-packages directory the running Python imports from:
    its own (a virtual environment's), the base installation's when the environment sees them
    (``--system-site-packages``) and the user's (``pip install --user``), in that order."""
    import site

    paths = sysconfig.get_paths()
    found = [paths["stdlib"], paths["purelib"], paths["platlib"]]
    found += list(getattr(site, "getsitepackages", lambda: [])())
    if getattr(site, "ENABLE_USER_SITE", False):
        found.append(site.getusersitepackages())
    importable = {str(Path(p).resolve()) for p in sys.path if p}
    roots: List[Path] = []
    for i, p in enumerate(found):
        path = Path(p)
        # the standard library and this Python's own site-packages always; the others only where
        # the running Python imports from them (a venv without --system-site-packages does not)
        wanted = i < 3 or str(path.resolve()) in importable
        if wanted and path.is_dir() and path.resolve() not in [r.resolve() for r in roots]:
            roots.append(path)
    return roots


def python_files(root: Path) -> Iterator[Tuple[str, Path]]:
    """``(dotted module name, path)`` of the ``.py`` files under ``root``, in sorted order."""
    root = Path(root)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".") and "-" not in d)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            rel = Path(dirpath, name).relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1] or ["__init__"]
            yield ".".join(parts), Path(dirpath, name)


def _summary(doc: str) -> Optional[str]:
    """The docstring's first paragraph, whitespace-collapsed, or None if too short/long."""
    para = doc.strip().split("\n\n", 1)[0]
    text = " ".join(para.split())
    if len(text.split()) < _MIN_QUERY_WORDS or len(text) > _MAX_QUERY_CHARS:
        return None
    return text


def _trivial(body: Sequence[ast.stmt]) -> bool:
    """True if a function body (without its docstring) does nothing worth retrieving."""
    if not body:
        return True
    for stmt in body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # `...` or a stray string
        if isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.dump(stmt):
            continue
        return False
    return True


def functions_of_source(source: str) -> Iterator[Tuple[str, str]]:
    """``(query, code)`` for each documented, non-trivial function in ``source``.

    ``code`` is the ``def`` header plus the body with the docstring removed (at most
    ``_MAX_CODE_LINES`` lines), dedented; ``query`` is the docstring's first paragraph.
    Raises SyntaxError/ValueError for unparsable source.
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("test"):
            continue
        doc = ast.get_docstring(node, clean=True)
        if not doc or _trivial(node.body[1:]):
            continue
        query = _summary(doc)
        if query is None:
            continue
        doc_node = node.body[0]
        if doc_node.lineno <= node.lineno or node.end_lineno is None or doc_node.end_lineno is None:
            continue  # one-line `def f(): "doc"`
        header = lines[node.lineno - 1 : doc_node.lineno - 1]
        body = lines[doc_node.end_lineno : node.end_lineno]
        code_lines = [ln for ln in header + body if ln.strip()][:_MAX_CODE_LINES]
        indent = min(len(ln) - len(ln.lstrip()) for ln in code_lines)
        yield query, "\n".join(ln[indent:] for ln in code_lines)


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


EXTRACT_VERSION = 1  # bump when the extraction rules change (invalidates caches)


def candidate_files(roots: Sequence[Path], max_file_bytes: int = 400_000) -> List[Tuple[str, Path, int, int]]:
    """``(group, path, size, mtime_ns)`` of every candidate file, in a fixed pseudo-random order.

    The order is a stable hash of the group (``"<root index>:<dotted module>"``), so a pair
    cap takes a spread of packages rather than the alphabetically first ones; it does not
    depend on the seed, so every seed sees the same data set (only the split differs).
    """
    files = []
    for r, root in enumerate(roots):
        for module, path in python_files(Path(root)):
            try:
                st = path.stat()
            except OSError:
                continue
            if st.st_size <= max_file_bytes:
                files.append((f"{r}:{module}", path, st.st_size, st.st_mtime_ns))
    files.sort(key=lambda f: (_unit_hash(-1, f[0]), f[0]))
    return files


def extract_pairs(
    roots: Optional[Iterable[Path]] = None, *, max_pairs: Optional[int] = None, max_file_bytes: int = 400_000,
    cache_dir: Optional[Path] = None, workers: Optional[int] = None,
) -> List[Pair]:
    """Deduplicated (docstring, code) pairs from the ``.py`` files under ``roots``.

    Files are visited in :func:`candidate_files` order, so the result depends only on the
    installed files and ``max_pairs``. Unreadable or unparsable files are skipped. ``group``
    of each pair is its module (``"<root index>:<dotted name>"``).
    Cost: one ``ast.parse`` per file visited (~1 s per 1,000 pairs on one CPU core); with
    ``cache_dir`` the result is stored as JSONL keyed by the file list (sizes and mtimes)
    and reused while nothing is installed or changed. ``workers`` processes parse files
    (default: the CPU count, at most 8); the result is the same for any number.
    """
    roots = list(default_roots() if roots is None else roots)
    files = candidate_files(roots, max_file_bytes)
    cache = None
    if cache_dir is not None:
        key = hashlib.blake2b(repr((EXTRACT_VERSION, max_pairs, [str(r) for r in roots],
                                    [(g, s, m) for g, _, s, m in files])).encode(), digest_size=12).hexdigest()
        cache = Path(cache_dir) / f"codesearch-v{EXTRACT_VERSION}-{key}.jsonl"
        if cache.is_file():
            with cache.open("r", encoding="utf-8") as f:
                return [Pair(**json.loads(line)) for line in f]
    seen_q: set = set()
    seen_c: set = set()
    pairs: List[Pair] = []
    workers = max(1, min(workers if workers is not None else (os.cpu_count() or 1), 8))
    pool = multiprocessing.get_context().Pool(workers) if workers > 1 and len(files) > 64 else None
    try:
        # Files are parsed in parallel but consumed in order, so the result does not depend on `workers`.
        found_iter = (pool.imap(_file_functions, [f[1] for f in files], chunksize=8) if pool is not None
                      else map(_file_functions, [f[1] for f in files]))
        for (group, _, _, _), found in zip(files, found_iter):
            for query, code in found:
                kq, kc = _norm(query), _norm(code)
                if kq in seen_q or kc in seen_c:
                    continue
                seen_q.add(kq)
                seen_c.add(kc)
                pairs.append(Pair(query=query, positive=code, group=group))
            if max_pairs is not None and len(pairs) >= max_pairs:
                pairs = pairs[:max_pairs]
                break
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    if cache is not None:
        _write_cache(cache, pairs)
    return pairs


def _file_functions(path: Path) -> List[Tuple[str, str]]:
    """``functions_of_source`` of one file; ``[]`` for unreadable or unparsable files."""
    try:
        source = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return list(functions_of_source(source))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []


def _write_cache(path: Path, pairs: Sequence[Pair]) -> None:
    """Best-effort atomic cache write (an unwritable cache directory only costs re-extraction)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with tmp.open("w", encoding="utf-8") as f:
            for p in pairs:
                f.write(json.dumps({"query": p.query, "positive": p.positive, "group": p.group}) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not cache the extracted pairs in {path.parent}: {e}")


def default_cache_dir() -> Path:
    """``$BIGBATCH_CACHE`` or ``$XDG_CACHE_HOME/bigbatch`` (default ``~/.cache/bigbatch``)."""
    env = os.environ.get("BIGBATCH_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bigbatch"


def _unit_hash(seed: int, key: str) -> float:
    """A stable pseudo-random number in [0, 1) from ``(seed, key)``."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def split_by_group(pairs: Sequence[Pair], heldout_fraction: float, seed: int) -> Tuple[List[Pair], List[Pair]]:
    """Split so that every group lies wholly in one side; about ``heldout_fraction`` of groups held out."""
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    train, held = [], []
    for p in pairs:
        (held if _unit_hash(seed, p.group) < heldout_fraction else train).append(p)
    return train, held


def builtin_codesearch(
    *, seed: int = 0, heldout_fraction: float = 0.1, max_pairs: Optional[int] = None,
    roots: Optional[Iterable[Path]] = None, cache_dir: Optional[Path] = None,
) -> Splits:
    """The built-in code-search set: extracted (or read from ``cache_dir``), deduplicated, split by module."""
    roots = list(default_roots() if roots is None else roots)
    pairs = extract_pairs(roots, max_pairs=max_pairs, cache_dir=cache_dir)
    train, held = split_by_group(pairs, heldout_fraction, seed)
    if len(train) < 2 or len(held) < 2:
        raise DataError(
            f"the built-in extraction found too few documented functions under {[str(r) for r in roots]} "
            f"({len(train)} training, {len(held)} held-out pairs"
            + (f" from the --max-pairs {max_pairs} kept" if max_pairs is not None else "")
            + f", held out by module at --heldout-fraction {heldout_fraction}); raise --max-pairs or "
            "--heldout-fraction, or pass --data with your own JSONL"
        )
    modules = {p.group for p in pairs}
    return Splits(
        train=train, heldout=held,
        source=f"built-in code search: {len(pairs)} (docstring, code) pairs from {len(modules)} modules; "
               f"{len(train)} training / {len(held)} held-out (split by module)",
        info={"pairs": len(pairs), "modules": len(modules), "roots": [str(r) for r in roots]},
    )


# ----------------------------------------------------------------------------- user JSONL


def load_jsonl(path: os.PathLike | str) -> List[Pair]:
    """Read and validate a JSONL file of ``{"query", "positive", "negatives"?}`` objects.

    Blank lines are skipped. Raises :class:`DataError` naming ``path:line`` for malformed
    JSON, a non-object line, a missing or non-string/empty "query"/"positive", or
    "negatives" that is not a list of strings; and for a missing or empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file {str(p)!r} does not exist or is not a file")
    pairs: List[Pair] = []
    # utf-8-sig: a byte-order mark at the start (as some Windows editors write) is not part of line 1
    with p.open("r", encoding="utf-8-sig", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                pairs.append(_parse_line(line, p, lineno))
        except UnicodeDecodeError:  # its position is within the decoder's read buffer: find the line
            raise DataError(_utf8_error(p)) from None
    if not pairs:
        raise DataError(f"{p}: the file is empty (expected one JSON object per line)")
    return pairs


def _utf8_error(p: Path) -> str:
    """Where a file's first invalid UTF-8 byte is: ``path:line: ... column``."""
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{p}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
    return f"{p}: not valid UTF-8"


def _parse_line(line: str, path: Path, lineno: int) -> Pair:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("query", "positive"):
        if key not in obj:
            raise DataError(f'{where}: missing field "{key}" (each line needs "query" and "positive")')
        if not isinstance(obj[key], str) or not obj[key].strip():
            raise DataError(f'{where}: field "{key}" must be a non-empty string, got {obj[key]!r:.60}')
    negs = obj.get("negatives", [])
    if not isinstance(negs, list) or not all(isinstance(n, str) and n.strip() for n in negs):
        raise DataError(f'{where}: field "negatives" must be a list of non-empty strings')
    for key, text in [("query", obj["query"]), ("positive", obj["positive"])] + [("negatives", n) for n in negs]:
        try:  # a JSON escape may encode half a surrogate pair ("\ud800"), which no tokenizer takes
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise DataError(f'{where}: field "{key}" holds a lone surrogate ({text[e.start]!r} at '
                            f'character {e.start + 1}), not text') from None
    return Pair(query=obj["query"], positive=obj["positive"], negatives=tuple(negs), group=str(lineno))


def data_fingerprint(splits: Splits) -> str:
    """A hash of the training and held-out pairs, in order: a --resume on other data (lines appended
    to the file, a built-in set extracted from other installed packages) would silently change the
    batches and the schedule of the run it continues."""
    h = hashlib.blake2b(digest_size=16)
    for part in (splits.train, splits.heldout):
        h.update(f"{len(part)}\x01".encode())
        for p in part:
            h.update("\x00".join((p.query, p.positive, *p.negatives)).encode("utf-8") + b"\x02")
    return h.hexdigest()


def repeated_positives(pairs: Sequence[Pair]) -> int:
    """How many pairs have a positive text that an earlier pair has too: two such pairs in one batch
    make each other's positive an in-batch negative (a false negative)."""
    seen: set = set()
    repeats = 0
    for p in pairs:
        repeats += p.positive in seen
        seen.add(p.positive)
    return repeats


def jsonl_splits(
    path: os.PathLike | str, *, eval_path: Optional[os.PathLike | str] = None, heldout_fraction: float = 0.05,
    seed: int = 0,
) -> Splits:
    """The user's data: ``eval_path`` as held-out set, or a seeded random ``heldout_fraction`` of lines."""
    pairs = load_jsonl(path)
    if eval_path is not None:
        train, held = pairs, load_jsonl(eval_path)
        if len(held) < 2:  # one example ranks first among one: perfect recall, nothing measured
            raise DataError(f"{eval_path}: the held-out set needs at least 2 examples, got {len(held)}")
    else:
        train, held = split_by_group(pairs, heldout_fraction, seed)
        if len(held) < 2 or len(train) < 2:
            raise DataError(
                f"{path}: {len(pairs)} examples are too few to hold out {heldout_fraction:.0%} for evaluation "
                f"(got {len(train)} training, {len(held)} held-out); pass --eval-data"
            )
    return Splits(train=train, heldout=held, source=f"JSONL {path}: {len(train)} training, {len(held)} held-out pairs")
