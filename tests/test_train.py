"""The main job, ``mxmoe train``, end to end on the ``tiny`` preset (seconds on a CPU)."""

import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mxmoe.cli import main
from mxmoe.corpus import load_stdlib
from mxmoe.train import MoELM, make_config

STEPS = 40


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    assert main(["train", "--preset", "tiny", "--steps", str(STEPS), "--eval-every", "20",
                 "--device", "cpu", "--out", str(out)]) == 0
    return out


def test_metrics(run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["config"]["steps"] == STEPS and metrics["env"]["torch"] == torch.__version__
    assert set(metrics["recipes"]) == {"bf16", "mxfp8"}
    for m in metrics["recipes"].values():
        assert len(m["train_loss"]) == STEPS and len(m["aux_loss"]) == STEPS
        assert m["val_step"] == [0, 20, 40] and len(m["val_loss"]) == 3
        assert all(math.isfinite(x) for x in m["train_loss"] + m["val_loss"] + m["aux_loss"])
        assert m["tokens_per_s"] > 0 and m["wall_s"] > 0 and m["peak_mem_gib"] is None
    bf16, mx = metrics["recipes"]["bf16"], metrics["recipes"]["mxfp8"]
    # same init and same batches: the step-0 losses differ only by MXFP8 rounding
    assert bf16["val_loss"][0] == pytest.approx(mx["val_loss"][0], rel=0.01)
    assert bf16["train_loss"][0] == pytest.approx(mx["train_loss"][0], rel=0.01)
    # untrained bytes: ~ln(256) = 5.55 nats; a short run must make clear progress
    assert bf16["val_loss"][0] > 5.0
    for m in (bf16, mx):
        assert m["val_loss"][-1] < m["val_loss"][0] - 1.5
        assert sum(m["train_loss"][-10:]) / 10 < sum(m["train_loss"][:10]) / 10 - 1.0
    assert "mxfp8" in metrics["val_gap_vs_bf16_pct"]
    from mxmoe.train import summarize

    table = summarize(metrics)
    assert "ref tok/s" in table and "pure-torch reference" in table
    assert "no seed-to-seed spread is stored" in table  # the tiny preset has none


def test_plot_and_checkpoints(run_dir):
    from safetensors.torch import load_file

    png = (run_dir / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    cfg = make_config("tiny")
    expected = set(MoELM(cfg, "bf16").state_dict())
    for recipe in ("bf16", "mxfp8"):
        state = load_file(run_dir / f"model_{recipe}.safetensors")
        assert set(state) == expected
        assert state["tok.weight"].shape == (256, cfg.dim)
        model = MoELM(cfg, recipe)
        model.load_state_dict(state)  # the checkpoint restores a model
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def torchrun_train(out, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node <nproc> -m mxmoe train --preset tiny --device cpu ...``
    in a subprocess (gloo), from this checkout."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "mxmoe", "train", "--preset", "tiny", "--device", "cpu", "--out", str(out), *args]
    return subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)


def test_torchrun_expert_parallel(run_dir, tmp_path):
    """Two CPU processes: experts split 2 + 2, rank 0 alone prints and writes, full checkpoints.

    Each rank evaluates 1 batch, rank r batch r of the seeded validation stream, so at step 0 (same
    init) the mean over ranks is the single-process validation loss over 2 batches (run_dir's).
    """
    steps = 10
    proc = torchrun_train(tmp_path, "--steps", str(steps), "--eval-every", str(steps), "--eval-batches", "1")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("wrote ") == 1 and proc.stdout.count("recipe ") == 1  # rank 0 only
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    single = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["env"]["world_size"] == 2 and set(metrics["recipes"]) == {"bf16", "mxfp8"}
    for recipe, m in metrics["recipes"].items():
        assert len(m["train_loss"]) == steps and m["val_step"] == [0, steps]
        assert all(math.isfinite(x) for x in m["train_loss"] + m["val_loss"] + m["aux_loss"])
        assert m["tokens_per_s"] > 0
        assert m["val_loss"][0] == pytest.approx(single["recipes"][recipe]["val_loss"][0], rel=1e-5)
        assert m["val_loss"][-1] < m["val_loss"][0] - 0.5
    from safetensors.torch import load_file

    cfg = make_config("tiny")
    for recipe in ("bf16", "mxfp8"):
        state = load_file(tmp_path / f"model_{recipe}.safetensors")
        want = load_file(run_dir / f"model_{recipe}.safetensors")
        assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in want.items()}
        MoELM(cfg, recipe).load_state_dict(state)  # loadable single-process


def test_torchrun_experts_not_divisible(tmp_path):
    proc = torchrun_train(tmp_path, "--experts", "3", "--steps", "1")
    assert proc.returncode != 0
    # each rank: a usage error (exit 2), not a traceback
    assert proc.stderr.count("mxmoe train: error: --experts 3 is not divisible by the 2 torchrun processes") == 2
    assert "ValueError" not in proc.stderr  # (torchrun's launcher prints its own traceback of the failed ranks)
    assert not (tmp_path / "metrics.json").exists()


def test_data_split_is_deterministic():
    train, val = load_stdlib(20)
    train2, val2 = load_stdlib(20)
    assert train.dtype == torch.uint8 and len(train) > 10 * len(val) > 0
    assert torch.equal(val, val2) and torch.equal(train[:4096], train2[:4096])


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--steps", "--out", "--device", "--dim", "--layers", "--heads", "--experts", "--top-k",
                 "--ffn-dim", "--seq-len", "--batch-size", "--lr", "--seed", "--recipes", "--eval-every",
                 "--eval-batches", "--preset"):
        assert flag in help_text


