"""What a run leaves on disk besides its metrics: training states (``checkpoint_<recipe>.pt``, for
``--resume``), the run's settings (``run_config.json``) and the models (``model_<recipe>.safetensors``),
each written atomically; and the rules for the ``--out`` folder (:func:`prepare_out`)."""

import dataclasses
import errno
import json
import os
from pathlib import Path

import safetensors.torch
import torch

from mxmoe.train.config import RunInputError, TrainConfig

CHECKPOINT_FORMAT = "mxmoe-train-state-1"


def save_training_state(path: str | os.PathLike, state: dict) -> None:
    """``torch.save(state)`` to ``path`` atomically: written to a temp file in the same folder, flushed
    to disk, then ``os.replace``d over ``path``; a crash mid-write leaves the previous file as it was
    (and the temp file is removed on any error). ``state`` must hold only tensors, numbers, strings,
    None and lists / dicts of them (what ``torch.load(weights_only=True)`` reads back)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_training_state(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict:
    """A state written by :func:`save_training_state` (``torch.load(weights_only=True)``: no code is
    unpickled), tensors on ``device`` (generator states stay on the CPU).

    Raises:
        FileNotFoundError: no such file. RunInputError (a ValueError): a damaged file, or not a
            ``mxmoe train`` training state.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training state at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch.load raises several kinds for a damaged file
        raise RunInputError(f"{path} cannot be read as a training state ({type(e).__name__}: {str(e)[:120]}): "
                            "the file is damaged or incomplete; delete it to train that recipe from the start") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise RunInputError(f"{path} is not a mxmoe train checkpoint (format {CHECKPOINT_FORMAT})")
    if "model" in state:
        state["model"] = {k: v.to(device) for k, v in state["model"].items()}
    return state


def load_run_config(folder: str | os.PathLike) -> TrainConfig:
    """The settings of the checkpointed run in ``folder`` (its ``run_config.json``), with ``out`` and
    ``resume`` set to ``folder``: what ``mxmoe train --resume DIR`` runs.

    Raises:
        ValueError: ``folder`` is not a folder, or holds no ``run_config.json`` (not an ``mxmoe train``
            output folder).
    """
    path = Path(folder) / "run_config.json"
    if not Path(folder).is_dir():
        raise ValueError(f"--resume {str(folder)!r} is not a folder")
    if not path.is_file():
        raise ValueError(f"--resume {str(folder)!r}: no run_config.json there (mxmoe train in one process writes "
                         "it into its --out folder as the run starts)")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunInputError(f"--resume: {path} is not valid JSON ({e}); it is written by mxmoe train") from None
    if not isinstance(saved, dict):
        raise RunInputError(f"--resume: {path} does not hold a run's settings (a JSON object)")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{**{k: v for k, v in saved.items() if k in known}, "out": str(folder), "resume": str(folder),
                          "overwrite": False})


def same_run(a: dict, b: dict) -> bool:
    """Whether two config dicts describe the same computation (the :data:`RUN_PLACE` fields aside)."""
    return all(a.get(k) == b.get(k) for k in set(a) | set(b) if k not in RUN_PLACE)


def _umask() -> int:
    """The process's umask: from ``/proc/self/status`` where Linux has it (reading it changes nothing), else
    by setting it and putting it back at once (not safe against another thread creating files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _umask_mode(path: Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would: ``0o666`` less the umask (temp files,
    safetensors' among them, are created ``0o600``)."""
    os.chmod(path, 0o666 & ~_umask())


def save_model(weights: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    """``weights`` and ``metadata`` as a safetensors file at ``path``, written atomically (a temp file renamed
    over it) with the permissions of a plain file (``0o666`` less the umask).

    The same tensors and metadata give the same bytes: safetensors writes the metadata in the order of a
    Rust hash map, which changes from process to process, so the header is rewritten with the metadata's
    keys sorted (the tensors keep safetensors' own order; the header is padded to 8 bytes as safetensors pads it).
    """
    data = safetensors.torch.save(weights, metadata=metadata)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", None)
    if meta is not None:
        header = {"__metadata__": dict(sorted(meta.items())), **header}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            f.write(data[8 + n:])
            f.flush()
            os.fsync(f.fileno())
        _umask_mode(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# where a run writes, how it was started and how often it saves its state, not what it computes
RUN_PLACE = ("out", "resume", "overwrite", "checkpoint_every")

# what a run writes into --out; a folder holding any of them holds an earlier run
RUN_FILES = ("metrics.json", "loss.png", "run_config.json", "model_*.safetensors", "checkpoint_*.pt")


def run_files(folder: Path) -> list[Path]:
    """The files of a ``mxmoe train`` run in ``folder`` (:data:`RUN_FILES`), sorted; none if it is no folder."""
    if not folder.is_dir():
        return []
    return sorted({p for pattern in RUN_FILES for p in folder.glob(pattern) if p.is_file()})


def _mount_type(path: Path) -> str | None:
    """The file system type of the mount that holds ``path`` (``/proc/mounts``), None where unknown."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    p, best = str(path), ("", None)
    for m in mounts:
        if len(m) >= 3 and (p == m[1] or p.startswith(m[1].rstrip("/") + "/")) and len(m[1]) > len(best[0]):
            best = (m[1], m[2])
    return best[1]


def _why_not_created(out: Path, e: OSError) -> str:
    """The cause of a failed ``out.mkdir(parents=True)``, named from the nearest folder that exists."""
    parent = out.absolute()
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    virtual = _mount_type(parent)
    if e.errno == errno.EROFS or os.statvfs(parent).f_flag & os.ST_RDONLY:
        return f"{parent} is on a read-only file system"
    if virtual in ("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs", "devpts"):
        return (f"{parent} is on a {virtual} file system (virtual: it takes no new folders; mkdir said: "
                f"{e.strerror})")
    if e.errno in (errno.EACCES, errno.EPERM) or not os.access(parent, os.W_OK):
        return f"no permission to create a folder in {parent}"
    return e.strerror or str(e)


def prepare_out(cfg: TrainConfig, create: bool = True) -> list[Path]:
    """Check ``cfg.out`` for a run and (with ``create``) make it; returns the earlier run's files that the run
    replaces (``cfg.overwrite``), not yet deleted.

    A fresh run refuses a folder that holds an earlier run's files (:data:`RUN_FILES`: its models, metrics and
    training states would be overwritten or mixed with this run's) unless ``cfg.overwrite``; ``cfg.resume``
    continues the run in its folder.

    Raises:
        RunInputError: ``out`` is not a directory (a file, ``/dev/null``), cannot be created (the cause named:
            read-only or virtual file system, permissions), or holds an earlier run's files without
            ``overwrite`` or ``resume``.
    """
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise RunInputError(f"--out {cfg.out!r} is not a directory: give a folder (it is created if missing)")
    earlier = [] if cfg.resume else run_files(out)
    if earlier and not cfg.overwrite:
        names = ", ".join(p.name for p in earlier[:4]) + (f" and {len(earlier) - 4} more" if len(earlier) > 4 else "")
        raise RunInputError(f"--out {cfg.out!r} holds an earlier run's files ({names}): continue that run with "
                            f"`mxmoe train --resume {cfg.out}`, replace it with --overwrite, or give another --out")
    if create:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunInputError(f"--out {cfg.out!r} cannot be created: {_why_not_created(out, e)}") from None
    return earlier


def write_json_atomic(path: Path, obj) -> None:
    """``json.dumps(obj, indent=1)`` to ``path`` through a temp file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
