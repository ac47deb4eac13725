"""A trained model back from its ``model_<recipe>.safetensors`` (:func:`load_checkpoint`) and text sampled
from it (:func:`generate`, :func:`sample`; ``mxmoe sample``)."""

import dataclasses
import json
import math
import os
from pathlib import Path

import torch

from mxmoe.train.config import VOCAB, TrainConfig
from mxmoe.train.model import MoELM, autocast


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                    recipe: str | None = None) -> tuple[MoELM, TrainConfig, str]:
    """A model written by ``mxmoe train`` (``model_<recipe>.safetensors``), in eval mode on ``device``.

    The file's metadata holds the run's config and recipe; ``recipe`` overrides the latter (e.g. run
    a bf16-trained model's experts in MXFP8). Returns ``(model, config, recipe)``; in the config of a
    file written before those checks, a warmup longer than the steps is cut to them and a negative
    aux_loss_coef is 0.

    Raises:
        FileNotFoundError: no such file, or a folder (its model files named). ValueError: a safetensors file without ``mxmoe train``'s
            metadata, or whose tensors do not match its config.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("model_*.safetensors"))
        raise FileNotFoundError(f"{path} is a folder; give one of its model files, "
                                + (", ".join(str(path / n) for n in found) if found
                                   else "model_<recipe>.safetensors (none there)"))
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # noqa: BLE001 - safetensors' own error type for a file that is not one
        raise ValueError(f"{path} is not a safetensors model file ({str(e)[:100]}): give a "
                         "model_<recipe>.safetensors written by mxmoe train") from None
    if "config" not in meta or "recipe" not in meta:
        raise ValueError(f"{path} has no mxmoe train metadata (config, recipe): not written by mxmoe train")
    saved = json.loads(meta["config"])
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    fields = {k: v for k, v in saved.items() if k in known}
    # files of runs from before warmup <= steps and aux_loss_coef >= 0 were checked: training settings, not the model's
    if isinstance(fields.get("warmup"), int) and isinstance(fields.get("steps"), int):
        fields["warmup"] = min(fields["warmup"], fields["steps"])
    if isinstance(fields.get("aux_loss_coef"), (int, float)) and fields["aux_loss_coef"] < 0:
        fields["aux_loss_coef"] = 0.0
    cfg = TrainConfig(**fields)
    recipe = recipe or meta["recipe"]
    model = MoELM(cfg, recipe)
    try:
        model.load_state_dict(load_file(str(path)))
    except RuntimeError as e:
        raise ValueError(f"{path}: tensors do not match its config: {e}") from None
    return model.to(device).eval(), cfg, recipe


@torch.no_grad()
def generate(model: MoELM, prompt: bytes, tokens: int, temperature: float = 0.8, top_k: int | None = 200,
             seed: int = 0) -> bytes:
    """``tokens`` bytes sampled after ``prompt`` (the prompt itself not included).

    Each step feeds the last ``seq_len`` bytes (the model's context) and draws the next byte from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely bytes (None or 0: all
    256), with a CPU generator seeded by ``seed``, so a call is deterministic for a given model,
    device and seed. ``temperature == 0`` takes the most likely byte (greedy).

    Raises:
        ValueError: an empty prompt, ``tokens < 0``, a negative or non-finite ``temperature``, ``top_k < 0``.
    """
    if not prompt:
        raise ValueError("the prompt is empty: give at least one byte (e.g. b'\\n')")
    bad = ([f"tokens must be >= 0, got {tokens}"] * (tokens < 0)
           + [f"temperature must be finite and >= 0, got {temperature}"] * (not 0 <= temperature < math.inf)
           + [f"top_k must be >= 0, got {top_k}"] * (top_k is not None and top_k < 0))
    if bad:  # NaN and inf temperatures would sample from NaN or uniform probabilities
        raise ValueError("; ".join(bad))
    was_training = model.training
    model.eval()
    device = model.head.weight.device
    context = model.pos.num_embeddings
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor(list(prompt), dtype=torch.long)  # [P]
    out = []
    with autocast(device):
        for _ in range(tokens):
            logits = model.logits(idx[-context:].unsqueeze(0).to(device))[0, -1].cpu()  # [V] FP32
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, VOCAB)).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            out.append(nxt)
            idx = torch.cat([idx, torch.tensor([nxt])])
    model.train(was_training)
    return bytes(out)


def sample(ckpt: str | os.PathLike, prompt: str = "\n", tokens: int = 200, temperature: float = 0.8,
           top_k: int | None = 200, seed: int = 0, device: str = "cpu", recipe: str | None = None) -> str:
    """Load a ``mxmoe train`` checkpoint and continue ``prompt`` (UTF-8) by ``tokens`` sampled bytes.

    Returns the prompt followed by the sample, decoded as UTF-8 (a byte sequence that is not valid
    UTF-8 shows as U+FFFD). Raises as :func:`load_checkpoint` and :func:`generate`.
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    model, _, _ = load_checkpoint(ckpt, device, recipe)
    data = prompt.encode()
    return (data + generate(model, data, tokens, temperature, top_k, seed)).decode("utf-8", errors="replace")

