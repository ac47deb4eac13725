"""What the torchtitan suite adds to torchtitan 0.2.2's trainer, as its ``--job.custom_config_module``:

* mxmoe's converter and ``--mxmoe.*`` options (``mxmoe.integrations.torchtitan``, re-exported ``JobConfig``);
* cut flavors: torchtitan's published model dimensions with fewer layers, so one H200 holds the model with
  FP32 master weights and AdamW (``CUT_FLAVORS``; added to torchtitan's own flavor tables, nothing edited);
* ``torchao.fp8_grouped``, torchao 0.18's FP8 rowwise MoE training as a model converter, on the routed experts
  only (the modules named ``experts``; shared experts stay BF16, as under mxmoe's converter), and
  ``torchao.fp8_grouped_shared``, the same on every module whose fqn contains ``experts``, shared experts
  included, as torchtitan's ``--quantize.grouped_mm.float8.fqns experts`` selects them (torchao's tensor
  subclass runs their dense linears in FP8 rowwise too). torchtitan 0.2.2's ``quantize.grouped_mm.float8``
  imports ``torchao.prototype.moe_training.conversion_utils.MoETrainingConfig``, which torchao 0.18 no longer
  has; its successor is ``torchao.prototype.moe_training.config.Float8TrainingOpConfig`` through the same
  ``quantize_`` call, with the same token-group alignment (16 rows, torchtitan's padding);
* at the trainer's exit, the step's memory after the warm-up (:func:`report_step_memory`): the caching
  allocator's peak active bytes, and the bytes allocated as backward starts. torchtitan's log line gives the peak
  *reserved*, which also counts the allocator's cached free blocks;
* with ``MXMOE_BENCH_SYNC_STEPS=1`` in the environment (the suite's ``--launch-counts`` runs), a wait for the GPU
  at each step's end (:func:`synchronize_step`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from torchtitan.models.moe.utils import set_token_group_alignment_size_m
from torchtitan.protocols.model_converter import _registry_model_converter_cls, register_model_converter

from benchmarks.bench_torchtitan import SYNC_STEPS_ENV
from mxmoe.integrations.torchtitan import JobConfig  # noqa: F401  (torchtitan merges it: --mxmoe.*)

# (torchtitan model name, published flavor) -> (cut flavor name, overrides). DeepSeek-V3 16B keeps its
# first (dense) layer; Qwen3 and Llama-4 have MoE in every layer.
CUT_FLAVORS = {
    ("deepseek_v3", "16B"): ("16B-cut4", dict(n_layers=4)),  # 1 dense + 3 MoE layers of 64 experts, top-6
    ("qwen3", "30B-A3B"): ("30B-A3B-cut4", dict(n_layers=4)),  # 4 MoE layers of 128 experts, top-8
    ("llama4", "17bx16e"): ("17bx16e-cut2", dict(n_layers=2)),  # 2 MoE layers of 16 experts, top-1 + shared
    # the debug model (the kill-and-resume check) with the suite tokenizer's vocabulary: its own is 2,048, and a
    # token id past the embedding table is a device-side assert
    ("deepseek_v3", "debugmodel"): ("debugmodel-v32k", dict(vocab_size=32768)),
}


def _flavor_table(model: str) -> dict:
    from torchtitan.models import deepseek_v3, llama4, qwen3

    return {"deepseek_v3": deepseek_v3.deepseekv3_args, "qwen3": qwen3.qwen3_args, "llama4": llama4.llama4_args}[model]


def register_cut_flavors() -> None:
    """Add :data:`CUT_FLAVORS` to torchtitan's flavor tables (idempotent)."""
    for (model, flavor), (name, overrides) in CUT_FLAVORS.items():
        table = _flavor_table(model)
        if name not in table:
            table[name] = dataclasses.replace(table[flavor], **overrides)


def routed_experts(mod, fqn: str) -> bool:
    """``quantize_``'s filter for the routed experts only: the module named ``experts`` (torchtitan's
    ``GroupedExperts``), not ``shared_experts`` nor anything under it."""
    return fqn.rpartition(".")[2] == "experts"


def any_experts(mod, fqn: str) -> bool:
    """``quantize_``'s filter as torchtitan's converter applies ``fqns=["experts"]``: every module whose fqn
    contains ``experts``, the shared experts' linears included."""
    return "experts" in fqn


