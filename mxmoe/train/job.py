"""One ``mxmoe train`` run end to end (:func:`run`): data, a shared init, every recipe's training, the outputs."""

import dataclasses
import json
import platform
import sysconfig
from pathlib import Path

import torch

from mxmoe import parallel
from mxmoe.corpus import load_corpus, python_roots
from mxmoe.train.checkpoint import (CHECKPOINT_FORMAT, RUN_PLACE, load_training_state, prepare_out, same_run,
                                    save_model, save_training_state, write_json_atomic)
from mxmoe.train.config import GRAPH_BACKENDS, PEAK_FLOPS, RunInputError, TrainConfig, compile_backend, parse_recipes
from mxmoe.train.data import tokens_per_step
from mxmoe.train.distributed import full_state_dict, init_expert_parallel
from mxmoe.train.loop import StopRequest, stop_on_signals, train_recipe
from mxmoe.train.model import MoELM, count_params
from mxmoe.train.report import model_flops_per_token, plot_losses, seed_spread, summarize


def run(cfg: TrainConfig) -> dict:
    """Train every recipe of ``cfg.recipes`` from one init on one batch order; write the outputs.

    Under torchrun with more than one process: joins the process group, trains expert-parallel,
    has rank 0 print and write, and destroys the group at the end.
    The ``cfg.out`` folder (:func:`prepare_out`): a fresh run refuses one that holds an earlier run's files;
    with ``cfg.overwrite`` it deletes them first. In one process the run writes ``run_config.json``, then
    training states (:func:`train_recipe`) every ``cfg.checkpoint_every`` steps and when SIGINT or SIGTERM
    arrives (it then stops: :class:`Interrupted`; a second signal stops at once); a finished recipe's state
    keeps only its metrics. With ``cfg.resume``: finished recipes are taken from their states, an unfinished
    one continues from its state. Returns the metrics dict that is also written to ``<cfg.out>/metrics.json``.

    Raises:
        RunInputError (a ValueError): an ``out`` that is no folder, cannot be created or holds an earlier run
            (:func:`prepare_out`); ``cfg.resume`` with a damaged state or one of other settings than
            ``cfg``'s; data that cannot feed the run (too few files, a split shorter than a window).
        Interrupted: SIGINT / SIGTERM during training (single process): the state is saved for ``--resume``.
    """
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    ep, device = init_expert_parallel(cfg, device)
    main_rank = ep.rank == 0  # prints and writes
    recipes = parse_recipes(cfg.recipes)
    out = Path(cfg.out)
    config = dataclasses.asdict(cfg)
    earlier = prepare_out(cfg, create=main_rank)  # every rank checks; rank 0 creates
    states = {}
    if cfg.resume:
        for recipe in recipes:
            if (out / f"checkpoint_{recipe}.pt").is_file():
                states[recipe] = load_training_state(out / f"checkpoint_{recipe}.pt", device)
                if not same_run(json.loads(states[recipe]["config"]), config):
                    theirs = json.loads(states[recipe]["config"])
                    differ = sorted(k for k in config if k not in RUN_PLACE and theirs.get(k) != config[k])
                    raise RunInputError(f"{out / f'checkpoint_{recipe}.pt'} was written by a run of other settings "
                                        f"than {out / 'run_config.json'} (differ: {', '.join(differ) or 'unknown'})")
    if main_rank and not cfg.resume:
        for p in earlier:  # --overwrite: none of the earlier run's models, metrics or states stay beside this one's
            p.unlink()
        if earlier:
            print(f"--overwrite: removed an earlier run's files from {out}: {', '.join(p.name for p in earlier)}")
        if ep.group is None:  # what --resume runs
            write_json_atomic(out / "run_config.json", config)
    try:
        corpus = load_corpus(cfg.data, device.type, cfg.val_every_file, cfg.data_cache)
    except ValueError as e:
        raise RunInputError(f"--data {cfg.data!r}: {e} (one file in --val-every-file goes to validation)") from None
    train_data, val_data = corpus.train, corpus.val
    for split, d in (("train", train_data), ("validation", val_data)):
        if len(d) <= cfg.seq_len + 1:
            raise RunInputError(f"--data {cfg.data!r}: the {split} split has {len(d):,} bytes, fewer than a window of "
                                f"--seq-len {cfg.seq_len} + 2: give more data or a shorter --seq-len")
    torch.manual_seed(cfg.seed)
    init_model = MoELM(cfg, recipes[0])
    init_state = {k: v.detach().clone() for k, v in init_model.state_dict().items()}
    params = count_params(init_model, cfg)
    del init_model
    tokens = cfg.steps * tokens_per_step(cfg) * ep.size
    data = {**corpus.info(), "tokens_per_recipe": tokens, "epochs_per_recipe": tokens / len(train_data)}
    backend = compile_backend(cfg, device, ep.size)
    if main_rank:
        ranks = f" x {ep.size} ranks, expert parallel" if ep.group is not None else ""
        cached = f", from the cache {corpus.cache}" if corpus.from_cache else (f", cached to {corpus.cache}"
                                                                               if corpus.cache else "")
        dups = f", {corpus.duplicates:,} duplicate files skipped" if corpus.duplicates else ""
        read = f"{tokens / 1e6:.1f}M" if tokens >= 1e6 else f"{tokens:,}"
        print(f"data: {corpus.source}: {corpus.files['train']:,} train / {corpus.files['val']:,} val files, "
              f"{len(train_data) / 1e6:.1f}M / {len(val_data) / 1e6:.1f}M bytes{dups}{cached}; "
              f"a recipe's run reads {read} tokens = {data['epochs_per_recipe']:.3g} epochs of the "
              f"train split" + (" (more than one pass: the model can memorize it)" if data["epochs_per_recipe"] >= 1
                                else ""))
        print(f"params: {params['total'] / 1e6:.2f}M total, {params['active_per_token'] / 1e6:.2f}M active "
              f"per token | device: {device}{ranks} | recipes: {', '.join(recipes)} | steps: "
              + (f"torch.compile backend {backend}" + (" (CUDA graphs)" if backend in GRAPH_BACKENDS else "")
                 if backend else "eager")
              + (" | no checkpoints (single-process only)" if ep.group is not None else
                 f" | checkpoints every {cfg.checkpoint_every} steps in {out}" if cfg.checkpoint_every else
                 f" | checkpoints on SIGINT / SIGTERM in {out}")
              + (" | resumed: " + ", ".join(f"{r} at step {s.get('step', cfg.steps)}" for r, s in states.items())
                 if states else ""))
    where = {"stdlib": sysconfig.get_paths()["stdlib"], "python-all": "python-all: " + ", ".join(python_roots())}
    env = {"device": str(device), "world_size": ep.size, "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "data": where.get(corpus.source, str(Path(corpus.source))),
           "platform": platform.platform(), "threads": torch.get_num_threads(),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    flops = model_flops_per_token(cfg)
    metrics = {"config": config, "env": env, "params": params,
               "data_bytes": {"train": len(train_data), "val": len(val_data)}, "data": data,
               "model_flops_per_token": flops, "peak_flops": PEAK_FLOPS, "recipes": {}}
    # the models' metadata: the settings that made them (not where they were written, nor how the run was started),
    # so the same weights give the same file
    model_config = json.dumps({k: v for k, v in config.items() if k not in RUN_PLACE})
    stop = StopRequest()
    with stop_on_signals(stop, enabled=ep.group is None):
        for recipe in recipes:
            _train_one(cfg, recipe, states.get(recipe), init_state, train_data, val_data, device, ep, stop,
                       out, metrics, flops, model_config, main_rank)
    if "bf16" in metrics["recipes"]:
        ref = metrics["recipes"]["bf16"]["val_loss"][-1]
        metrics["val_gap_vs_bf16_pct"] = {r: 100 * (m["val_loss"][-1] - ref) / ref
                                          for r, m in metrics["recipes"].items() if r != "bf16"}
        spread = seed_spread(metrics["config"])
        if spread is not None:
            metrics["seed_spread"] = {k: spread[k] for k in ("preset", "seeds", "bf16_val", "spread", "gaps",
                                                             "data", "python")}
    if main_rank:
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
        plot_losses(metrics, out / "loss.png")
        print(summarize(metrics))
        print(f"wrote {out / 'metrics.json'}, {out / 'loss.png'}, "
              + ", ".join(str(out / f"model_{r}.safetensors") for r in recipes)
              + (f" (resume checkpoints and run_config.json: {out})" if ep.group is None else ""))
    if ep.group is not None:
        parallel.shutdown_distributed()
    return metrics


def _train_one(cfg: TrainConfig, recipe: str, state: dict | None, init_state: dict, train_data: torch.Tensor,
               val_data: torch.Tensor, device: torch.device, ep, stop: StopRequest, out: Path, metrics: dict,
               flops: float, model_config: str, main_rank: bool) -> None:
    """One recipe of :func:`run`: taken from its finished state, or trained (from ``state`` when resumed);
    its metrics go into ``metrics["recipes"]``, its model to ``model_<recipe>.safetensors``."""
    if state is not None and state["done"]:
        metrics["recipes"][recipe] = state["metrics"]
        return
    config = metrics["config"]
    ckpt = out / f"checkpoint_{recipe}.pt" if ep.group is None else None
    model, m = train_recipe(cfg, recipe, init_state, train_data, val_data, device, ep, state, ckpt, stop=stop)
    m["mfu"] = m["tokens_per_s"] * flops / PEAK_FLOPS if device.type == "cuda" else None
    metrics["recipes"][recipe] = m
    weights = full_state_dict(model, ep)  # every rank takes part; rank 0 writes
    if main_rank:
        save_model(weights, out / f"model_{recipe}.safetensors",
                   metadata={"recipe": recipe, "config": model_config})
        if ckpt is not None:  # finished: the metrics alone (the weights are in the safetensors file)
            save_training_state(ckpt, {"format": CHECKPOINT_FORMAT, "recipe": recipe, "done": True,
                                       "config": json.dumps(config), "metrics": m})
    del model, weights
