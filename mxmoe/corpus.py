"""The bytes ``mxmoe train`` learns from: Python source files of this machine, split into train and val.

Three sources (``--data``):

- ``stdlib``: the standard library's ``.py`` files (site-packages excluded), sorted by path, every
  ``val_every_file``-th one held out (:func:`load_stdlib`; ~10 MB; the CPU default, unchanged since the
  stored seed spreads were measured on it).
- ``python-all``: every ``.py`` file under the interpreter's ``stdlib``, ``purelib`` and ``platlib``
  paths (:func:`python_roots`), deduplicated by content, a file held out for validation when a hash of
  its content says so (:func:`load_python_sources`; hundreds of MB where torch and friends are installed;
  the CUDA default). The concatenation is cached on disk, keyed by the file list (paths, sizes, mtimes).
- a folder: its ``.py`` files, as ``stdlib`` (sorted, every N-th held out, ``site-packages`` skipped).

Every split is its files' bytes joined with ``b"\\n\\n"``, as a uint8 tensor. Nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCES = ("stdlib", "python-all")  # named sources; anything else given to --data is a folder
_SEP = b"\n\n"
_CACHE_VERSION = 1  # bump when the cached layout or the split rule changes


@dataclasses.dataclass
class Corpus:
    """A train / val split of source bytes and where it came from."""

    train: torch.Tensor  # uint8 [train bytes]
    val: torch.Tensor  # uint8 [val bytes]
    source: str  # "stdlib", "python-all" or the folder read
    files: dict  # {"train": files, "val": files}
    duplicates: int = 0  # files skipped because an identical file was already taken
    cache: str | None = None  # the cache file read or written (python-all), else None
    from_cache: bool = False

    def info(self) -> dict:
        """JSON-able description: source, files, bytes, duplicates, cache."""
        return {"source": self.source, "files": dict(self.files), "duplicates": self.duplicates,
                "bytes": {"train": len(self.train), "val": len(self.val)}, "cache": self.cache,
                "from_cache": self.from_cache}


def resolve_source(data: str, device_type: str) -> str:
    """The source ``--data`` names: ``""`` is ``python-all`` on CUDA and ``stdlib`` elsewhere; ``stdlib`` and
    ``python-all`` are themselves; anything else is a folder (returned as given).

    Raises:
        ValueError: a folder that does not exist.
    """
    if not data:
        return "python-all" if device_type == "cuda" else "stdlib"
    if data in SOURCES:
        return data
    if not Path(data).is_dir():
        raise ValueError(f"--data {data!r} is not a folder (nor one of {', '.join(SOURCES)})")
    return data


def load_corpus(data: str, device_type: str, val_every_file: int = 20,
                cache_dir: str | os.PathLike | None = None) -> Corpus:
    """The corpus ``--data`` names (:func:`resolve_source`), split with ``val_every_file``.

    ``cache_dir`` (``python-all`` only; None or empty: no cache) holds the concatenated splits.
    Raises ValueError as :func:`resolve_source`, :func:`load_stdlib` and :func:`load_python_sources`.
    """
    source = resolve_source(data, device_type)
    if source == "python-all":
        return load_python_sources(python_roots(), val_every_file, cache_dir)
    root = "" if source == "stdlib" else source
    train, val, counts = _load_sorted(val_every_file, root)
    return Corpus(train, val, source, counts)


def load_stdlib(val_every_file: int = 20, root: str | os.PathLike = "") -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes of the standard library's ``.py`` files (or those under ``root``) as (train, val) uint8 tensors.

    Files are sorted by path; file ``i`` is validation when ``i % val_every_file == 0``; top-level
    ``site-packages`` is skipped. Files of a split are joined with ``b"\\n\\n"``.

    Raises:
        ValueError: ``root`` is not a folder, or it holds fewer than ``val_every_file`` ``.py`` files.
    """
    train, val, _ = _load_sorted(val_every_file, root)
    return train, val


def _load_sorted(val_every_file: int, root: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, dict]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"data folder {str(root)!r} is not a folder")
    files = sorted(p for p in root.rglob("*.py") if p.relative_to(root).parts[0] != "site-packages")
    if len(files) < val_every_file:
        raise ValueError(f"data folder {str(root)!r} has {len(files)} .py files: need at least {val_every_file}")
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    for i, path in enumerate(files):
        splits[i % val_every_file == 0].append(path.read_bytes())
    train, val = (torch.frombuffer(bytearray(_SEP.join(s)), dtype=torch.uint8) for s in splits)
    return train, val, {"train": len(splits[0]), "val": len(splits[1])}