class TorchAOFloat8GroupedConverter:
    """``--model.converters torchao.fp8_grouped``: torchao 0.18's FP8 rowwise grouped GEMMs (dynamic rowwise
    quantization, ``torch._scaled_grouped_mm``) on the routed experts' parameters (:func:`routed_experts`): the
    scope of mxmoe's converter."""

    module_filter = staticmethod(routed_experts)

    def __init__(self, job_config, parallel_dims=None):
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig

        self.config = Float8TrainingOpConfig()
        set_token_group_alignment_size_m(16)  # FP8 grouped GEMM: groups on 16 rows (torchtitan's value)

    def convert(self, model) -> None:
        from torchao.quantization.quant_api import quantize_

        quantize_(model, config=self.config, filter_fn=self.module_filter)

    def post_optimizer_hook(self, model) -> None:
        pass


class TorchAOFloat8GroupedSharedConverter(TorchAOFloat8GroupedConverter):
    """``--model.converters torchao.fp8_grouped_shared``: as ``torchao.fp8_grouped``, on every module whose fqn
    contains ``experts`` (:func:`any_experts`): the shared experts' linears run FP8 rowwise too."""

    module_filter = staticmethod(any_experts)


MEMORY_LINE = "mxmoe-bench step memory: peak active {active:.2f} GiB, at backward start {held:.2f} GiB"
MEMORY_WARMUP = 10  # steps left out of the figures (the logged tokens/s' warm-up), counted in backward calls
_backward_start: list[int] = []  # torch.cuda.memory_allocated() as each backward of a CUDA tensor began, bytes
_step_peak: list[int] = []  # the allocator's peak active bytes as each optimizer step after the warm-up ended


def record_backward_start(backward):
    """Wrap ``torch.Tensor.backward`` so that each call on a CUDA tensor first notes ``memory_allocated()``: what
    a step holds once its forward is done. That is the weights and AdamW's moments, which every method shares (the
    gradients are None then: torchtitan zeroes them to None as a step starts), plus what the forward saved for
    backward and the loss's inputs. There the methods differ."""

    @functools.wraps(backward)
    def wrapped(self, *args, **kwargs):
        if self.is_cuda:
            _backward_start.append(torch.cuda.memory_allocated(self.device))
        return backward(self, *args, **kwargs)

    return wrapped


def record_step_peak(optimizer, args, kwargs) -> None:
    """A global optimizer step post-hook: after the warm-up, note the allocator's peak active bytes. torchtitan
    resets the peak statistics after each logged step, so a reading covers the steps since the last log:
    forward, backward and optimizer step. (At the trainer's exit the peak covers only what ran after the last
    step's log, the resting state: weights, gradients and moments.)"""
    if len(_backward_start) > MEMORY_WARMUP:
        _step_peak.append(torch.cuda.memory_stats()["active_bytes.all.peak"])


def synchronize_step(optimizer, args, kwargs) -> None:
    """A global optimizer step post-hook of the launch-count runs: wait for the GPU as each step ends. torch.profiler
    keeps the GPU kernels that started between its CPU-side start and stop, and the CPU runs ahead of the GPU, so
    without the wait the profiled step's window holds the tail of the step before and misses its own last
    kernels; with it, the window holds that one step's kernels."""
    torch.cuda.synchronize()


def report_step_memory() -> None:
    """Print :data:`MEMORY_LINE` (GiB, 2**30): the most of :func:`record_step_peak`'s readings and of
    :func:`record_backward_start`'s after :data:`MEMORY_WARMUP` steps. Nothing is printed where fewer CUDA steps
    ran."""
    if _step_peak and len(_backward_start) > MEMORY_WARMUP:
        print(MEMORY_LINE.format(active=max(_step_peak) / 2**30,
                                 held=max(_backward_start[MEMORY_WARMUP:]) / 2**30), flush=True)


if "LOCAL_RANK" in os.environ:  # imported by a trainer under torchrun, not by the suite or the tests
    torch.Tensor.backward = record_backward_start(torch.Tensor.backward)
    register_optimizer_step_post_hook(record_step_peak)
    atexit.register(report_step_memory)
    if os.environ.get(SYNC_STEPS_ENV) == "1":
        register_optimizer_step_post_hook(synchronize_step)
register_cut_flavors()
for _name, _cls in (("torchao.fp8_grouped", TorchAOFloat8GroupedConverter),
                   ("torchao.fp8_grouped_shared", TorchAOFloat8GroupedSharedConverter)):
    if _name in _registry_model_converter_cls:  # (imported again: the same classes)
        _registry_model_converter_cls[_name] = _cls
    else:
        register_model_converter(_cls, _name)
