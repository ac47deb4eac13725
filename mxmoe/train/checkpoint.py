"""What a run leaves on disk besides its metrics: training states (``checkpoint_<recipe>.pt``, for
``--resume``), the run's settings (``run_config.json``) and the models (``model_<recipe>.safetensors``),
each written atomically."""

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

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
        ValueError: ``folder`` is not a folder, or holds no ``run_config.json`` (not a run with
            ``--checkpoint-every``).
    """
    path = Path(folder) / "run_config.json"
    if not Path(folder).is_dir():
        raise ValueError(f"--resume {str(folder)!r} is not a folder")
    if not path.is_file():
        raise ValueError(f"--resume {str(folder)!r}: no run_config.json there (it is written by a run with "
                         "--checkpoint-every N > 0 into its --out folder)")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunInputError(f"--resume: {path} is not valid JSON ({e}); it is written by mxmoe train") from None
    if not isinstance(saved, dict):
        raise RunInputError(f"--resume: {path} does not hold a run's settings (a JSON object)")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{**{k: v for k, v in saved.items() if k in known}, "out": str(folder), "resume": str(folder)})


def same_run(a: dict, b: dict) -> bool:
    """Whether two config dicts describe the same computation (``out`` and ``resume`` aside)."""
    return all(a.get(k) == b.get(k) for k in set(a) | set(b) if k not in ("out", "resume"))


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
    """``safetensors.torch.save_file`` (a temp file renamed over ``path``), with the permissions of a
    plain file (``0o666`` less the umask) instead of the temp file's ``0o600``."""
    save_file(weights, path, metadata=metadata)
    _umask_mode(Path(path))


def write_json_atomic(path: Path, obj) -> None:
    """``json.dumps(obj, indent=1)`` to ``path`` through a temp file renamed over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