def python_roots() -> list[str]:
    """This interpreter's ``stdlib``, ``purelib`` and ``platlib`` folders (``sysconfig.get_paths()``),
    those that exist, without repeats, in that order."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        if os.path.isdir(paths[key]) and paths[key] not in roots:
            roots.append(paths[key])
    return roots


def list_sources(roots: list[str | os.PathLike]) -> list[tuple[str, int, int]]:
    """Every ``.py`` file under ``roots``: ``(path, size in bytes, mtime in ns)``, sorted by path.

    Folders reached through a symlink are not entered (no symlink loops; a root nested in another is
    walked as part of both, its files counted once); a symlink to a file counts when it points to a
    regular file; a file reached twice (hard link, symlink, nested roots) is listed once (by device and
    inode). Unreadable folders and dangling links are skipped.
    """
    seen, out = set(), []
    for root in roots:
        for folder, _, names in os.walk(root, followlinks=False):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
                out.append((path, st.st_size, st.st_mtime_ns))
    return sorted(out)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def is_val_file(content: bytes, val_every_file: int) -> bool:
    """Whether a file of this content is held out: the first 8 bytes of its BLAKE2b digest, as an
    integer, divisible by ``val_every_file`` (about one file in ``val_every_file``; the same file is
    in the same split on every machine and in every listing)."""
    return _is_val_digest(_digest(content), val_every_file)


def _is_val_digest(digest: bytes, val_every_file: int) -> bool:
    return int.from_bytes(digest[:8], "little") % val_every_file == 0


def _digest(content: bytes) -> bytes:
    return hashlib.blake2b(content, digest_size=16).digest()


def load_python_sources(roots: list[str | os.PathLike], val_every_file: int = 20,
                        cache_dir: str | os.PathLike | None = None) -> Corpus:
    """The ``python-all`` corpus: every ``.py`` file under ``roots`` (:func:`list_sources`), one copy of
    each distinct content (empty files dropped), validation by :func:`is_val_file`, each split ordered by
    content digest (so the result depends only on the set of contents), joined with ``b"\\n\\n"``.

    With ``cache_dir``: the two splits are read from ``<cache_dir>/python-all-<key>.bin`` when present,
    where ``key`` hashes the file list (paths, sizes, mtimes) and ``val_every_file``; else they are built
    and written there atomically (a temp file, then ``os.replace``); a cache that cannot be written is
    skipped with a message.

    Raises:
        ValueError: ``val_every_file < 2``, fewer than ``val_every_file`` distinct non-empty files, or a
            split without files.
    """
    if val_every_file < 2:
        raise ValueError(f"val_every_file must be >= 2, got {val_every_file}")
    listing = list_sources(roots)
    key = hashlib.blake2b(json.dumps([_CACHE_VERSION, val_every_file, listing]).encode(), digest_size=12).hexdigest()
    cache = Path(os.path.expanduser(str(cache_dir))) / f"python-all-{key}.bin" if cache_dir else None
    if cache is not None and cache.is_file():
        try:
            return _read_cache(cache)
        except (OSError, ValueError, KeyError) as e:
            print(f"data cache {cache} unreadable ({e}): rebuilding it")
    with ThreadPoolExecutor(8) as pool:
        contents = list(pool.map(_read, [p for p, _, _ in listing]))
    unique: dict[bytes, bytes] = {}
    for content in contents:
        if content:
            unique.setdefault(_digest(content), content)
    duplicates = sum(1 for c in contents if c) - len(unique)
    if len(unique) < val_every_file:
        raise ValueError(f"{len(unique)} distinct .py files under {', '.join(map(str, roots))}: "
                         f"need at least {val_every_file}")
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    for digest in sorted(unique):
        splits[_is_val_digest(digest, val_every_file)].append(unique[digest])
    if not all(splits):
        raise ValueError(f"{len(unique)} distinct .py files under {', '.join(map(str, roots))}: "
                         f"{len(splits[1])} fell into validation with val_every_file {val_every_file}; give more files")
    train, val = (_SEP.join(s) for s in splits)
    corpus = Corpus(torch.frombuffer(bytearray(train), dtype=torch.uint8),
                    torch.frombuffer(bytearray(val), dtype=torch.uint8), "python-all",
                    {"train": len(splits[0]), "val": len(splits[1])}, duplicates)
    if cache is not None:
        try:
            _write_cache(cache, train, val, corpus)
            corpus.cache = str(cache)
        except OSError as e:
            print(f"data cache {cache} not written ({e.strerror or e}): the next run reads the files again")
    return corpus


def _write_cache(path: Path, train: bytes, val: bytes, corpus: Corpus) -> None:
    """``path``: a JSON header line (lengths, counts), then the train bytes, then the val bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"train": len(train), "val": len(val), "files": corpus.files,
                         "duplicates": corpus.duplicates}).encode() + b"\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(train)
            f.write(val)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _read_cache(path: Path) -> Corpus:
    with open(path, "rb") as f:
        header = json.loads(f.readline())
        train, val = bytearray(f.read(header["train"])), bytearray(f.read(header["val"]))
    if len(train) != header["train"] or len(val) != header["val"]:
        raise ValueError("truncated")
    return Corpus(torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8),
                  "python-all", header["files"], header["duplicates"], str(path), True)
