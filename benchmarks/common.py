"""What the benchmark suites share: the reference shapes, the result file's header, timing, writing.

A suite's result file (``benchmarks/results/<gpu>/<suite>.json``) is ``{"header": header(...), "rows": [...]}``:
the header says where and with what the rows were measured (date, GPU, driver, torch, triton, the peers'
versions, the git commit and whether the tree had uncommitted changes), the rows hold ours and the peers'
figures of that one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
LAYER_TOKENS = 16384  # tokens per layer step of the layer suite


@dataclass(frozen=True)
class Shape:
    """A DESIGN §5 reference shape as one GPU sees it after expert parallelism: ``experts`` local experts,
    ``rows`` routed rows (tokens x local top-k), ``hidden`` model dim, ``ffn`` expert FFN dim."""

    experts: int
    rows: int
    hidden: int
    ffn: int

    @property
    def top_k(self) -> int:
        """Local top-k of the layer suite's ``LAYER_TOKENS`` tokens (routed rows per token on this GPU)."""
        return self.rows // LAYER_TOKENS

    def proj(self, proj: str) -> tuple[int, int]:
        """(N, K) of an expert projection: up (N = 2 x FFN, gate and up fused; K = hidden), down (N = hidden,
        K = FFN)."""
        if proj == "up":
            return 2 * self.ffn, self.hidden
        if proj == "down":
            return self.hidden, self.ffn
        raise ValueError(f"proj must be 'up' or 'down', got {proj!r}")


# DESIGN §5. dsv3-ep32: 8 local experts of 256, top-8 globally, ~2 routed rows per token per GPU.
# dsv3-671b-ep8: one rank of EP 8 (32 local experts of 256, top-8), 131072 routed rows over its 32 experts.
SHAPES: dict[str, Shape] = {
    "mixtral-8x7b": Shape(8, 32768, 4096, 14336),
    "llama4-scout": Shape(16, 16384, 5120, 8192),
    "dsv3-ep32": Shape(8, 32768, 7168, 2048),
    "qwen3-30b-a3b": Shape(128, 131072, 2048, 768),
    "dsv3-16b": Shape(64, 98304, 2048, 1408),
    "dsv3-671b-ep8": Shape(32, 131072, 7168, 2048),
}
QUICK_SHAPES = ("dsv3-ep32",)  # --quick: one shape whose products are neither the smallest nor the largest