def test_compile_trains_the_same_model(tmp_path):
    """--compile: the compiled forward trains the model's own parameters. aot_eager runs the same
    kernels as eager, so the losses match the eager run bit for bit (inductor on CUDA fuses and
    may round differently; that is covered by the GPU preset runs, not here)."""
    steps = 6
    out = {}
    for backend in ("", "aot_eager"):
        d = tmp_path / (backend or "eager")
        assert main(["train", "--preset", "tiny", "--steps", str(steps), "--eval-every", str(steps),
                     "--recipes", "mxfp8", "--device", "cpu", "--compile", backend, "--out", str(d)]) == 0
        out[backend] = json.loads((d / "metrics.json").read_text())["recipes"]["mxfp8"]
    assert out["aot_eager"]["train_loss"] == out[""]["train_loss"]
    assert out["aot_eager"]["val_loss"] == out[""]["val_loss"]
    assert out[""]["train_loss"][0] != out[""]["train_loss"][-1]  # it trained


def test_grad_accum_trains_like_one_big_batch(tmp_path):
    """--grad-accum 2 of 4 windows reads the same 8 windows per step as --batch-size 8 (one seeded
    stream) and steps on the mean of the two micro-batches' gradients: with the load-balancing loss off
    (its batch statistics are per micro-batch) the fp32 run matches the big batch up to summation order;
    tokens/s and the throughput rows count every micro-batch."""
    from safetensors.torch import load_file

    from mxmoe.train import throughput_rows

    steps, out = 4, {}
    for name, flags in (("big", ["--batch-size", "8"]), ("accum", ["--batch-size", "4", "--grad-accum", "2"])):
        d = tmp_path / name
        assert main(["train", "--preset", "tiny", "--steps", str(steps), "--eval-every", str(steps),
                     "--recipes", "fp32", "--aux-loss-coef", "0", "--device", "cpu", "--out", str(d), *flags]) == 0
        out[name] = json.loads((d / "metrics.json").read_text())
    big, accum = out["big"]["recipes"]["fp32"], out["accum"]["recipes"]["fp32"]
    assert accum["train_loss"] == pytest.approx(big["train_loss"], rel=1e-5)
    a, b = (load_file(tmp_path / n / "model_fp32.safetensors") for n in ("accum", "big"))
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=2e-5) for k in b)  # validation: other batches (of 4)
    assert accum["train_loss"][-1] != big["train_loss"][0]  # it trained
    assert out["accum"]["data"]["tokens_per_recipe"] == out["big"]["data"]["tokens_per_recipe"] == steps * 8 * 64
    assert throughput_rows(out["accum"])[0]["tokens_per_step"] == 8 * 64
    # the micro-batch size is what the step's layers see: a lone batch of 4 trains to other numbers
    d = tmp_path / "small"
    assert main(["train", "--preset", "tiny", "--steps", str(steps), "--eval-every", str(steps), "--recipes", "fp32",
                 "--aux-loss-coef", "0", "--device", "cpu", "--out", str(d), "--batch-size", "4"]) == 0
    small = json.loads((d / "metrics.json").read_text())["recipes"]["fp32"]
    assert small["train_loss"][1:] != pytest.approx(big["train_loss"][1:], rel=1e-3)
    with pytest.raises(ValueError, match="grad_accum must be a positive int"):
        make_config("tiny", grad_accum=0)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["cudagraphs", "inductor-cudagraphs"])
def test_gpu_cudagraphs_trains_like_eager(tmp_path, graphs):
    """--compile cudagraphs / inductor-cudagraphs on CUDA: the step replays from CUDA graphs (no graph
    skipped for a CPU tensor) and trains like eager. cudagraphs runs the same kernels, inductor fuses
    torch's elementwise work (other roundings), and torch's atomics make GPU runs not bitwise
    reproducible, so: the first step's loss agrees to 1e-4 (inductor: 1e-3), the last to 2%."""
    from torch._dynamo.utils import counters

    steps = 20
    out = {}
    counters.clear()
    for backend in ("", graphs):
        d = tmp_path / (backend or "eager")
        assert main(["train", "--preset", "tiny", "--steps", str(steps), "--eval-every", str(steps),
                     "--recipes", "mxfp8", "--device", "cuda", "--compile", backend, "--out", str(d)]) == 0
        out[backend] = json.loads((d / "metrics.json").read_text())["recipes"]["mxfp8"]["train_loss"]
    assert counters["inductor"]["cudagraph_skips"] == 0
    eager, replayed = out[""], out[graphs]
    tol = 1e-4 if graphs == "cudagraphs" else 1e-3
    assert abs(replayed[0] - eager[0]) <= tol * abs(eager[0]), (replayed[0], eager[0])
    assert abs(replayed[-1] - eager[-1]) <= 0.02 * abs(eager[-1]), (replayed[-1], eager[-1])
    assert replayed[-1] < replayed[0]  # it trained


