"""Where do a torchtitan model's routed experts spend their forward + backward, kernel by kernel?

torchtitan 0.2.2's ``GroupedExperts`` at a torchtitan-suite model's shape (``bench_torchtitan.expert_shape``:
balanced rows, the run's tokens per step times top-k), its parameters in ``--param-dtype`` (float32: what a
one-GPU torchtitan run holds; bfloat16: what FSDP2's mixed precision hands the experts). Per variant: the
do_bench time of one forward + backward (gradients None before each, as after a step's
zero_grad) and the CUDA kernels of 5 profiled ones (ms per iteration, by name).
Variants: ``bf16`` (torchtitan's compiled grouped-mm function), ``RECIPE`` (mxmoe's converter, fused SwiGLU,
compiled as the converter compiles it) and, with ``--unfused``, ``RECIPE/unfused`` (``fused_swiglu=False``).

    PYTHONPATH=.:/tmp/site python benchmarks/tools/profile_tt_experts.py [--models llama4-17bx16e,...]
        [--recipes mxfp8_128] [--param-dtype float32] [--out experts_profile.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_torchtitan as TT


def profile_model(model: str, recipes: list[str], param_dtype: str, unfused: bool = False) -> dict:
    out = {"variants": {}}
    for variant in ["bf16"] + [v for r in recipes for v in ((r, f"{r}/unfused") if unfused else (r,))]:
        with TT.experts_step(model, variant, param_dtype) as (step, shape):
            out["shape"] = shape
            ms = triton.testing.do_bench(step, warmup=10, rep=100)
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for ev in p.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
                kernels[ev.name] = kernels.get(ev.name, 0.0) + ev.device_time_total / 1e3 / 5
        top = sorted(kernels.items(), key=lambda kv: -kv[1])
        out["variants"][variant] = {"ms": round(ms, 3), "kernel_ms": round(sum(kernels.values()), 3),
                                    "kernels": [{"name": n[:120], "ms": round(v, 3)} for n, v in top[:25]]}
        print(f"{model} {variant}: {ms:.3f} ms (kernels {sum(kernels.values()):.3f})", flush=True)
        for n, v in top[:12]:
            print(f"   {v:8.3f}  {n[:110]}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(TT.MODELS))
    ap.add_argument("--recipes", default="mxfp8_128")
    ap.add_argument("--unfused", action="store_true", help="also each recipe with fused_swiglu=False")
    ap.add_argument("--param-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="experts_profile.json")
    a = ap.parse_args()
    TT.ensure_assets()  # expert_shape parses the suite's flags, which name the tokenizer
    res = {"param_dtype": a.param_dtype, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "models": {}}
    for model in a.models.split(","):
        res["models"][model] = profile_model(model, a.recipes.split(","), a.param_dtype, a.unfused)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