def shape_list(arg: str | None, quick: bool) -> list[str]:
    """The shapes of a ``--shapes`` argument (comma-separated names; default all, or QUICK_SHAPES under
    --quick). Raises SystemExit naming the known shapes for an unknown one."""
    names = arg.split(",") if arg else list(QUICK_SHAPES if quick else SHAPES)
    bad = [n for n in names if n not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shape(s) {', '.join(bad)}; known: {', '.join(SHAPES)}")
    return names


def gpu_slug(name: str | None = None) -> str:
    """Short folder name of a GPU: ``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``; ``cpu`` without a CUDA device."""
    if name is None:
        if not torch.cuda.is_available():
            return "cpu"
        name = torch.cuda.get_device_name()
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    if len(words) >= 2 and words[0] == "rtx":
        words = [words[0] + words[1]]
    return re.sub(r"[^a-z0-9]", "", words[0]) if words else "gpu"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def peer_versions() -> dict[str, str]:
    """Versions of the peers the suites compare against, those that import (torchao, torchtitan)."""
    out = {}
    for mod in ("torchao", "torchtitan"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001  (a peer that does not import is simply absent)
            pass
    return out


def header(suite: str, quick: bool, **extra) -> dict:
    """The result file's header for a run of ``suite`` now: date (UTC), gpu, driver, cuda, torch, triton,
    python, peers, git commit and dirty flag, the mxmoe package the run imported (``mxmoe_tree``: its folder,
    relative to the repository when inside it, so a baseline timed from another tree first on ``PYTHONPATH``
    says so), the command line; ``extra`` (timing notes, settings) on top. ``MXMOE_COMMIT`` names the commit
    where ``git`` cannot (the device machines' copy of .git is stale)."""
    import mxmoe
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    head = {"suite": suite, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "driver": _driver(),
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(), "peers": peer_versions(),
            "git": {"commit": os.environ.get("MXMOE_COMMIT") or _git("rev-parse", "--short=12", "HEAD"),
                    "dirty": bool(status) if status is not None and not os.environ.get("MXMOE_COMMIT") else None},
            "mxmoe_tree": _relative_to_repo(Path(mxmoe.__file__).resolve().parent), "quick": quick,
            "argv": sys.argv[1:]}
    head.update(extra)
    return head


def _relative_to_repo(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def kernel_launches(prof) -> list[tuple[str, float]]:
    """A torch profile's CUDA kernel launches in launch order, each as (kernel name, its device time in ms)."""
    launches = sorted((e.time_range.start, e.name, e.device_time_total / 1e3) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0)
    return [(name, ms) for _, name, ms in launches]


def write_result(path: str | os.PathLike, head: dict, rows: list[dict]) -> None:
    """Write ``{"header": head, "rows": rows}`` to ``path`` (folders made); suites call it after every case,
    so a run cut short keeps what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"header": head, "rows": rows}, indent=1, default=str) + "\n")
    tmp.replace(path)


def default_out(suite: str) -> str:
    """``benchmarks/results/<gpu>/<suite>.json`` for this machine's GPU."""
    return str(RESULTS / gpu_slug() / f"{suite}.json")


def parser(suite: str, doc: str | None) -> argparse.ArgumentParser:
    """An ArgumentParser with the options every suite takes: ``--quick`` and ``--out PATH``."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks {suite}", description=(doc or "").split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: one shape, few repetitions (< 1 min)")
    ap.add_argument("--out", default=None, help=f"result file (default benchmarks/results/<gpu>/{suite}.json)")
    return ap


def require_cuda(suite: str) -> None:
    """Raise SystemExit unless a CUDA GPU is present (the suites time GPU kernels)."""
    if not torch.cuda.is_available():
        raise SystemExit(f"the {suite} suite needs a CUDA GPU (none found)")


def bench_ms(fn, quick: bool = False, graph: bool = False) -> float:
    """Median ms of ``fn``: ``triton.testing.do_bench`` (each call timed alone, L2 cleared before it; a call
    whose host work outlasts its kernels is timed by its host work) or, with ``graph``, ``do_bench_cudagraph``
    (calls replayed from a CUDA graph: the kernels' own time, no L2 clearing)."""
    import triton.testing

    rep = 30 if quick else 100
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=rep, return_mode="median")


def token_counts(M: int, E: int, balance: str, gen: torch.Generator, unit: int = 32) -> list[int]:
    """Rows per expert, multiples of ``unit`` summing to M. ``balanced``: equal; ``skewed``: Zipf(1.2) over a
    random expert order, the last eighth of that order (at least one expert) empty."""
    if balance not in ("balanced", "skewed"):
        raise ValueError(f"balance must be 'balanced' or 'skewed', got {balance!r}")
    units = M // unit
    if balance == "balanced":
        w = torch.ones(E, dtype=torch.float64)
    else:
        ranks = torch.randperm(E, generator=gen).double() + 1
        w = ranks ** -1.2
        w[torch.argsort(ranks)[-max(1, E // 8):]] = 0
    q = torch.floor(w / w.sum() * units).long()
    q[int(torch.argmax(w))] += units - int(q.sum())
    return [int(v) * unit for v in q]


def rand_fp8(*shape, device="cuda") -> torch.Tensor:
    """Random E4M3 values (N(0, 1) cast)."""
    return torch.randn(*shape, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)


def rand_scale(*shape, device="cuda") -> torch.Tensor:
    """Random E8M0 scales around 1 (2^-7 .. 2^7)."""
    return torch.randint(120, 135, shape, device=device, dtype=torch.uint8).view(torch.float8_e8m0fnu)