@pytest.mark.gpu
def test_gpu_grad_accum_under_cuda_graphs():
    """Micro-batches replayed from CUDA graphs accumulate the gradients eager accumulates: a replay's
    gradient outputs live in the graphs' memory pool, so a later micro-batch must not overwrite the
    ``.grad`` kept from an earlier one (that would give 2 g1 + ... instead of g0 + g1 + ...). Checked on
    the third step too, after the graphs were recorded; inductor rounds its fusions differently, so
    per-tensor relative error <= 3e-2 (the overwrite is an O(1) error)."""
    from mxmoe.train import compiled, forward_backward, get_batch

    cfg, dev = make_config("tiny"), torch.device("cuda")
    torch.manual_seed(0)
    eager = MoELM(cfg, "mxfp8").to(dev)
    graphed_model = MoELM(cfg, "mxfp8").to(dev)
    graphed_model.load_state_dict(eager.state_dict())
    graphed = compiled(graphed_model, "inductor-cudagraphs")
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (1 << 16,), generator=gen, dtype=torch.uint8)
    for step in range(3):
        batches = [get_batch(data, cfg.batch_size, cfg.seq_len, gen, dev) for _ in range(3)]
        got = forward_backward(graphed, iter(batches), 3, "inductor-cudagraphs", dev, list(graphed_model.parameters()))
        want = forward_backward(eager, iter(batches), 3, "", dev, list(eager.parameters()))
        assert torch.allclose(got[0], want[0], rtol=1e-3), (step, got, want)
        for (name, p), q in zip(eager.named_parameters(), graphed_model.parameters()):
            err = ((q.grad - p.grad).norm() / p.grad.norm()).item()
            assert err <= 3e-2, (step, name, err)
        for m in (eager, graphed_model):
            m.zero_grad(set_to_none=True)


def test_config_checks(monkeypatch):
    make_config("tiny", compile="inductor", device="cpu", recipes="bf16")  # bf16 compiles on the CPU
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: refused before any process group work
    with pytest.raises(ValueError, match="expert parallelism"):
        make_config("tiny", compile="aot_eager")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError):
        make_config("tiny", ffn_dim=48)
    cfg = make_config("tiny", dim=96, ffn_dim=72, recipes="fp32,bf16")  # no MX recipe: multiples of 8 suffice
    assert (cfg.dim, cfg.ffn_dim) == (96, 72)
    with pytest.raises(ValueError):
        make_config("tiny", steps=0)
    with pytest.raises(ValueError):
        make_config("nope")
    with pytest.raises(ValueError, match="eval_batches must be a positive int, got 1.5"):
        make_config("tiny", eval_batches=1.5)
    # a preset's warmup is cut to a shorter --steps; a warmup given longer than the steps is an error
    assert make_config("tiny", steps=2).warmup == 2 and make_config("tiny", steps=40).warmup == 5
    assert make_config("tiny", steps=2, warmup=2).warmup == 2
    with pytest.raises(ValueError, match=r"warmup must be in \[0, steps=2\]"):
        make_config("tiny", steps=2, warmup=3)


def test_wall_time_leaves_out_process_one_offs():
    """A recipe's wall_s starts after the process's one-off costs (torch._dynamo's import, seconds, that
    the first optimizer triggers): the first recipe's wall time is not the process's start-up."""
    script = """if True:
        import sys, time, torch
        from mxmoe import train
        assert "torch._dynamo" not in sys.modules, "the check needs a process without torch._dynamo"
        cfg = train.make_config("tiny", steps=1, eval_every=1, eval_batches=1, recipes="bf16", device="cpu")
        data = torch.randint(0, 256, (2000,), dtype=torch.uint8)
        init = train.MoELM(cfg, "bf16").state_dict()
        seen, real = [], time.perf_counter
        def perf_counter():
            seen.append("torch._dynamo" in sys.modules)
            return real()
        time.perf_counter = perf_counter  # train_recipe's first call starts wall_s
        train.train_recipe(cfg, "bf16", init, data, data, torch.device("cpu"))
        print("dynamo imported when wall_s started:", seen[0])
    """
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dynamo imported when wall_s started: True" in proc.stdout


