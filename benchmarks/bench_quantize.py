"""Quantize suite: bandwidth of the MXFP8 quantization kernels against a device-to-device copy, same run, same GPU.

    python -m benchmarks quantize [--quick] [--out benchmarks/results/<gpu>/quantize.json] [--groups 32,128] [--sweep]

Effective bandwidth = (bytes read + bytes written, scales included) / median time
(``triton.testing.do_bench``, warm-up first). ``copy_tbps`` is a device-to-device copy moving the
same number of bytes (read + write), timed in the same run; ``ratio = tbps / copy_tbps``. Every
input is larger than the 60 MB L2, so no rotation is needed. Inputs are random (never zeros).

Shapes (BF16): activations 32768x7168, 131072x2048, 16384x5120; weights 8x28672x4096,
128x1536x2048. Kernels: rowwise (row-major / blocked scales), columnwise (transposed data),
dual, weights (1x32 both orientations = dual of [E, N, K]; 32x32 both orientations), grouped
rowwise with blocked per-group scales (8 and 128 balanced groups); peers: the pure-torch
reference ``mxmoe.quantize`` on CUDA and torchao's MXFP8 cast if it imports.
On sm_90 (H100/H200) columnwise and dual run the Gluon kernel; the ``*_triton`` rows time the Triton kernel on
the same input (``MXMOE_QUANT_GLUON=0``). ``--sweep`` also times a few tile configurations per Triton
kernel, and of the Gluon kernel's tiles (rows tagged ``sweep``).
``--qdq`` times the MoE layer's QDQ kernels (``qdq_dual``, ``qdq_dual_bf16`` of BF16 activations; FP32
weights as the layer holds them, on Triton and forced onto the Gluon kernel with 4 or 8 elements per
thread). ``--ceiling`` times the data movement of the transposing kernels without the quantization: a Triton
kernel that stores each BF16 element's high byte transposed (``ceiling_columnwise``), or transposed
and in place (``ceiling_dual``), best of a few tiles, and torch's transposing cast to E4M3
(``torch_transpose_cast``): what a kernel of this tile design can reach at best.
``--groups 128`` (or ``--groups128``) times only the kernels of the Hopper-fast recipe (DESIGN §9, 1x128 / 128x1
groups and 128x128 tiles, ``*_128`` rows), beside the 1x32 kernels they replace (rowwise, dual, 32x32 weights);
the default ``--groups 32,128`` times both families in one run; with ``--sweep`` and 128 the Gluon tiles that
hold whole groups and a few Triton tiles of the row kernels. Rows carry ``timing`` (do_bench or cudagraph).
``--quick``: one activation and one weight shape, no pure-torch reference, shorter timings.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script (tests do)

from benchmarks import common as C  # noqa: E402
from mxmoe.formats import quantize  # noqa: E402
from mxmoe.kernels import layer as layer_kernels  # noqa: E402
from mxmoe.kernels import qdq as QDQ, quantize as Q, quantize_fused as QF  # noqa: E402
from mxmoe.kernels import quantize_launch as QL, quantize_tile_config as QT  # noqa: E402
from mxmoe.layouts import blocked_group_offsets, blocked_numel, to_blocked  # noqa: E402

ACTS = [(32768, 7168), (131072, 2048), (16384, 5120)]
WEIGHTS = [(8, 28672, 4096), (128, 1536, 2048)]
P, NP = True, False  # persistent (prefetching) launch / one program per tile
T = QT.TileConfig
# Columnwise families: register-limited occupancy (docs/quantization.md: 212-254 registers,
# 8 warps per SM at 64x64/w2); smaller per-thread tiles reach 12-20 warps per SM (offline sm_90
# compile: 64x64/w4 128 registers, 32x64/w2 96, 32x128/w2 154, 32x64/w1 116; dual ~40-90 more)
_COLS = [T(64, 64, 2, P), T(64, 128, 4, P), T(32, 256, 4, P), T(64, 64, 4, P), T(32, 64, 2, P), T(32, 128, 2, P),
         T(32, 64, 1, P)]
SWEEP = {  # _TUNED key -> candidate TileConfigs of mx_quantize_kernel
    "row": [T(32, 512, 8, P), T(32, 256, 4, P), T(32, 256, 4, NP), T(32, 512, 4, NP), T(32, 512, 8, NP),
            T(64, 256, 8, NP)],
    "col": _COLS,
    "colrow": _COLS,
    "colrow32": _COLS,
    "grouped": [T(32, 256, 4, P), T(32, 512, 8, P), T(32, 256, 4, NP)],
    # --groups128: BK % 128 == 0 (1x128 groups), BM % 128 == 0 for 128x128 tiles
    "row128": [T(32, 256, 4, P), T(32, 128, 4, NP), T(64, 256, 8, NP), T(32, 512, 8, NP), T(32, 512, 8, P)],
    "row128x128": [T(128, 128, 8, NP), T(128, 128, 16, NP), T(128, 256, 16, NP)],
}

# Gluon column-family kernel (quantize._GLUON_TILES): (MB, BK, WM, WK, TM), see quantize_gluon.py
GLUON_SWEEP = [(8, 64, 1, 4, 8), (4, 128, 1, 8, 4), (8, 64, 2, 4, 4), (4, 128, 1, 4, 4), (8, 64, 1, 8, 8),
               (4, 64, 1, 4, 4), (8, 32, 1, 4, 8), (16, 64, 4, 2, 4), (4, 64, 4, 1, 1),
               (4, 256, 1, 16, 4), (8, 128, 1, 16, 4)]  # 16 warps: 8-byte scale runs along K / along M
GLUON_SWEEP_RS = (32, 16)  # rows per thread in the column layout, each tile of GLUON_SWEEP with both

DEV = "cuda"
CUDAGRAPH = False  # --cudagraph
QUICK = False  # --quick: shorter timings


def bench_ms(fn, graph: bool | None = None) -> float:
    """Median ms of fn. do_bench clears L2 with a memset before each call, which also hides up to
    ~85 us of host time (H200); the wrappers take 75-115 us, so kernels shorter than that can time the
    host (results/h200/grouped_host_s6.txt). --cudagraph (``graph``, default CUDAGRAPH) replays the
    calls from a CUDA graph: kernel time only, no L2 clearing (every input here is larger than the
    60 MB L2)."""
    if DEV != "cuda":  # --dry-run: one timed call, only to exercise this script on a CPU
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return C.bench_ms(fn, QUICK, graph=CUDAGRAPH if graph is None else graph)


_copy_cache: dict[int, float] = {}


def copy_tbps(total_bytes: int) -> float:
    """Device-to-device copy of total_bytes/2 bytes (read + write = total_bytes), TB/s. Never from a CUDA
    graph: captured, copy_ becomes a memcpy node, which ran at 2.7 TB/s for 1 GB and more (H200),
    against 4.1-4.2 TB/s as a stream copy; one launch has no host time to hide."""
    n = total_bytes // 2 // 16 * 16
    if n not in _copy_cache:
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
        dst = torch.empty_like(src)
        ms = bench_ms(lambda: dst.copy_(src), graph=False)
        _copy_cache[n] = 2 * n / ms / 1e9
        del src, dst
    return _copy_cache[n]


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def wide_randn(shape) -> torch.Tensor:
    x = torch.randn(shape, device=DEV, dtype=torch.float32)
    x *= torch.exp2(torch.randint(-20, 21, (*shape[:-1], 1), device=DEV).to(torch.float32))
    return x.to(torch.bfloat16)


def balanced_offs(M: int, E: int) -> torch.Tensor:
    return (torch.arange(1, E + 1, device=DEV, dtype=torch.int64) * M // E).to(torch.int32)


def _triton_only(fn, x):
    """fn(x) with the Gluon columnwise/dual kernel switched off (the Triton kernel, for comparison)."""
    before = os.environ.get("MXMOE_QUANT_GLUON")
    os.environ["MXMOE_QUANT_GLUON"] = "0"
    try:
        return fn(x)
    finally:
        if before is None:
            del os.environ["MXMOE_QUANT_GLUON"]
        else:
            os.environ["MXMOE_QUANT_GLUON"] = before


def gluon_name(row: bool, x3: torch.Tensor) -> str:
    """The Gluon column kernel's tile for x3 (quantize._gluon_tile; ``row``: with a rowwise output)
    as a config label."""
    g = QT._gluon_tile(row, x3)
    return f"gluon {32 * g['MB']}x{g['BK']}/w{g['WM'] * g['WK']}/tm{g['TM']}/rs{g['RS']}"


def kernel_config(name: str, key, x: torch.Tensor) -> str:
    """What a case runs: the Gluon columnwise/dual kernel's tile, or the Triton kernel's TileConfig."""
    x3 = x if x.dim() == 3 else x[None]
    if key is None:
        return "default"
    if key in ("fused128", "swiglu128_save_h"):  # permute_quantize_128 / swiglu_quantize_128
        if not name.endswith("_triton") and QL._use_gluon(x3):
            if name.startswith("permute"):
                return gluon_name(True, x3)
            g = QT._GLUON_TILES_SWIGLU[name.endswith("save_h")]
            tma = "" if name.endswith(("save_h", "_regfed")) else f" TMA {QT._SWIGLU_TMA_STAGES}-stage"
            return f"gluon {32 * g['MB']}x{g['BK']}/w{g['WM'] * g['WK']}/tm{g['TM']}/rs{g['RS']}{tma}"
        return cfg_name(QT._config_128_fused(key == "swiglu128_save_h"))
    if key in ("col", "colrow", "colrow32", *GLUON_KEYS_128) and not name.endswith("_triton") and QL._use_gluon(x3):
        return gluon_name(key not in ("col", "col128"), x3)
    return cfg_name(QT._TUNED.get(key) or _default_cfg(key))


def qdq_cases(x: torch.Tensor, is_weight: bool):
    """(kernel name, fn, input) of the MoE layer's QDQ kernels (--qdq): activations BF16; weights as
    the layer holds them, FP32 master weights (made here, outside the timed call)."""
    if not is_weight:
        return [("qdq_dual", lambda: QDQ.qdq_dual(x), x),
                ("qdq_dual_triton", lambda: _triton_only(QDQ.qdq_dual, x), x),
                ("qdq_dual_bf16", lambda: QDQ.qdq_dual_bf16(x), x),
                ("qdq_dual_bf16_triton", lambda: _triton_only(QDQ.qdq_dual_bf16, x), x)]
    xf = x.float()
    return [("weight_qdq_dual_fp32", lambda: QDQ.qdq_dual(xf), xf),
            ("weight_qdq_dual_fp32_triton", lambda: _triton_only(QDQ.qdq_dual, xf), xf),
            ("weight_columnwise_fp32", lambda: Q.quantize_columnwise(xf), xf),
            ("weight_columnwise_fp32_triton", lambda: _triton_only(Q.quantize_columnwise, xf), xf)]


def qdq_config(name: str, x: torch.Tensor) -> str:
    """What a --qdq case runs (the dispatch's choice unless the name forces one)."""
    x3 = x if x.dim() == 3 else x[None]
    col_only = "columnwise" in name
    if not name.endswith("_triton") and QL._use_gluon(x3):
        return gluon_name(not col_only, x3)
    return cfg_name(QT._TUNED["col"] if col_only else QT._config_qdq(True))


def cases(x: torch.Tensor, is_weight: bool):
    """(kernel name, _TUNED key or None, fn) for one input."""
    out = []
    if not is_weight:
        out += [
            ("rowwise", "row", lambda: Q.quantize_rowwise(x)),
            ("rowwise_blocked", "row", lambda: Q.quantize_rowwise(x, scale_layout="blocked")),
            ("rowwise_sm90", "row", lambda: Q.quantize_rowwise(x, scale_layout="sm90")),
            ("columnwise", "col", lambda: Q.quantize_columnwise(x)),
            ("columnwise_triton", "col", lambda: _triton_only(Q.quantize_columnwise, x)),
            ("dual", "colrow", lambda: Q.quantize_dual(x)),
            ("dual_triton", "colrow", lambda: _triton_only(Q.quantize_dual, x)),
            ("dual_blocked", "colrow", lambda: Q.quantize_dual(x, scale_layout="blocked")),
            ("dual_sm90", "colrow", lambda: Q.quantize_dual(x, scale_layout="sm90")),
        ]
        M, K = x.shape
        for E in (8, 128):
            offs = balanced_offs(M, E)
            cap = int(blocked_group_offsets(offs)[-1])
            out.append((f"grouped_{E}", "grouped",
                        (lambda offs=offs, cap=cap: Q.quantize_grouped_rowwise(x, offs, padded_rows=cap))))
    else:
        out += [
            ("weight_rowwise_blocked", "row", lambda: Q.quantize_rowwise(x, scale_layout="blocked")),
            ("weight_columnwise", "col", lambda: Q.quantize_columnwise(x)),
            ("weight_columnwise_triton", "col", lambda: _triton_only(Q.quantize_columnwise, x)),
            ("weight_1x32_both", "colrow", lambda: Q.quantize_dual(x)),
            ("weight_1x32_both_triton", "colrow", lambda: _triton_only(Q.quantize_dual, x)),
            ("weight_1x32_both_blocked", "colrow", lambda: Q.quantize_dual(x, scale_layout="blocked")),
            ("weight_32x32_both", "colrow32", lambda: Q.quantize_32x32(x)),
            ("weight_32x32_both_triton", "colrow32", lambda: _triton_only(Q.quantize_32x32, x)),
            ("weight_32x32_both_sm90", "colrow32", lambda: Q.quantize_32x32(x, scale_layout="sm90")),
        ]
    return out


GLUON_KEYS_128 = ("col128", "colrow128", "colrow128x128")  # on sm_90 the Gluon kernel with GROUP 128


def permutation_src(n: int, T: int, device) -> torch.Tensor:
    """The first n rows of the --groups128 permutation of T tokens: row m reads token m * 7919 mod T (a prime
    stride, so neighbouring rows come from far apart, as routed tokens do; a permutation for T a power of two
    times a number coprime to 7919)."""
    return (torch.arange(n, device=device, dtype=torch.int64) * 7919 % T).to(torch.int32)


def cases128(x: torch.Tensor, is_weight: bool):
    """--groups128: (kernel name, key of QT._config_128 / _TUNED, fn) of the 1x128 / 128x128 kernels for one
    input, and the 1x32 kernels they replace (timed in the same run)."""
    if not is_weight:
        # fused forms: x gathered by a permutation (top-1, so every byte of x is read once); x as h [M, 2F] of SwiGLU
        src = permutation_src(x.shape[0], x.shape[0], x.device)
        return [
            ("rowwise_128", "row128", lambda: Q.quantize_rowwise_128(x)),
            ("rowwise", "row", lambda: Q.quantize_rowwise(x)),
            ("columnwise_128", "col128", lambda: Q.quantize_columnwise_128(x)),
            ("dual_128", "colrow128", lambda: Q.quantize_dual_128(x)),
            ("dual_128_triton", "colrow128", lambda: _triton_only(Q.quantize_dual_128, x)),
            ("dual", "colrow", lambda: Q.quantize_dual(x)),
            ("permute_128", "fused128", lambda: QF.permute_quantize_128(x, src)),
            ("permute_128_triton", "fused128", lambda: _triton_only(lambda t: QF.permute_quantize_128(t, src), x)),
            ("permute_qdq", None, lambda: QF.permute_qdq(x, src)),
            ("swiglu_128", "fused128", lambda: QF.swiglu_quantize_128(x)),
            ("swiglu_128_regfed", "fused128", lambda: QF._launch_swiglu(x, "rceil", False, fp8_rows=True, group=128,
                                                                          name="swiglu", tma=False)),
            ("swiglu_128_save_h", "swiglu128_save_h", lambda: QF.swiglu_quantize_128(x, save_h=True)),
            # the unfused pair it could be replaced by: the layer's elementwise SwiGLU, then the dual kernel on a
            ("swiglu_then_dual_128", "colrow128", lambda: Q.quantize_dual_128(layer_kernels.swiglu(x))),
            ("swiglu_128_triton", "fused128", lambda: _triton_only(QF.swiglu_quantize_128, x)),
            ("swiglu_qdq", None, lambda: QF.swiglu_qdq(x)),
        ]
    halves = (x[:, :x.shape[1] // 2], x[:, x.shape[1] // 2:])  # the gate and up weights [w1; w3] as two parts
    return [
        ("weight_128x128_both", "colrow128x128", lambda: Q.quantize_128x128(x)),
        ("weight_128x128_both_triton", "colrow128x128", lambda: _triton_only(Q.quantize_128x128, x)),
        ("weight_128x128_rows", "row128x128", lambda: Q.quantize_128x128(x, transposed=False)),
        ("weight_32x32_both", "colrow32", lambda: Q.quantize_32x32(x)),
    ] + ([
        # x as two parts along N: written in place (no concatenation), against concatenating them first
        ("weight_128x128_parts", "colrow128x128", lambda: Q.quantize_128x128_parts(halves)),
        ("weight_128x128_cat_then_both", "colrow128x128", lambda: Q.quantize_128x128(torch.cat(halves, 1))),
    ] if x.shape[1] % 256 == 0 else [])


def check128(name: str, x: torch.Tensor, out) -> bool:
    """check() for the --groups128 kernels (first rows / experts, whole 128-groups); False: not one of them."""
    if name in ("permute_qdq", "swiglu_qdq"):
        return True  # the 1x32 fused kernels, for comparison: checked by tests/test_qdq_kernels.py
    if not name.startswith(("rowwise_128", "columnwise_128", "dual_128", "weight_128x128", "permute_128",
                            "swiglu_128", "swiglu_then_dual_128")):
        return False
    sub = x[:2] if x.dim() == 3 else x[:256]
    n = sub.shape[0]
    want = []
    if name.startswith("permute_128"):
        sub = x[permutation_src(256, x.shape[0], x.device)]
    if name.startswith(("swiglu_128", "swiglu_then_dual_128")):
        F = x.shape[1] // 2
        sub = torch.nn.functional.silu(sub[:, :F]) * sub[:, F:]
        if name.endswith("save_h"):
            hq = quantize(x[:256], axis=-1, block=128)
            want = [(out[4][:n], hq.data), (out[5][:n], hq.scale)]
    if name.startswith("weight_128x128"):
        r = quantize(sub, axis=-1, block=(128, 128))
        want = [(out[0][:2], r.data), (out[1][:2], r.scale)]
        if len(out) == 4:
            c = quantize(sub, axis=-2, block=(128, 128))
            want += [(out[2][:2], c.data.mT), (out[3][:2], c.scale.mT)]
    else:
        if name.startswith(("rowwise", "dual", "swiglu", "permute")):
            r = quantize(sub, axis=-1, block=128)
            want += [(out[0][:n], r.data), (out[1][:n], r.scale)]
        if name.startswith(("columnwise", "dual", "swiglu", "permute")):
            c = quantize(sub, axis=-2, block=128)
            want += [(out[-2][:, :n], c.data.mT), (out[-1][:, :n // 32], c.scale.mT)] if name.startswith(
                ("columnwise", "dual")) else [(out[2][:, :n], c.data.mT), (out[3][:, :n // 32], c.scale.mT)]
    if not want:
        raise AssertionError(f"check128(): no reference for {name}")
    for got, ref in want:
        if not torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)):
            raise AssertionError(f"{name}: output differs from the reference")
    return True


def check(name: str, x: torch.Tensor, out) -> None:
    """Bit-exactness spot check against the reference (first rows / experts only)."""
    if check128(name, x, out):
        return
    if name.startswith("grouped"):
        return  # covered by the tests (needs the per-group layout reference)
    sub = x[:2] if x.dim() == 3 else x[:256]
    want = []
    if name in ("rowwise", "weight_rowwise_blocked", "rowwise_blocked", "rowwise_sm90"):
        r = quantize(sub, axis=-1)
        s = r.scale if name == "rowwise" else (torch.stack([to_blocked(t) for t in r.scale]) if x.dim() == 3 else None)
        want = [(out[0][:sub.shape[0]], r.data)] + ([(out[1][:sub.shape[0]], s)] if s is not None else [])
    elif name.startswith(("columnwise", "weight_columnwise")):
        c = quantize(sub, axis=-2)
        if x.dim() == 3:
            want = [(out[0][:2], c.data.mT), (out[1][:2], c.scale.mT)]
        else:
            want = [(out[0][:, :256], c.data.mT), (out[1][:, :8], c.scale.mT)]
    elif name.startswith(("dual", "weight_1x32_both")):  # both outputs (a tile config can break either one)
        r, c = quantize(sub, axis=-1), quantize(sub, axis=-2)
        cols, scols = ((slice(None), slice(256)), (slice(None), slice(8))) if x.dim() == 2 else ((slice(2),),) * 2
        want = [(out[0][:sub.shape[0]], r.data), (out[2][cols], c.data.mT)]
        if not name.endswith(("_blocked", "_sm90")):  # other scale layouts: checked by the tests
            want += [(out[1][:sub.shape[0]], r.scale), (out[3][scols], c.scale.mT)]
    elif name.startswith("weight_32x32_both"):
        r = quantize(sub, axis=-1, block=(32, 32))
        want = [(out[0][:2], r.data), (out[2][:2], r.data.mT)]
        if not name.endswith("_sm90"):  # compact Hopper scales: checked by the tests
            want.append((out[1][:2], r.scale))
    if not want:
        raise AssertionError(f"check(): no reference for {name}")
    for got, ref in want:
        if not torch.equal(got.contiguous().view(torch.uint8), ref.contiguous().view(torch.uint8)):
            raise AssertionError(f"{name}: output differs from the reference")


def cases_all(x: torch.Tensor, is_weight: bool):
    """Both families in one run: the 1x32 kernels, then the 1x128 / 128x128 ones (without cases128's repeats)."""
    first = cases(x, is_weight)
    names = {n for n, _, _ in first}
    return first + [c for c in cases128(x, is_weight) if c[0] not in names]


def torchao_fn(x: torch.Tensor):
    """torchao's MXFP8 cast (rowwise), or None with the reason."""
    try:
        from torchao.prototype.mx_formats.mx_tensor import MXTensor as AoMX  # type: ignore
    except Exception as e:  # noqa: BLE001
        return None, f"torchao not importable here ({type(e).__name__}: {e})"
    return (lambda: AoMX.to_mx(x, torch.float8_e4m3fn, 32)), None


SWEPT = ("rowwise", "columnwise_triton", "dual_triton", "grouped_8", "weight_rowwise_blocked",
         "weight_columnwise_triton", "weight_1x32_both_triton", "weight_32x32_both_triton",
         "rowwise_128", "weight_128x128_rows")


def cfg_name(cfg) -> str:
    cfg = QT.TileConfig(*cfg)
    return f"{cfg.BM}x{cfg.BK}/w{cfg.num_warps}/{'persistent' if cfg.persistent else 'grid'}"


def geomean_scores(rows, group, keep) -> dict:
    """{group(r): {config: geometric-mean ratio}} over the "sweep"/"auto" rows with keep(r), counting
    only configs timed on every shape of their group (the default config is timed once, as "auto")."""
    import math

    ratios: dict = {}
    for r in rows:
        if keep(r) and r["config"].startswith(("sweep ", "auto ")):
            ratios.setdefault(group(r), {}).setdefault(r["config"].split(" ", 1)[1], []).append(r["ratio"])
    out = {}
    for g, by_cfg in ratios.items():
        n = max(len(v) for v in by_cfg.values())
        out[g] = {c: math.exp(sum(map(math.log, v)) / n) for c, v in by_cfg.items() if len(v) == n}
    return out


def select_best(rows) -> dict:
    """Per kernel family: the swept config with the best geometric-mean ratio over all its rows."""
    best = {}
    for key, score in geomean_scores(rows, lambda r: r["key"], lambda r: r["kernel"] in SWEPT).items():
        name = max(score, key=score.get)
        best[key] = next(c for c in SWEEP.get(key, []) + [QT._TUNED.get(key) or _default_cfg(key)] if cfg_name(c) == name)
    return best


def _precompile_worker(jobs):
    """Compile kernels by launching them on tiny inputs (same specializations as the real shapes:
    every size a multiple of 16, unit inner stride); fills triton's on-disk cache."""
    for key, cfg in jobs:
        QT._TUNED[key] = QT.TileConfig(*cfg)
        for is_weight in (False, True):
            x = wide_randn((2, 256, 512) if is_weight else (512, 512))
            for _, k, fn in cases(x, is_weight) + cases128(x, is_weight):
                if k == key:
                    fn()
    torch.cuda.synchronize()
    return len(jobs)


def precompile(workers: int = 8, keys=None) -> None:
    """Compile every (kernel, config) of the run in parallel processes before timing anything."""
    import multiprocessing as mp

    keys = list(SWEEP) if keys is None else keys
    jobs = [(k, c) for k in keys for c in SWEEP[k]]
    jobs += [(k, None) for k in keys]  # the default configs
    jobs = [(k, c if c is not None else _default_cfg(k)) for k, c in jobs]
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_precompile_worker, chunks)


def _default_cfg(key: str):
    if key == "grouped":
        return QT._config_grouped()
    if "128" in key:
        return QT._config_128(row="row" in key, col=key.startswith("col"), tile32="128x128" in key)
    return QT._config_2d(row="row" in key, col="col" in key, tile32=key.endswith("32"))


CEILING_TILES = [(64, 64, 2), (64, 128, 4), (128, 64, 4), (128, 128, 4), (32, 128, 2), (128, 128, 8)]


def _ceiling_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_t_kernel(x_ptr, yt_ptr, y_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr, ROW: tl.constexpr):
        """x [B, M, K] BF16 -> yt [B, K, M] (and y [B, M, K] if ROW) bytes: each element's high byte."""
        n_m = tl.cdiv(M, BM)
        tm = tl.program_id(0) % n_m
        tk = tl.program_id(0) // n_m
        m = tm * BM + tl.arange(0, BM)[:, None]
        k = tk * BK + tl.arange(0, BK)[None, :]
        mask = (m < M) & (k < K)
        base = tl.program_id(1).to(tl.int64) * M * K
        x = tl.load(x_ptr + base + m.to(tl.int64) * K + k, mask=mask)
        q = (x.to(tl.int16, bitcast=True) >> 8).to(tl.uint8)
        tl.store(yt_ptr + base + k.to(tl.int64) * M + m, q, mask=mask)
        if ROW:
            tl.store(y_ptr + base + m.to(tl.int64) * K + k, q, mask=mask)

    return cast_t_kernel


def ceiling_cases(x: torch.Tensor):
    """(kernel, config, fn, bytes moved) of the data-movement skeletons for one BF16 input."""
    x3 = x if x.dim() == 3 else x[None]
    B, M, K = x3.shape
    yt = torch.empty(B, K, M, dtype=torch.uint8, device=x.device)
    y = torch.empty(B, M, K, dtype=torch.uint8, device=x.device)
    kern = _ceiling_kernel()
    out = []
    for row in (False, True):
        for BM, BK, w in CEILING_TILES:
            grid = (-(-M // BM) * -(-K // BK), B)
            fn = (lambda BM=BM, BK=BK, w=w, row=row, grid=grid:
                  kern[grid](x3, yt, y, M, K, BM=BM, BK=BK, ROW=row, num_warps=w))
            out.append(("ceiling_dual" if row else "ceiling_columnwise", f"{BM}x{BK}/w{w}", fn,
                        x.numel() * (4 if row else 3)))
    yt8 = yt.view(torch.float8_e4m3fn)
    out.append(("torch_transpose_cast", "copy_", lambda: yt8.copy_(x3.mT), x.numel() * 3))
    return out, (x3, yt, y)


def check_ceiling(x3, yt, y, row: bool) -> None:
    """The skeleton's bytes are the high bytes of x, transposed (and in place)."""
    hi = (x3.view(torch.int16) >> 8).to(torch.uint8)
    if not torch.equal(yt, hi.mT) or (row and not torch.equal(y, hi)):
        raise AssertionError("ceiling kernel: wrong bytes")


def offline_sm90(case_list, shapes, out_path: str | None, only=frozenset()) -> None:
    """--offline-sm90: compile each case's kernel for sm_90 on this machine (no GPU: Triton's driver is faked, the
    launch replaced by a compile of the same arguments and constexprs) and print registers, spill bytes, shared
    memory and SASS size (ptxas -v / cuobjdump of Triton's bundled tools); Gluon where the wrapper takes it on sm_90."""
    import re

    import triton

    from benchmarks.tools.offline_sm90 import install_compile_only, ptxas_and_sass

    compiled = install_compile_only()
    check_inputs = QL._check
    launchers = (Q, QDQ, QF, QL, QT)  # (each module reads its own reference to the shared helpers)

    def patch(name, value):
        for m in launchers:
            if hasattr(m, name):
                setattr(m, name, value)

    def check_cpu(*a, **k):  # the wrappers' checks, CPU tensors accepted
        patch("_interpreting", lambda: True)
        try:
            return check_inputs(*a, **k)
        finally:
            patch("_interpreting", lambda: False)

    patch("_check", check_cpu)
    patch("_interpreting", lambda: False)
    patch("_persistent_grid", lambda kernel, args, kwargs, total, device: total)
    patch("_use_gluon", lambda x3: os.environ.get("MXMOE_QUANT_GLUON", "1") != "0" and x3.stride(2) == 1)
    rows = []
    for shape, is_weight in shapes:
        x = wide_randn(shape)
        for name, key, fn in case_list(x, is_weight):
            if only and name not in only:
                continue
            compiled.clear()
            fn()
            k = compiled[-1]
            log, sass = ptxas_and_sass(k)
            regs, spill = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
            row = {"kernel": name, "shape": "x".join(map(str, shape)), "config": kernel_config(name, key, x),
                   "num_warps": k.metadata.num_warps, "registers": int(regs.group(1)) if regs else None,
                   "spill_store_bytes": int(spill.group(1)) if spill else None, "shared": k.metadata.shared,
                   "sass_instructions": len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+\S", sass, re.M))}
            rows.append(row)
            print(f"{name:28s} {row['config']:34s} warps {row['num_warps']:2d} regs {row['registers']} "
                  f"spill {row['spill_store_bytes']} smem {row['shared']} SASS {row['sass_instructions']}", flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"meta": {"what": "offline sm_90 compile (triton " + triton.__version__ + ")"}, "rows": rows}, f,
                      indent=1)


def build_parser() -> argparse.ArgumentParser:
    ap = C.parser("quantize", __doc__)
    ap.add_argument("--groups", default="32,128", choices=("32", "128", "32,128"),
                    help="kernel families: 32 (1x32 / 32x32), 128 (1x128 / 128x128, DESIGN §9), or both (default)")
    ap.add_argument("--groups128", action="store_true", help="the same as --groups 128")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tile configs")
    ap.add_argument("--no-reference", action="store_true", help="skip the slow pure-torch reference")
    ap.add_argument("--qdq", action="store_true",
                    help="also time the MoE layer's QDQ kernels, FP32 weights included (Gluon vs Triton)")
    ap.add_argument("--ceiling", action="store_true",
                    help="also time the transposing data movement without quantization (see above)")
    ap.add_argument("--precompile", type=int, default=0, metavar="N",
                    help="first compile all kernels in N parallel processes (fresh machines)")
    ap.add_argument("--precompile-only", action="store_true", help="compile, then exit")
    ap.add_argument("--kernels", default="",
                    help="comma-separated kernel names to run (e.g. columnwise,dual,weight_32x32_both); default all")
    ap.add_argument("--cudagraph", action="store_true",
                    help="time CUDA-graph replays (kernel time, no host time; see bench_ms)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU under TRITON_INTERPRET=1 (checks this script, times nothing)")
    ap.add_argument("--offline-sm90", action="store_true",
                    help="no GPU: compile every case's kernel for sm_90 and print registers / spills (--out: JSON)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    global DEV, ACTS, WEIGHTS, CUDAGRAPH, QUICK
    if args.groups128:
        args.groups = "128"
    args.groups128 = args.groups == "128"  # the 1x128 kernels only (their own sweep, reference and peers)
    case_list = {"32": cases, "128": cases128, "32,128": cases_all}[args.groups]
    if args.offline_sm90:
        DEV = "cpu"
        return offline_sm90(case_list, [((4096, 4096), False), ((4, 1024, 2048), True)], args.out,
                            set(filter(None, args.kernels.split(","))))
    if not args.dry_run:
        C.require_cuda("quantize")
    if args.out is None:
        args.out = C.default_out("quantize")
    CUDAGRAPH, QUICK = args.cudagraph, args.quick
    if args.quick:
        ACTS, WEIGHTS, args.no_reference = [(16384, 5120)], [(128, 1536, 2048)], True
    if args.dry_run:
        DEV, ACTS, WEIGHTS = "cpu", [(256, 512)], [(2, 128, 256)]

    only = set(filter(None, args.kernels.split(",")))
    t_start = time.time()
    if args.precompile and DEV == "cuda":
        keys = None
        if only:
            keys = sorted({k for w in (False, True)
                           for n, k, _ in case_list(wide_randn((2, 256, 512) if w else (256, 512)), w)
                           if n in only and k is not None})
        elif args.groups128:
            keys = ["row128", "row128x128"]
        precompile(args.precompile, keys)
        print(f"precompiled in {time.time() - t_start:.1f} s", flush=True)
        if args.precompile_only:
            return
    meta = C.header(
        "quantize", args.quick,
        dtype="bfloat16", groups=args.groups,
        timing=("triton.testing.do_bench_cudagraph median" if CUDAGRAPH else "triton.testing.do_bench median")
        + (", rep 30 ms" if QUICK else ", rep 100 ms"),
        bytes="input read + data and scales written",
        tuned={k: cfg_name(v) for k, v in QT._TUNED.items()},
    )
    rows = []
    notes = []

    def record(kernel, shape, total_bytes, ms, config="auto", key=None, extra=None):
        cp = copy_tbps(total_bytes)
        tb = total_bytes / ms / 1e9
        row = {"kernel": kernel, "shape": "x".join(map(str, shape)), "config": config, "key": key, "bytes": total_bytes,
               "ms": round(ms, 5), "tbps": round(tb, 4), "copy_tbps": round(cp, 4), "ratio": round(tb / cp, 4),
               "timing": "cudagraph" if CUDAGRAPH else "do_bench"}
        if extra:
            row.update(extra)
        rows.append(row)
        print(f"{kernel:24s} {row['shape']:>16s} {config:>14s} {ms * 1e3:9.1f} us {tb:6.3f} TB/s "
              f"copy {cp:6.3f}  {100 * tb / cp:5.1f}%", flush=True)

    def write_json():
        meta["notes"] = notes
        meta["wall_s"] = round(time.time() - t_start, 1)
        C.write_result(args.out, meta, rows)

    shapes = [(s, False) for s in ACTS] + [(s, True) for s in WEIGHTS]
    for shape, is_weight in shapes:
        x = wide_randn(shape)
        in_bytes = nbytes(x)
        # SwiGLU's input is h as the up projection gives it (N(0, 1)-like), not x's rows spread over 2^+-20:
        # exp(-g) overflows for g < -88 and IEEE division takes its slow path there, which real h never
        # reaches (on x the SwiGLU kernels ran at half their speed; check_silu_exhaustive.py)
        h = None if is_weight else torch.randn(shape, device=DEV).to(torch.bfloat16)
        on_h = {} if h is None else {n: (k, f) for n, k, f in case_list(h, is_weight) if "swiglu" in n}
        for name, key, fn in case_list(x, is_weight):
            if only and name not in only:
                continue
            xin = x
            if name in on_h:
                (key, fn), xin = on_h[name], h
            out = fn()
            sync()
            check(name, xin, out)
            total = in_bytes + nbytes(*[t for t in out if isinstance(t, torch.Tensor) and t.dtype != torch.int32])
            del out
            if args.sweep and name in ("columnwise", "dual", "weight_columnwise", "weight_1x32_both", "weight_32x32_both",
                                       "columnwise_128", "dual_128", "weight_128x128_both") \
                    and kernel_config(name, key, x).startswith("gluon"):
                tile = QT._GLUON_TILES["col" if "columnwise" in name else "dual", x.element_size()]
                saved = dict(tile)
                for (MB, BK, WM, WK, TM), RS in itertools.product(GLUON_SWEEP, GLUON_SWEEP_RS):
                    if not QT._gluon_tile_fits(MB, BK, WM, WK, TM, RS):
                        continue  # the kernel's layouts cannot be built from this tile
                    if "128" in name and (MB % 4 or ("columnwise" not in name and BK % 128)):
                        continue  # a 128-group would span two tiles
                    tile.update(MB=MB, BK=BK, WM=WM, WK=WK, TM=TM, RS=RS)
                    if tile == saved:
                        continue  # timed below as "auto"
                    try:
                        out = fn()
                        sync()
                        check(name, xin, out)
                        del out
                        record(name, shape, total, bench_ms(fn), config="sweep " + kernel_config(name, key, x))
                    except Exception as e:  # noqa: BLE001
                        print(f"sweep {name} gluon {MB, BK, WM, WK, TM, RS}: {type(e).__name__}: {e}", flush=True)
                tile.update(saved)
            if args.sweep and key is not None and name in SWEPT and (not args.groups128 or "128" in name):
                saved = QT._TUNED.get(key)
                for cfg in SWEEP[key]:
                    if cfg == (saved or _default_cfg(key)):
                        continue  # timed below as "auto"
                    QT._TUNED[key] = cfg
                    try:
                        out = fn()
                        sync()
                        check(name, xin, out)  # every config is checked, not only the default
                        del out
                        record(name, shape, total, bench_ms(fn), config="sweep " + cfg_name(cfg), key=key)
                    except Exception as e:  # noqa: BLE001
                        print(f"sweep {name} {cfg}: {type(e).__name__}: {e}", flush=True)
                if saved is None:
                    QT._TUNED.pop(key, None)
                else:
                    QT._TUNED[key] = saved
            record(name, shape, total, bench_ms(fn), config="auto " + kernel_config(name, key, x), key=key)
        write_json()  # after every shape, so a run cut short keeps what it measured
        if args.qdq:
            for name, fn, inp in qdq_cases(x, is_weight):
                out = fn()
                sync()
                total = nbytes(inp) + nbytes(*[t for t in out if isinstance(t, torch.Tensor)])
                del out
                record(name, shape, total, bench_ms(fn), config="auto " + qdq_config(name, inp))
        if args.ceiling:
            cc, bufs = ceiling_cases(x)
            for name, cfg, fn, total in cc:
                for buf in bufs[1:]:
                    buf.fill_(0xA5)  # poison: a tile that writes nothing fails the check
                fn()
                sync()
                if name != "torch_transpose_cast":
                    check_ceiling(*bufs, row=name == "ceiling_dual")
                record(name, shape, total, bench_ms(fn), config="ceiling " + cfg)
            del cc, bufs
        # peers
        if not args.no_reference:
            group = 128 if args.groups128 else 32
            ref_fn = (lambda: quantize(x, axis=-1, block=group))
            out = ref_fn()
            total = in_bytes + nbytes(out.data, out.scale)
            del out
            sync()
            record("torch_reference_rowwise" + ("_128" if args.groups128 else ""), shape, total, bench_ms(ref_fn))
        if not is_weight and not only and not args.groups128:
            fn, why = torchao_fn(x)
            if fn is None:
                if why not in notes:
                    notes.append(why)
            else:
                try:
                    out = fn()
                    total = in_bytes + nbytes(out.qdata if hasattr(out, "qdata") else out._data, out._scale_e8m0)
                    record("torchao_mxfp8_rowwise", shape, total, bench_ms(fn))
                except Exception as e:  # noqa: BLE001
                    notes.append(f"torchao failed: {type(e).__name__}: {e}")
        del x
        if DEV == "cuda":
            torch.cuda.empty_cache()

    best = select_best(rows) if args.sweep else {}
    meta["best_configs"] = {k: list(v) for k, v in best.items()}
    write_json()

    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}")
    for n in notes:
        print("note:", n)
    print(f"{'kernel':24s} {'shape':>16s} {'TB/s':>7s} {'copy':>7s} {'% copy':>7s}")
    for r in rows:
        if r["config"].startswith("auto"):
            print(f"{r['kernel']:24s} {r['shape']:>16s} {r['tbps']:7.3f} {r['copy_tbps']:7.3f} {100 * r['ratio']:6.1f}%"
                  f"  {r['config']}")
    ceil = {}
    for r in rows:
        if r["config"].startswith("ceiling") and r["ratio"] > ceil.get((r["kernel"], r["shape"]), {"ratio": -1})["ratio"]:
            ceil[(r["kernel"], r["shape"])] = r
    if ceil:
        print("\ndata-movement ceilings (best tile):")
        for r in ceil.values():
            print(f"{r['kernel']:24s} {r['shape']:>16s} {r['tbps']:7.3f} {r['copy_tbps']:7.3f} {100 * r['ratio']:6.1f}%"
                  f"  {r['config']}")
    gluon = geomean_scores(rows, lambda r: r["kernel"], lambda r: "gluon" in r["config"])  # the Gluon tile sweep
    if any(len(v) > 1 for v in gluon.values()):
        print("\nGluon tiles (geometric mean of % of copy over the shapes):")
        for kernel, score in gluon.items():
            for c in sorted(score, key=score.get, reverse=True):
                print(f"{kernel:24s} {c:28s} {100 * score[c]:5.1f}%")
    if best:
        print("\nbest config per kernel family (geometric mean over the swept shapes):")
        for r in rows:
            if r["key"] in best and r["config"].split(" ", 1)[1] == cfg_name(best[r["key"]]):
                print(f"{r['kernel']:24s} {r['shape']:>16s} {r['tbps']:7.3f} {r['copy_tbps']:7.3f} "
                      f"{100 * r['ratio']:6.1f}%  {r['config']}")
        print("_TUNED =", {k: tuple(v) for k, v in best.items()})
    print(f"wall {meta['wall_s']} s -> {args.out}")


if __name__ == "__main__":
    main()
