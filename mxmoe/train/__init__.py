"""Train a small byte-level MoE language model on Python source code: bf16 vs mxfp8.

Every recipe starts from the same initial weights and sees the same batches in the same order,
so the difference between their loss curves is the cost of the MXFP8 expert matrix products.
The data is this machine's own Python sources (:mod:`mxmoe.corpus`; nothing is downloaded): on the
CPU by default the standard library (``sysconfig.get_paths()["stdlib"]``, all ``.py`` files,
site-packages excluded, every 20th file in sorted order held out for validation); on CUDA by default
every ``.py`` file of the interpreter's stdlib and site-packages, deduplicated, a file held out when a
hash of its content says so (``--data python-all``; hundreds of MB, cached under ``--data-cache``).
The log says how many files and bytes the run uses and how many epochs of the train split it consumes.
Launch:

    mxmoe train                                    # default preset: 2.5-4.5 minutes on 2 CPU cores
    mxmoe train --preset tiny --out /tmp/tiny      # seconds; what the tests run
    mxmoe train --preset gpu --device cuda --recipes bf16 --seed 0     # convergence: 171M parameters, 2000 steps
    mxmoe train --preset gpu-throughput --device cuda --recipes bf16,mxfp8,mxfp8_128   # tokens/s and MFU
    python -m mxmoe train --steps 500 --lr 2e-3 --recipes bf16,mxfp8
    mxmoe train --batch-size 8 --grad-accum 4      # 32 windows per optimizer step, 8 per forward/backward

On CUDA the steps run compiled and replayed from CUDA graphs by default (``--compile auto``:
``inductor-cudagraphs``, torch.compile's inductor with ``mode="reduce-overhead"``, which fuses torch's
elementwise work around our kernels; on the gpu-throughput preset 1.13x (bf16) and 1.16x (mxfp8_128) the
tokens/s of the ``cudagraphs`` backend, which replays the unfused kernels and was the default before; the
old 110M preset ran 2.8-3.8x eager's tokens/s under it). ``--compile cudagraphs`` keeps that one,
``--compile ""`` runs eager; the log says which.

MFU (the ``mfu`` of each recipe's metrics, CUDA only) is model FLOPs per second over a stated peak:
model FLOPs per token = 6 x the matrix-multiply parameters a token uses (attention projections, router,
its top_k experts, LM head; embedding lookups excluded) + 12 x layers x seq_len x dim (attention scores
and values, forward and backward, counted without the causal mask's half, as PaLM's MFU does), times
tokens/s, divided by :data:`PEAK_FLOPS`, the H200's dense BF16 peak of 989.4 TFLOP/s, for every recipe
(the MXFP8 recipes too: the same yardstick, so MFU ratios are tokens/s ratios).

Runs survive interruption: every ``--checkpoint-every`` steps (default 50, under 0.5% of a default CPU run's time;
the gpu preset 500, gpu-throughput only on a signal) and on SIGINT (Ctrl-C) or SIGTERM the recipe's model,
optimizer, step, data-order and RNG states and metrics so far go to ``<out>/checkpoint_<recipe>.pt``, written
atomically; after a signal the run stops and prints ``interrupted at step N; resume with: mxmoe train --resume
<out>`` (exit code 130 for SIGINT). ``mxmoe train --resume DIR`` continues it with its own settings
(``DIR/run_config.json``) and ends with the numbers and model files of an uninterrupted run (bit for bit on the
CPU in one thread). A fresh run refuses an ``--out`` folder that holds an earlier run's files unless
``--overwrite`` (which deletes them first) or ``--resume``.

Expert parallelism: launched by ``torchrun`` with more than one process, every rank holds
``experts / world`` experts of each MoE layer (``mxmoe.parallel``: gloo on CPUs, NCCL and one GPU
per rank on CUDA) and trains on its own batches; the rest of the model is replicated and its
gradients are averaged. ``--batch-size`` and ``--eval-batches`` count per rank; ``--experts`` must
be divisible by the number of processes. Rank 0 prints and writes the outputs; the saved models hold
the full (single-process) state dict. Training states (checkpoints, ``--resume``) are single-process only:
none are written under torchrun.

    torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset tiny --out /tmp/tiny_ep2
    torchrun --standalone --nproc-per-node 2 -m mxmoe train --preset gpu --device cuda

Writes into ``--out``: ``metrics.json`` (config, environment, data, per-recipe losses and speed),
``loss.png`` (train and val curves, and each recipe's val loss minus bf16's against the stored
seed-to-seed spread) and ``model_<recipe>.safetensors``. Runs of one recipe and seed each (the ``gpu``
preset) are compared by :func:`compare_runs` / :func:`plot_compare` (``benchmarks/tools/compare_train_runs.py``);
:func:`throughput_rows` gives the ``train_gpu_throughput.json`` rows. On the CPU every recipe runs the
pure-torch reference (the speed column reads ``ref tok/s``), whose BF16 grouped products are FP32
products of the BF16 values (:func:`mxmoe.ops.grouped.reference_grouped_mm`). A model is
loaded by :func:`load_checkpoint` and sampled by :func:`sample` / ``mxmoe sample``:

    mxmoe sample --ckpt out/model_mxfp8.safetensors --prompt "def " --tokens 200
"""