@pytest.mark.parametrize("flags,msg", [
    (["--batch-size", "0"], "batch_size must be a positive int, got 0"),
    (["--eval-batches", "0"], "eval_batches must be a positive int, got 0"),
    (["--eval-batches", "-2"], "eval_batches must be a positive int, got -2"),
    (["--steps", "40", "--warmup", "41"], "warmup must be in [0, steps=40]"),
    (["--warmup", "-1"], "warmup must be in [0, steps=40]"),
    (["--aux-loss-coef", "-0.01"], "aux_loss_coef must be a finite value >= 0, got -0.01"),
    (["--aux-loss-coef", "nan"], "aux_loss_coef must be a finite value >= 0, got nan"),
    (["--lr", "inf"], "lr must be a finite value > 0, got inf"),
    (["--weight-decay", "inf"], "weight_decay must be a finite value >= 0, got inf"),
    (["--recipes", "bf16,,mxfp8"], "has an empty name"),
    (["--recipes", "bf16,mxfp8,"], "has an empty name"),
    (["--recipes", "bf16,bf16"], "names a recipe twice"),
    (["--data", "/nonexistent/folder"], "is not a folder (nor one of stdlib, python-all)"),
    (["--checkpoint-every", "-1"], "checkpoint_every must be >= 0"),
    (["--recipes", "bf16,mxfp9"], "unknown recipe 'mxfp9'"),
    (["--val-every-file", "1"], "val_every_file"),
    (["--experts", "3", "--top-k", "5"], "top_k 5"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--compile", "nope"], "compile backend 'nope': use one of inductor, inductor-cudagraphs, cudagraphs, aot_eager, eager"),
    (["--compile", "inductor", "--device", "cpu"], "cannot compile the MX recipes"),
    (["--compile", "cudagraphs", "--device", "cpu"], "needs --device cuda"),
    (["--compile", "inductor-cudagraphs", "--device", "cpu"], "needs --device cuda"),
    (["--lr", "-1"], "lr must be a finite value > 0, got -1.0"),
    (["--min-lr-frac", "2"], "min_lr_frac must be in [0, 1], got 2.0"),
    (["--grad-clip", "0"], "grad_clip must be > 0, got 0.0"),
    (["--grad-accum", "0"], "grad_accum must be a positive int, got 0"),
    (["--dim", "96", "--ffn-dim", "72", "--recipes", "bf16,mxfp8"], "the mxfp8 recipe needs dim and ffn_dim divisible by 32 (MXFP8 scale groups), got 96 and 72"),
    (["--dim", "100", "--heads", "4", "--recipes", "fp32,bf16"], "the bf16 recipe needs dim and ffn_dim divisible by 8 (16-byte BF16 rows), got 100 and"),
])
def test_cli_rejects_bad_flags_before_training(flags, msg, capsys, tmp_path):
    from mxmoe.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "tiny", "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err and "usage: mxmoe train" in err  # the subcommand's usage
    assert not (tmp_path / "o").exists()  # nothing trained, nothing written


def test_cli_rejects_an_output_folder_it_cannot_create(capsys, tmp_path):
    from mxmoe.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the output folder's parent should be
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "tiny", "--out", str(blocker / "o")])
    assert e.value.code == 2 and "cannot be created" in capsys.readouterr().err


