"""Step time of the main job's GPU preset (`mxmoe train --preset gpu`) in one process, with and
without the session-3 changes: experts on autocast-dtype activations ("cast"; off = the experts get
FP32 activations, as before) and the layer kernels (`MXMOE_LAYER_KERNELS`); then a torch profile of
the default configuration (CPU-side and CUDA time per op). Random tokens, fused AdamW, no gradient
clipping or evaluation, so the numbers are lower bounds of the job's step.

    PYTHONPATH=. python benchmarks/profile_train_step.py     # one CUDA GPU
"""
import os, time, statistics, torch
from mxmoe import train as T
cfg = T.make_config("gpu")
dev = torch.device("cuda")
orig_dtype = torch.get_autocast_dtype
def run(recipe, cast, kernels, prof=False):
    os.environ["MXMOE_LAYER_KERNELS"] = kernels
    torch.get_autocast_dtype = orig_dtype if cast else (lambda d: torch.float32)
    torch.manual_seed(0)
    model = T.MoELM(cfg, recipe).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=dev)
    y = torch.randint(0, 256, (cfg.batch_size, cfg.seq_len), device=dev)
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ce, aux = model(x, y)
        (ce + aux).backward()
        opt.step(); opt.zero_grad(set_to_none=True)
    ts = []
    for i in range(25):
        torch.cuda.synchronize(); t = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    # CPU-side time of one step without sync at the end
    t = time.perf_counter(); step(); cpu = time.perf_counter() - t; torch.cuda.synchronize()
    print(f"{recipe:6s} cast={cast} kernels={kernels}: {1e3*statistics.median(ts[10:]):.1f} ms/step, cpu-side {1e3*cpu:.1f} ms", flush=True)
    if prof:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(2): step()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    torch.get_autocast_dtype = orig_dtype
run("bf16", False, "0"); run("bf16", True, "0"); run("bf16", False, "1"); run("bf16", True, "1", prof=True)
run("mxfp8", False, "0"); run("mxfp8", True, "1")
