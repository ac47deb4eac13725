import torch
from mxmoe.kernels import layer
from mxmoe.ops.router import split_bf16
torch.backends.cuda.matmul.allow_tf32 = False
g = torch.Generator().manual_seed(2)
for T, D, E in [(77, 200, 8), (130, 96, 20), (64, 128, 128), (33, 64, 100), (4096, 1024, 8), (4096, 1024, 128)]:
    x = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16)
    w = torch.randn(E, D, generator=g) * 0.05
    dl = torch.randn(T, E, generator=g)
    w3 = split_bf16(w)
    want = x.double() @ w.double().T
    rel = lambda a, b: ((a.double().cpu() - b).norm() / b.norm()).item()
    got = layer.router_logits(x.cuda(), w3.cuda())
    sg = x.float().cuda() @ w.cuda().T
    hi = (x.cuda() @ w3[0].cuda().T.float().to(torch.bfloat16))
    print(T, D, E, "logits", f"{rel(got, want):.2e}", "sgemm", f"{rel(sg, want):.2e}",
          "maxabs", (got.double().cpu()-want).abs().max().item(), "w/hi-only-bf16", f"{rel(hi.float(), want):.2e}")
    dx = layer.router_dx(dl.cuda(), w3.cuda()); wdx = dl.double() @ w.double()
    dw = layer.router_dw(dl.cuda(), x.cuda()); wdw = dl.double().T @ x.double()
    print("   dx", f"{rel(dx, wdx):.2e}", "dw", f"{rel(dw, wdw):.2e}", "sgemm dw", f"{rel(dl.cuda().T @ x.float().cuda(), wdw):.2e}")