def test_output_files_honor_the_umask(run_dir, tmp_path):
    """Model files get a plain file's mode (0o666 less the umask), not the 0o600 of safetensors' temp file."""
    from mxmoe.train import save_model

    umask = os.umask(0o027)
    os.umask(umask)
    for name in ("model_bf16.safetensors", "model_mxfp8.safetensors", "metrics.json"):
        assert (run_dir / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    old = os.umask(0o027)
    try:
        save_model({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"recipe": "bf16"})
    finally:
        os.umask(old)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o640


def test_older_model_files_load(run_dir, tmp_path):
    """A model file of a run from before the warmup <= steps and aux_loss_coef >= 0 checks still loads."""
    from safetensors.torch import load_file

    from mxmoe.train import load_checkpoint, save_model

    config = {**json.loads((run_dir / "metrics.json").read_text())["config"], "steps": 2, "warmup": 5,
              "aux_loss_coef": -0.01}
    save_model(load_file(run_dir / "model_bf16.safetensors"), tmp_path / "old.safetensors",
               metadata={"recipe": "bf16", "config": json.dumps(config)})
    _, cfg, recipe = load_checkpoint(tmp_path / "old.safetensors")
    assert (cfg.steps, cfg.warmup, cfg.aux_loss_coef, recipe) == (2, 2, 0.0, "bf16")


def test_checkpoint_load_and_sample(run_dir, capsys):
    """A checkpoint of the tiny run loads with its config and recipe and samples deterministically."""
    from mxmoe.train import generate, load_checkpoint, sample

    for recipe in ("bf16", "mxfp8"):
        model, cfg, got_recipe = load_checkpoint(run_dir / f"model_{recipe}.safetensors")
        assert got_recipe == recipe and cfg.dim == make_config("tiny").dim and not model.training
        idx = torch.randint(256, (2, cfg.seq_len))
        assert model.logits(idx).shape == (2, cfg.seq_len, 256)
        out = generate(model, b"def ", 80, seed=3)  # longer than the context (64): the window slides
        assert isinstance(out, bytes) and len(out) == 80
        assert generate(model, b"def ", 80, seed=3) == out  # deterministic
        assert generate(model, b"def ", 20, temperature=0) == generate(model, b"def ", 20, temperature=0, seed=9)
    text = sample(run_dir / "model_mxfp8.safetensors", "def ", tokens=30, seed=1)
    assert text.startswith("def ") and len(text.encode("utf-8", "surrogatepass")) >= 4
    assert main(["sample", "--ckpt", str(run_dir / "model_mxfp8.safetensors"), "--prompt", "def ",
                 "--tokens", "30", "--seed", "1"]) == 0
    assert capsys.readouterr().out == text + "\n"
    with pytest.raises(ValueError, match="the prompt is empty"):
        generate(model, b"", 5)
    for t in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="temperature must be finite and >= 0"):
            generate(model, b"def ", 5, temperature=t)
    with pytest.raises(ValueError, match="more than the model's context"):
        model.logits(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_sample_cli_rejects_a_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sample", "--ckpt", str(tmp_path / "nope.safetensors")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no checkpoint at" in err and "usage: mxmoe sample" in err
    (tmp_path / "model_bf16.safetensors").write_bytes(b"")  # a run's folder given for its model file
    with pytest.raises(SystemExit) as e:
        main(["sample", "--ckpt", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "is a folder" in err and str(tmp_path / "model_bf16.safetensors") in err


def test_verdict_and_stored_seed_spread(monkeypatch):
    import dataclasses

    from mxmoe import train

    monkeypatch.setattr(platform, "python_version", lambda: "3.11.7")
    spread = train.seed_spread(dataclasses.asdict(make_config("default")))
    assert spread is not None and spread["preset"] == "default" and len(spread["seeds"]) >= 2
    assert spread["spread"] == max(spread["bf16_val"].values()) - min(spread["bf16_val"].values()) > 0
    inside = train.verdict(spread["spread"] / 2, spread, "mxfp8")
    assert "is inside the seed-to-seed spread" in inside and "not distinguishable" in inside and "mxfp8" in inside
    assert "outside" in train.verdict(-2 * spread["spread"], spread) and "lower than bf16" in train.verdict(
        -2 * spread["spread"], spread)
    assert train.seed_spread(dataclasses.asdict(make_config("default", steps=10))) is None  # other settings
    assert train.seed_spread(dataclasses.asdict(make_config("default", seed=5, out="x"))) is not None
    assert "no seed-to-seed spread is stored" in train.verdict(0.01, None)
    monkeypatch.setattr(platform, "python_version", lambda: "3.12.3")  # another stdlib: other data
    assert train.seed_spread(dataclasses.asdict(make_config("default"))) is None


# ----------------------------------------------------------------------------- resumable runs (issue 23)

RESUME_FLAGS = ["--preset", "tiny", "--steps", "16", "--eval-every", "8", "--eval-batches", "1",
                "--checkpoint-every", "4", "--recipes", "bf16,fp32", "--device", "cpu"]


def _train_proc(*args: str) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}  # one thread each: two runs share the cores without spinning threads
    return subprocess.Popen([sys.executable, "-m", "mxmoe", "train", *args], env=env, cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_killed_run_resumes_to_the_uninterrupted_numbers(tmp_path):
    """A real run is SIGKILLed once its second recipe has a checkpoint (the first recipe finished), another
    gets SIGINT (Ctrl-C) once its first recipe finished (no periodic checkpoints: the signal writes one);
    ``mxmoe train --resume DIR`` continues each; every loss and the final weights equal those of an
    uninterrupted run bit for bit (CPU: every op is deterministic in one thread), and so do the model files'
    bytes."""
    from safetensors.torch import load_file

    whole = _train_proc(*RESUME_FLAGS, "--out", str(tmp_path / "whole"))  # runs alongside the killed one
    killed = _train_proc(*RESUME_FLAGS, "--out", str(tmp_path / "killed"))
    stopped = _train_proc(*RESUME_FLAGS, "--checkpoint-every", "0", "--out", str(tmp_path / "stopped"))
    # SIGINT once the first recipe has finished (its done state), SIGKILL once the second has a checkpoint
    signals = {stopped: (tmp_path / "stopped" / "checkpoint_bf16.pt", signal.SIGINT),
               killed: (tmp_path / "killed" / "checkpoint_fp32.pt", signal.SIGKILL)}
    deadline = time.monotonic() + 240
    while signals and time.monotonic() < deadline:
        for proc, (path, sig) in list(signals.items()):
            if path.exists() or proc.poll() is not None:
                proc.send_signal(sig)
                del signals[proc]
        time.sleep(0.01)
    log = stopped.communicate(timeout=240)[0]
    assert stopped.returncode == 130, log[-3000:]
    step = torch.load(tmp_path / "stopped" / "checkpoint_fp32.pt", weights_only=True)["step"]
    assert f"fp32: interrupted at step {step}; resume with: mxmoe train --resume {tmp_path / 'stopped'}" in log
    assert "Traceback" not in log and 1 <= step < 16
    ckpt = tmp_path / "killed" / "checkpoint_fp32.pt"
    log = killed.communicate()[0]
    assert killed.returncode == -signal.SIGKILL, log[-3000:]  # killed, not finished
    assert not (tmp_path / "killed" / "metrics.json").exists()
    assert torch.load(ckpt, weights_only=True)["step"] in (4, 8, 12)  # part-way through fp32
    resumed = _train_proc("--resume", str(tmp_path / "killed"))
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, log[-3000:]
    assert "resumed: bf16 at step 16, fp32 at step" in log
    resumed = _train_proc("--resume", str(tmp_path / "stopped"))
    log = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and f"resumed: bf16 at step 16, fp32 at step {step}" in log, log[-3000:]
    assert whole.wait(timeout=300) == 0, whole.communicate()[0][-3000:]
    want = json.loads((tmp_path / "whole" / "metrics.json").read_text())
    for run in ("killed", "stopped"):
        got = json.loads((tmp_path / run / "metrics.json").read_text())
        assert got["recipes"]["fp32"]["resumed_at_step"] in ((4, 8, 12) if run == "killed" else (step,))
        for recipe in ("bf16", "fp32"):
            for key in ("train_loss", "aux_loss", "val_step", "val_loss", "final_train_loss"):
                assert got["recipes"][recipe][key] == want["recipes"][recipe][key], (run, recipe, key)
            a = load_file(tmp_path / run / f"model_{recipe}.safetensors")
            b = load_file(tmp_path / "whole" / f"model_{recipe}.safetensors")
            assert all(torch.equal(a[k], b[k]) for k in b)
            # same tensors, same bytes: no run-place fields in the metadata, its keys in one order
            assert ((tmp_path / run / f"model_{recipe}.safetensors").read_bytes()
                    == (tmp_path / "whole" / f"model_{recipe}.safetensors").read_bytes()), (run, recipe)


def test_training_state_write_is_atomic(tmp_path, monkeypatch):
    """A write that fails part-way leaves the previous state file intact and no temp file behind."""
    from mxmoe import train

    path = tmp_path / "checkpoint_bf16.pt"
    train.save_training_state(path, {"format": train.CHECKPOINT_FORMAT, "step": 4, "model": {"w": torch.ones(3)}})

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        train.save_training_state(path, {"format": train.CHECKPOINT_FORMAT, "step": 8})
    state = train.load_training_state(path)
    assert state["step"] == 4 and torch.equal(state["model"]["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_bf16.pt"]
    (tmp_path / "other.pt").write_bytes(b"")
    monkeypatch.undo()
    torch.save({"step": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a mxmoe train checkpoint"):
        train.load_training_state(tmp_path / "other.pt")


def test_a_folder_holding_a_run_is_refused_unless_overwrite(tmp_path, capsys):
    """A fresh run into a folder that holds an earlier run's files (models, metrics, states) is refused, the
    message naming --resume and --overwrite, nothing touched; with --overwrite every file of the earlier run
    goes (a later --resume must not continue it, no model of it stays beside this run's), other files stay."""
    (tmp_path / "run_config.json").write_text("{}")
    for name in ("checkpoint_bf16.pt", "checkpoint_mxfp8_128.pt", "model_mxfp8_128.safetensors"):
        (tmp_path / name).write_bytes(b"an earlier run's file")
    (tmp_path / "notes.txt").write_text("not ours")
    flags = ["train", "--preset", "tiny", "--steps", "2", "--eval-every", "2", "--recipes", "bf16",
             "--device", "cpu", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        main(flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "holds an earlier run's files (checkpoint_bf16.pt, checkpoint_mxfp8_128.pt" in err
    assert f"mxmoe train --resume {tmp_path}" in err and "--overwrite" in err
    assert (tmp_path / "model_mxfp8_128.safetensors").read_bytes() == b"an earlier run's file"
    assert main([*flags, "--overwrite"]) == 0
    assert "--overwrite: removed an earlier run's files" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_bf16.pt", "loss.png", "metrics.json",
                                                          "model_bf16.safetensors", "notes.txt", "run_config.json"]
    assert json.loads((tmp_path / "run_config.json").read_text())["steps"] == 2  # this run's, for --resume
    with pytest.raises(SystemExit) as e:  # the folder now holds this run
        main(flags)
    assert e.value.code == 2 and "holds an earlier run's files" in capsys.readouterr().err


@pytest.mark.parametrize("flags,msg", [
    (["--out", ""], "--out is empty"),
    (["--out", "/dev/null"], "--out '/dev/null' is not a directory"),
    (["--out", "/proc/mxmoe_out"], "cannot be created: /proc is on a proc file system"),
    (["--device", "cpu:7"], "--device 'cpu:7': torch has a single CPU device"),
    (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "--device cuda"),
    (["--resume", "x", "--overwrite"], "give no other flags (got --preset --overwrite)"),
])
def test_cli_names_the_cause_of_a_bad_out_or_device(flags, msg, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["train", "--preset", "tiny", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and msg in err, err
    assert not list(tmp_path.iterdir())  # nothing written (no out/ in the working folder)
    with pytest.raises(SystemExit) as e:
        main(["sample", "--ckpt", "x.safetensors", "--device", "cpu:3"])
    assert e.value.code == 2 and "--device 'cpu:3': torch has a single CPU device" in capsys.readouterr().err


def test_train_help_is_short(capsys):
    """``mxmoe train --help``: a few lines of description, then the options; no Sphinx markup."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    head = out.split("options:")[0]
    assert len(head.splitlines()) < 25 and ":func:" not in out and "``" not in out
    assert "--overwrite" in out and "--resume" in out


def test_resume_cli_errors(tmp_path, capsys):
    for flags, msg in [(["--resume", str(tmp_path / "nope")], "is not a folder"),
                       (["--resume", str(tmp_path)], "no run_config.json there"),
                       (["--resume", str(tmp_path), "--steps", "3"], "give no other flags (got --steps)"),
                       (["--resume", str(tmp_path), "--preset", "tiny"], "give no other flags (got --preset)")]:
        with pytest.raises(SystemExit) as e:
            main(["train", *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err, (flags, err)


# ----------------------------------------------------------------------------- GPU presets and artefacts (issue 23)

def test_gpu_presets():
    """The sizes issue 23 asks for; every recipe compared accepts the dims; CUDA graphs on CUDA by default."""
    from mxmoe.recipes import get_recipe
    from mxmoe.train import compile_backend, count_params, model_flops_per_token

    gpu, tp = make_config("gpu"), make_config("gpu-throughput")
    total = count_params(MoELM(gpu, "bf16"), gpu)["total"]
    assert 100e6 <= total <= 200e6 and gpu.steps >= 2000 and gpu.checkpoint_every > 0
    assert tp.dim >= 2048 and tp.ffn_dim >= 1024 and 100 <= tp.steps <= 1000
    for cfg in (gpu, tp):
        for recipe in ("bf16", "mxfp8", "mxfp8_128"):
            get_recipe(recipe).check_dims(cfg.dim, cfg.ffn_dim)
        assert compile_backend(cfg, torch.device("cuda")) == "inductor-cudagraphs"
        assert compile_backend(cfg, torch.device("cuda"), world_size=2) == ""  # not under torchrun
        assert compile_backend(cfg, torch.device("cpu")) == ""
    assert compile_backend(make_config("tiny", compile="none"), torch.device("cuda")) == ""
    # 6 x matmul params per token + attention: the tiny preset by hand
    t = make_config("tiny")
    per_layer = 4 * 64 * 64 + 64 * 4 + 2 * 3 * 64 * 64
    assert model_flops_per_token(t) == 6 * (2 * per_layer + 64 * 256) + 12 * 2 * 64 * 64
    assert make_config("tiny", data="python-all").data == "python-all"


def test_seed_spread_matches_stored_runs(monkeypatch):
    """The stored CPU default runs (whose configs hold the since-removed cpu_bf16_gemm field and lack
    the new ones) still find the stored spread."""
    from mxmoe import train

    monkeypatch.setattr(platform, "python_version", lambda: "3.11.7")
    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "cpu"
    configs = [json.loads(p.read_text())["config"] for p in sorted(root.glob("train_default*.json"))]
    assert len(configs) >= 4 and any("cpu_bf16_gemm" in c for c in configs)
    for cfg in configs:
        assert "checkpoint_every" not in cfg and train.seed_spread(cfg)["preset"] == "default"
    assert train.seed_spread({**cfg, "data": "python-all"}) is None  # other data
    assert train.seed_spread({**cfg, "data": "stdlib"})["preset"] == "default"


def test_compare_runs_and_throughput_rows(run_dir, tmp_path):
    """Per-(recipe, seed) runs combine into means, spreads and gaps; the throughput rows carry the keys
    train_gpu_throughput.json needs."""
    import copy

    from mxmoe.train import compare_runs, compare_table, plot_compare, throughput_rows, write_throughput

    metrics = json.loads((run_dir / "metrics.json").read_text())
    runs = []
    for seed, shift in ((0, 0.0), (1, 0.1)):  # two fake seeds, one recipe per file as the gpu preset writes
        for recipe in ("bf16", "mxfp8"):
            m = copy.deepcopy(metrics)
            m["config"]["seed"], m["config"]["recipes"] = seed, recipe
            m["recipes"] = {recipe: m["recipes"][recipe]}
            m["recipes"][recipe]["val_loss"] = [v + shift for v in m["recipes"][recipe]["val_loss"]]
            runs.append(m)
    cmp = compare_runs(runs)
    bf16, mx = metrics["recipes"]["bf16"], metrics["recipes"]["mxfp8"]
    assert cmp["bf16"]["seeds"] == [0, 1] and cmp["bf16"]["val_spread"] == pytest.approx(0.1)
    gap = 100 * (mx["val_loss"][-1] - bf16["val_loss"][-1]) / bf16["val_loss"][-1]
    assert cmp["mxfp8"]["gap_pct"][0] == pytest.approx(gap)
    assert cmp["mxfp8"]["val_minus_train_pct"][0] == pytest.approx(
        100 * (mx["val_loss"][-1] - mx["final_train_loss"]) / mx["final_train_loss"])
    assert "| mxfp8 | 0, 1 |" in compare_table(cmp)
    plot_compare(runs, tmp_path / "cmp.png")
    assert (tmp_path / "cmp.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="given twice"):
        compare_runs(runs + runs[:1])
    other = copy.deepcopy(runs[0])
    other["config"]["dim"] = 128
    with pytest.raises(ValueError, match="other settings"):
        compare_runs(runs + [other])
    rows = throughput_rows(metrics)
    assert [r["recipe"] for r in rows] == ["bf16", "mxfp8"] and rows[0]["vs_bf16"] == 1.0
    assert {"recipe", "tokens_per_s", "mfu", "ms_per_step", "peak_mem_gib"} <= set(rows[0])
    doc = write_throughput(run_dir / "metrics.json", tmp_path / "tp.json")
    assert json.loads((tmp_path / "tp.json").read_text())["rows"] == doc["rows"] == rows
    assert metrics["data"]["source"] == "stdlib" and 0 < metrics["data"]["epochs_per_recipe"] < 1


def test_python_all_corpus_in_a_run(tmp_path, monkeypatch, capsys):
    """--data python-all through a run (roots: a temp tree of fake sources): the log names the files,
    bytes and epochs; metrics.json records them; the second run reads the cache."""
    from mxmoe import corpus

    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"m{i}.py").write_text(f"def function_{i}(x):\n    return x * {i} + {i * i}  # {'#' * i}\n")
    (src / "dup.py").write_text((src / "m3.py").read_text())
    monkeypatch.setattr(corpus, "python_roots", lambda: [str(src)])
    flags = ["train", "--preset", "tiny", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
             "--seq-len", "32", "--recipes", "bf16", "--device", "cpu", "--data", "python-all", "--val-every-file", "4",
             "--data-cache", str(tmp_path / "cache")]
    assert main([*flags, "--out", str(tmp_path / "a")]) == 0
    log = capsys.readouterr().out
    data = json.loads((tmp_path / "a" / "metrics.json").read_text())["data"]
    assert data["source"] == "python-all" and data["files"]["train"] + data["files"]["val"] == 40
    assert data["duplicates"] == 1 and not data["from_cache"]
    assert data["epochs_per_recipe"] == pytest.approx(2 * 8 * 32 / data["bytes"]["train"])
    assert (f"data: python-all: {data['files']['train']} train / {data['files']['val']} val files" in log
            and "1 duplicate files skipped" in log and "epochs of the train split" in log and "steps: eager" in log)
    assert main([*flags, "--out", str(tmp_path / "b")]) == 0
    assert "from the cache" in capsys.readouterr().out
    again = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert again["data"]["from_cache"] and again["data"]["bytes"] == data["bytes"]


def test_run_input_errors_name_the_file(tmp_path):
    """Damaged checkpoints, bad run_config.json and data too short for a window: RunInputError (the CLI's
    one-line usage error) naming the file or flag, never a traceback from torch or json."""
    from mxmoe.train import RunInputError, load_run_config, load_training_state, make_config, run

    bad = tmp_path / "checkpoint_bf16.pt"
    bad.write_bytes(b"\x00" * 100)
    with pytest.raises(RunInputError, match="checkpoint_bf16.pt cannot be read"):
        load_training_state(bad)
    (tmp_path / "run_config.json").write_text('{"out": ')
    with pytest.raises(RunInputError, match="run_config.json is not valid JSON"):
        load_run_config(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        (data / f"f{i}.py").write_text(f"x = {i}\n")
    cfg = make_config("tiny", data=str(data), val_every_file=2, out=str(tmp_path / "out"), recipes="bf16")
    with pytest.raises(RunInputError, match="train split has .* bytes"):
        run(cfg)
    with pytest.raises(ValueError, match="heads must be a positive int"):
        make_config("tiny", heads=0)


def test_compile_many_recipes_one_process(tmp_path, caplog):
    """One process compiling recipe after recipe (`--recipes` with several MX recipes): every recipe gets a
    fresh dynamo cache, so their guards do not add up to dynamo's recompile limit (past it dynamo silently
    runs the later recipes' MoE layers eagerly; on CUDA that cost mxfp8_128 10x its step time)."""
    import logging

    recipes = "bf16,mxfp8,mxfp8_2d,mxfp8_lowmem,mxfp8_bf16_wgrad"
    with caplog.at_level(logging.WARNING, logger="torch._dynamo"):
        assert main(["train", "--preset", "tiny", "--steps", "2", "--eval-every", "2", "--recipes", recipes,
                     "--device", "cpu", "--compile", "aot_eager", "--out", str(tmp_path)]) == 0
    hits = [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()
            or "cache_size_limit" in r.getMessage()]
    assert not hits, hits[:1]


# ----------------------------------------------------------------------------- what the default run's numbers depend on

# The default preset's first 4 train losses (seed 0, --device cpu), one thread, torch's AVX512 CPU kernels
# (torch.backends.cpu.get_cpu_capability()), torch 2.13.0 CPU, Python 3.11.7's standard library as data
# (30,013,929 / 1,514,871 bytes), 2026-12-03. Bit for bit they depend on the thread count (1 vs 2; and with 2
# threads bf16 takes one of two trajectories from run to run), the CPU kernels (ATEN_CPU_CAPABILITY
# avx512 / avx2 / default, MKL_ENABLE_INSTRUCTIONS, MKL_CBWR, another CPU) and the data; not on torch 2.11
# vs 2.13 (benchmarks/results/cpu/train_default_seed0.json: torch 2.11, 2 threads, AVX512, the same losses).
FIRST_STEPS = {"bf16": [5.794955730438232, 5.576299667358398, 5.369964122772217, 5.079203128814697],
               "mxfp8": [5.793492317199707, 5.569596290588379, 5.3713698387146, 5.08334493637085]}
FIRST_STEPS_ENV = {"threads": 1, "data_bytes": (30013929, 1514871)}
# the largest difference from FIRST_STEPS over those variations at steps 1-4 was 1.6e-3 nats (MKL_CBWR,
# AVX2, one / two threads, the old AMD dev machine's stored run): other CPUs must agree to twice that
FIRST_STEPS_SPREAD = 3e-3


@pytest.mark.slow
def test_default_preset_first_steps_match_the_stored_losses():
    """The default run's first 4 steps against the stored figures, within the measured machine-to-machine
    spread (one thread; other data is skipped)."""
    from mxmoe.corpus import load_corpus
    from mxmoe.train import train_recipe

    cfg = make_config("default", device="cpu")
    corpus = load_corpus(cfg.data, "cpu", cfg.val_every_file, cfg.data_cache)
    if (len(corpus.train), len(corpus.val)) != FIRST_STEPS_ENV["data_bytes"]:
        pytest.skip(f"this Python's stdlib is other data ({len(corpus.train):,} train bytes) than the stored run's")
    threads = torch.get_num_threads()
    torch.set_num_threads(FIRST_STEPS_ENV["threads"])
    try:
        torch.manual_seed(cfg.seed)
        init = MoELM(cfg, "bf16").state_dict()
        got = {r: train_recipe(cfg, r, init, corpus.train, corpus.val, torch.device("cpu"), stop_after=4)[1]
               ["train_loss"] for r in FIRST_STEPS}
    finally:
        torch.set_num_threads(threads)
    # (not bit for bit on every AVX512 CPU: this development machine's, 2026-12-04, differs by up to 4.9e-4
    # at step 4 from the recording machine's, both AVX512 at one thread)
    for r, want in FIRST_STEPS.items():
        assert got[r] == pytest.approx(want, abs=FIRST_STEPS_SPREAD), r
