"""mxmoe.corpus: the python-all corpus on a temp folder of small fake sources (dedupe, split by file,
determinism, cache, symlinks), and which source ``--data`` names."""

import os

import pytest
import torch

from mxmoe.corpus import is_val_file, list_sources, load_corpus, load_python_sources, resolve_source


def _tree(tmp_path):
    """Two roots: 30 distinct files, a copy of one in the other root, an empty file, a non-.py file, a
    symlink loop, a symlink to a file and a dangling one. Returns (roots, {distinct non-empty contents})."""
    a, b = tmp_path / "lib", tmp_path / "site"
    contents = set()
    for i in range(30):
        folder = (a if i % 2 else b) / f"pkg{i % 3}"
        folder.mkdir(parents=True, exist_ok=True)
        data = f"def f{i}():\n    return {i * i}\n".encode()
        (folder / f"m{i}.py").write_bytes(data)
        contents.add(data)
    (b / "copy.py").write_bytes((a / "pkg1" / "m1.py").read_bytes())  # duplicate content
    (a / "empty.py").write_bytes(b"")
    (a / "notes.txt").write_bytes(b"not python")
    os.symlink(a, a / "loop")  # a folder symlink back up: not entered
    os.symlink(a / "pkg1" / "m1.py", b / "link.py")  # the same file again, through a link
    os.symlink(tmp_path / "missing.py", b / "dangling.py")
    return [str(a), str(b)], contents


def _files_in(split: torch.Tensor, contents) -> set:
    text = bytes(split.tolist())
    return {c for c in contents if c in text}


def test_python_sources_dedupe_split_determinism(tmp_path):
    roots, contents = _tree(tmp_path)
    listing = list_sources(roots)
    assert all(p.endswith(".py") for p, _, _ in listing)
    assert not any("loop" in p for p, _, _ in listing)  # the symlink loop is not walked
    assert len(listing) == 30 + 1 + 1  # distinct + copy.py + empty.py; link.py is m1.py's inode again
    corpus = load_python_sources(roots, val_every_file=3)
    assert corpus.files["train"] + corpus.files["val"] == 30 and corpus.duplicates == 1
    train, val = _files_in(corpus.train, contents), _files_in(corpus.val, contents)
    assert train | val == contents and not train & val  # split by file: every file whole in one split
    assert val == {c for c in contents if is_val_file(c, 3)} and 0 < len(val) < 30
    sep = 2 * (corpus.files["train"] - 1)  # files joined by b"\n\n"
    assert len(corpus.train) == sum(len(c) for c in train) + sep
    again = load_python_sources(list(reversed(roots)), val_every_file=3)  # another listing order
    assert torch.equal(again.train, corpus.train) and torch.equal(again.val, corpus.val)
    assert corpus.info()["bytes"] == {"train": len(corpus.train), "val": len(corpus.val)}


def test_python_sources_cache(tmp_path):
    roots, contents = _tree(tmp_path / "src")
    cache = tmp_path / "cache"
    first = load_python_sources(roots, 3, cache)
    assert not first.from_cache and first.cache and os.path.isfile(first.cache)
    assert [p.name for p in cache.iterdir()] == [os.path.basename(first.cache)]  # no temp file left
    second = load_python_sources(roots, 3, cache)
    assert second.from_cache and second.cache == first.cache
    assert torch.equal(second.train, first.train) and torch.equal(second.val, first.val)
    assert (second.files, second.duplicates) == (first.files, first.duplicates)
    new = os.path.join(roots[0], "new.py")
    with open(new, "wb") as f:
        f.write(b"x = 'a new file'\n")
    third = load_python_sources(roots, 3, cache)  # another file list: another key, rebuilt
    assert not third.from_cache and third.cache != first.cache
    assert third.files["train"] + third.files["val"] == 31
    with open(third.cache, "r+b") as f:  # a damaged cache is rebuilt, not trusted
        f.truncate(20)
    fourth = load_python_sources(roots, 3, cache)
    assert not fourth.from_cache and torch.equal(fourth.train, third.train)


def test_python_sources_errors(tmp_path):
    (tmp_path / "a.py").write_bytes(b"a = 1\n")
    with pytest.raises(ValueError, match="need at least 20"):
        load_python_sources([str(tmp_path)], 20)
    with pytest.raises(ValueError, match="val_every_file must be >= 2"):
        load_python_sources([str(tmp_path)], 1)


def test_resolve_source_and_the_small_corpus(tmp_path):
    assert resolve_source("", "cuda") == "python-all" and resolve_source("", "cpu") == "stdlib"
    assert resolve_source("python-all", "cpu") == "python-all" and resolve_source("stdlib", "cuda") == "stdlib"
    assert resolve_source(str(tmp_path), "cpu") == str(tmp_path)
    with pytest.raises(ValueError, match="is not a folder"):
        resolve_source(str(tmp_path / "nope"), "cpu")
    for i in range(4):
        (tmp_path / f"m{i}.py").write_bytes(f"x = {i}\n".encode())
    corpus = load_corpus(str(tmp_path), "cuda", val_every_file=2)  # a folder: sorted, every 2nd held out
    assert bytes(corpus.val.tolist()) == b"x = 0\n\n\nx = 2\n" and corpus.files == {"train": 2, "val": 2}
    stdlib = load_corpus("", "cpu")
    from mxmoe.corpus import load_stdlib

    train, val = load_stdlib()
    assert stdlib.source == "stdlib" and torch.equal(stdlib.val, val) and len(stdlib.train) == len(train)