# the package's modules, lowest first (each imports only those above it):
# config -> data -> model -> distributed -> checkpoint -> loop -> report -> sampling -> job
from mxmoe.train.config import (COMPILE_BACKENDS, GRAPH_BACKENDS, PEAK_FLOPS, PRESETS, VOCAB, RunInputError,
                                TrainConfig, check_device, compile_backend, make_config, parse_recipes)
from mxmoe.train.data import get_batch, tokens_per_step
from mxmoe.train.model import Attention, Block, MoELM, autocast, count_params
from mxmoe.train.distributed import (SINGLE_PROCESS, ExpertParallel, clip_gradients, full_state_dict,
                                     init_expert_parallel, mean_over_ranks)
from mxmoe.train.checkpoint import (CHECKPOINT_FORMAT, RUN_FILES, load_run_config, load_training_state, prepare_out,
                                    run_files, save_model, save_training_state)
from mxmoe.train.loop import (TIMING_EVERY, Interrupted, StopRequest, compiled, evaluate, final_train_loss,
                              forward_backward, lr_at, stop_on_signals, train_recipe)
from mxmoe.train.report import (SEED_SPREAD, compare_runs, compare_table, model_flops_per_token, plot_compare,
                                plot_losses, seed_spread, summarize, throughput_rows, verdict,
                                write_throughput)
from mxmoe.train.sampling import generate, load_checkpoint, sample
from mxmoe.train.job import run

__all__ = ["COMPILE_BACKENDS", "GRAPH_BACKENDS", "PEAK_FLOPS", "PRESETS", "VOCAB", "RunInputError",
           "TrainConfig", "check_device", "compile_backend", "make_config", "parse_recipes", "get_batch",
           "tokens_per_step", "Attention", "Block", "MoELM", "autocast", "count_params", "SINGLE_PROCESS",
           "ExpertParallel", "clip_gradients", "full_state_dict", "init_expert_parallel", "mean_over_ranks",
           "CHECKPOINT_FORMAT", "RUN_FILES", "prepare_out", "run_files", "load_run_config",
           "load_training_state", "save_model", "save_training_state", "TIMING_EVERY", "Interrupted",
           "StopRequest", "stop_on_signals", "compiled", "evaluate", "final_train_loss", "forward_backward",
           "lr_at", "train_recipe", "SEED_SPREAD", "compare_runs", "compare_table", "model_flops_per_token",
           "plot_compare", "plot_losses", "seed_spread", "summarize", "throughput_rows", "verdict",
           "write_throughput", "generate", "load_checkpoint", "sample", "run"]
