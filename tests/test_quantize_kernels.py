"""MXFP8 quantization kernels (mxmoe.kernels.quantize) against the pure-torch reference, bit for bit.

* CPU (CI): the Triton kernels run under ``TRITON_INTERPRET=1``. That variable must be set before
  triton is imported, and other test files import triton normally, so all interpreter cases run in
  ONE subprocess (this file run as a script with ``--cases``); each case is then reported as its
  own test. Skipped when triton is not installed.
* GPU (``-m gpu``): the same cases on CUDA plus real shapes and a tensor past 2^31 elements;
  skipped without CUDA.

Every case compares data and scale bytes with :func:`mxmoe.formats.quantize` (and
:mod:`mxmoe.layouts` for blocked scales) on random inputs with a wide dynamic range
(``randn * 2^randint(-20, 20)`` per row) plus special blocks (zero, subnormal, NaN, +-Inf, rceil
mantissa boundary, FP32 max, mixed huge/tiny).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from mxmoe.formats import quantize  # noqa: E402
from mxmoe.layouts import blocked_group_offsets, to_blocked, to_blocked_grouped  # noqa: E402

RULES = ("rceil", "floor")
LAYOUTS = ("row_major", "blocked", "sm90")
DTYPES = (torch.bfloat16, torch.float32)


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

def wide_randn(shape, dtype, device, gen):
    """randn * 2^randint(-20, 20) per row (rows = all dims but the last)."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    e = torch.randint(-20, 21, (*shape[:-1], 1), generator=gen).to(torch.float32)
    return (x * torch.exp2(e)).to(dtype).to(device)


def with_special_blocks(x: torch.Tensor, axis: int) -> torch.Tensor:
    """Overwrite some 32-blocks along ``axis`` of a 2D/3D tensor with edge-case contents."""
    xm = x.movedim(axis, -1).clone()  # blocks along the last dim now
    flat = xm.reshape(-1, xm.shape[-1])
    n_rows, L = flat.shape
    nb = L // 32
    fp32 = x.dtype == torch.float32
    tiny = 1e-40 if fp32 else 1e-39  # FP32 subnormal (bf16 keeps FP32's exponent range)
    specials = [
        lambda b: b.zero_(),
        lambda b: b.fill_(-0.0),
        lambda b: b.copy_(torch.linspace(-1, 1, 32) * tiny),            # subnormal block
        lambda b: b.copy_(torch.arange(32.0) * 1.5e-45) if fp32 else b.fill_(tiny),
        lambda b: b.__setitem__(5, float("nan")),
        lambda b: b.__setitem__(0, float("inf")),
        lambda b: b.__setitem__(31, float("-inf")),
        lambda b: b.copy_(torch.full((32,), 448.0 * 2**-3)),           # amax mantissa == 0x600000
        lambda b: b.__setitem__(3, 448.0 * 2**-3 * (1 + 2**-7)),       # just above the rceil boundary
        lambda b: b.__setitem__(7, 3.0e38 if fp32 else 3.0e38),          # near FP32 max
        lambda b: (b.__setitem__(0, 2.0**100), b.__setitem__(1, -2.0**-100), b.__setitem__(2, 2.0**-20)),
        lambda b: b.mul_(2.0**-130),                                     # whole block subnormal-ish
    ]
    for i, fn in enumerate(specials):
        r, c = (7 * i + 3) % n_rows, (5 * i + 1) % nb
        blk = flat[r, c * 32:(c + 1) * 32].to(torch.float32)
        fn(blk)
        flat[r, c * 32:(c + 1) * 32] = blk.to(x.dtype)
    return flat.reshape(xm.shape).movedim(-1, axis).contiguous()


# ------------------------------------------------------------------------------------------------
# Comparisons
# ------------------------------------------------------------------------------------------------

def same_bytes(got: torch.Tensor, want: torch.Tensor, what: str):
    got_b, want_b = got.view(torch.uint8).cpu(), want.contiguous().view(torch.uint8).cpu()
    assert got_b.shape == want_b.shape, f"{what}: shape {tuple(got_b.shape)} != {tuple(want_b.shape)}"
    bad = (got_b != want_b).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {got_b.numel()} bytes differ; first at "
                              f"{bad[0].tolist()}: got {got_b[tuple(bad[0])]:#04x} want {want_b[tuple(bad[0])]:#04x}")


def sm90_ref(scale: torch.Tensor) -> torch.Tensor:
    """The Hopper GEMM's scale layout of row-major scales [.., R, C]: FP32 2^(b-127) (byte 0 ->
    2^-127, 0xFF -> NaN 0x7FC00000), transposed to [.., C, ceil4(R)], zero padded (the contract of
    sm90_scales.sm90_scale_layout; the tests check both agree where it imports)."""
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    vals = bits.view(torch.float32).transpose(-2, -1)
    r = vals.shape[-1]
    out = torch.zeros(*vals.shape[:-1], -(-r // 4) * 4, dtype=torch.float32, device=scale.device)
    out[..., :r] = vals
    return out


def scale_ref(scale: torch.Tensor, layout: str) -> torch.Tensor:
    """Expected kernel scales for row-major reference scales in a given layout."""
    if layout == "row_major":
        return scale
    if layout == "blocked":
        return blocked_per_batch(scale)
    return sm90_ref(scale)


def blocked_per_batch(scale: torch.Tensor) -> torch.Tensor:
    """Reference blocked layout of [.., rows, cols] scales, one blocked matrix per batch entry."""
    if scale.dim() == 2:
        return to_blocked(scale)
    return torch.stack([to_blocked(s) for s in scale])


def _ref_input(x):
    """Reference inputs: small tensors on the CPU, large ones where they are (the reference is
    pure torch and runs on CUDA too)."""
    return x.cpu() if x.numel() <= 1 << 22 else x


def check_rowwise(Q, x, rule, layout, tag):
    ref = quantize(_ref_input(x), axis=-1, scale_rule=rule)
    data, scale = Q.quantize_rowwise(x, rule, layout)
    same_bytes(data, ref.data, f"{tag} rowwise data")
    same_bytes(scale, scale_ref(ref.scale, layout), f"{tag} rowwise {layout} scale")


def check_columnwise(Q, x, rule, layout, tag):
    ref = quantize(_ref_input(x), axis=-2, scale_rule=rule)
    data_t, scale_t = Q.quantize_columnwise(x, rule, layout)
    same_bytes(data_t, ref.data.mT, f"{tag} columnwise data")
    same_bytes(scale_t, scale_ref(ref.scale.mT.contiguous(), layout), f"{tag} columnwise {layout} scale")
    if layout == "row_major":
        mx = Q.columnwise_mxtensor(data_t, scale_t, rule)
        assert mx.axis == x.dim() - 2 and tuple(mx.shape) == tuple(x.shape)
        same_bytes(mx.data.contiguous(), ref.data, f"{tag} columnwise MXTensor data")
        same_bytes(mx.scale.contiguous(), ref.scale, f"{tag} columnwise MXTensor scale")


def check_dual(Q, x, rule, layout, tag):
    r = quantize(_ref_input(x), axis=-1, scale_rule=rule)
    c = quantize(_ref_input(x), axis=-2, scale_rule=rule)
    d, s, dt, st = Q.quantize_dual(x, rule, layout)
    same_bytes(d, r.data, f"{tag} dual row data")
    same_bytes(s, scale_ref(r.scale, layout), f"{tag} dual row {layout} scale")
    same_bytes(dt, c.data.mT, f"{tag} dual col data")
    same_bytes(st, scale_ref(c.scale.mT.contiguous(), layout), f"{tag} dual col {layout} scale")


def check_32x32(Q, x, rule, layout, tag):
    r = quantize(_ref_input(x), axis=-1, scale_rule=rule, block=(32, 32))
    c = quantize(_ref_input(x), axis=-2, scale_rule=rule, block=(32, 32))
    d, s, dt, st = Q.quantize_32x32(x, rule, layout)
    st_ref = c.scale.mT.contiguous()  # [.., K, N/32]
    if layout == "sm90":  # compact: one value per 32x32 tile
        want_s, want_st = sm90_ref(r.scale[..., ::32, :]), sm90_ref(st_ref[..., ::32, :])
    else:
        want_s, want_st = scale_ref(r.scale, layout), scale_ref(st_ref, layout)
    same_bytes(d, r.data, f"{tag} 32x32 data")
    same_bytes(s, want_s, f"{tag} 32x32 {layout} scale")
    same_bytes(dt, c.data.mT, f"{tag} 32x32 transposed data")
    same_bytes(dt, d.mT, f"{tag} 32x32 transposed data == data.mT")
    same_bytes(st, want_st, f"{tag} 32x32 transposed {layout} scale")


def check_grouped(Q, x, offs_list, rule, tag, extra_rows=0, offs_stride=1):
    offs = torch.tensor(offs_list, dtype=torch.int32)
    if offs_stride > 1:  # a strided view of the same values, junk between them
        spaced = torch.full((len(offs_list), offs_stride), -7, dtype=torch.int32)
        spaced[:, 0] = offs
        offs = spaced.reshape(-1)[::offs_stride]
    ref = quantize(_ref_input(x), axis=-1, scale_rule=rule)
    want_scale, want_offs = to_blocked_grouped(ref.scale, offs)
    padded = None
    if extra_rows:
        padded = int(blocked_group_offsets(offs)[-1]) + extra_rows if len(offs_list) else extra_rows
    data, scale, boffs = Q.quantize_grouped_rowwise(x, offs.to(x.device), rule, padded_rows=padded)
    same_bytes(data, ref.data, f"{tag} grouped data")
    same_bytes(boffs.cpu(), want_offs, f"{tag} grouped blocked offsets")
    if extra_rows:
        n = want_scale.numel()
        assert scale.numel() == padded * (-(-x.shape[1] // 128) * 4), f"{tag}: capacity"
        same_bytes(scale[:n], want_scale, f"{tag} grouped scale")
        assert int(scale.view(torch.uint8)[n:].to(torch.int32).abs().sum()) == 0, f"{tag}: padding rows not zero"
    else:
        same_bytes(scale, want_scale, f"{tag} grouped scale")


# ------------------------------------------------------------------------------------------------
# Cases: name -> fn(Q, device, gen). Small odd shapes: cheap under the interpreter.
# ------------------------------------------------------------------------------------------------

def _case_rowwise(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            x = with_special_blocks(wide_randn((100, 224), dt, "cpu", gen), -1).to(dev)
            for layout in LAYOUTS:
                check_rowwise(Q, x, rule, layout, f"{dt} {rule} {layout}")


def _case_columnwise(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            x = with_special_blocks(wide_randn((96, 72), dt, "cpu", gen), 0).to(dev)
            for layout in LAYOUTS:
                check_columnwise(Q, x, rule, layout, f"{dt} {rule} {layout}")


def _case_dual(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            x = wide_randn((160, 96), dt, "cpu", gen)
            x = with_special_blocks(with_special_blocks(x, -1), 0).to(dev)
            for layout in LAYOUTS:
                check_dual(Q, x, rule, layout, f"{dt} {rule} {layout}")


def _case_batched_weights(Q, dev, gen):
    """[E, N, K] weights: rowwise, columnwise ([E, K, N] data) and dual, per-expert blocked scales."""
    for dt in DTYPES:
        w = wide_randn((3, 64, 96), dt, "cpu", gen)
        w[1] = with_special_blocks(w[1], -1)
        w = w.to(dev)
        for rule, layout in (("rceil", "row_major"), ("floor", "blocked"), ("rceil", "sm90")):
            check_rowwise(Q, w, rule, layout, f"{dt} {rule} {layout}")
            check_columnwise(Q, w, rule, layout, f"{dt} {rule} {layout}")
            check_dual(Q, w, rule, layout, f"{dt} {rule} {layout}")


def _case_32x32(Q, dev, gen):
    for dt in DTYPES:
        for rule in RULES:
            w = wide_randn((2, 64, 160), dt, "cpu", gen)
            w[0] = with_special_blocks(w[0], -1)
            w = w.to(dev)
            for layout in LAYOUTS:
                check_32x32(Q, w, rule, layout, f"{dt} {rule} {layout}")
            check_32x32(Q, w[1], rule, "row_major", f"{dt} {rule} 2D")


def _case_grouped(Q, dev, gen):
    M, K = 300, 96
    for dt in DTYPES:
        for rule in RULES:
            x = with_special_blocks(wide_randn((M, K), dt, "cpu", gen), -1).to(dev)
            check_grouped(Q, x, [0, 37, 37, 200, 290, 290], rule, f"{dt} {rule} empty first/middle/last, tail rows")
    x = with_special_blocks(wide_randn((M, K), torch.bfloat16, "cpu", gen), -1).to(dev)
    check_grouped(Q, x, [M], "rceil", "single group")
    check_grouped(Q, x, [128, 256, 300], "floor", "128-aligned, async capacity", extra_rows=256)
    offs = sorted(torch.randint(0, M + 1, (34,), generator=gen).tolist())
    check_grouped(Q, x, offs, "rceil", "34 random groups (> 32 experts), async capacity", extra_rows=128)
    with warnings.catch_warnings():  # (the interpreter reports a division by zero as a RuntimeWarning)
        warnings.simplefilter("error")
        empty = x[:0]  # no rows, 33 empty groups: nothing to quantize, yet the launch has tiles
        check_grouped(Q, empty, [0] * 33, "rceil", "no rows, 33 groups")
        check_grouped(Q, empty, [0] * 33, "rceil", "no rows, 33 groups, capacity", extra_rows=256)


def _case_noncontiguous(Q, dev, gen):
    base = wide_randn((96, 256), torch.bfloat16, "cpu", gen).to(dev)
    xt = base.t()  # [256, 96], strides (1, 256)
    check_rowwise(Q, xt, "rceil", "row_major", "transposed input")
    check_columnwise(Q, xt, "floor", "blocked", "transposed input")
    xs = base[:, ::2]  # [96, 128], stride 2 along K
    check_dual(Q, xs, "rceil", "row_major", "strided input")
    check_32x32(Q, xs, "rceil", "row_major", "strided input")
    check_grouped(Q, base[:, 64:160], [40, 96], "rceil", "column slice")
    check_grouped(Q, base[:, 64:160], [40, 40, 96], "rceil", "strided offsets", offs_stride=2)


def _case_wide_k_scale_cols(Q, dev, gen):
    """K/32 not a multiple of 4 (K = 1408 -> 44 cols; K = 96 -> 3 cols) in blocked layout."""
    x = wide_randn((40, 1408), torch.bfloat16, "cpu", gen).to(dev)
    check_rowwise(Q, x, "rceil", "blocked", "K=1408")
    check_grouped(Q, x, [0, 13, 40], "rceil", "K=1408")


def _case_quantize_mx(Q, dev, gen):
    """dispatch.quantize_cuda (what mxmoe.quantize runs on CUDA, through the custom ops): the
    formats.quantize contract (up to .contiguous()) for every covered case."""
    from mxmoe.backend import resolve
    from mxmoe.kernels import dispatch

    x = with_special_blocks(wide_randn((2, 64, 96), torch.bfloat16, "cpu", gen), -1).to(dev)
    for axis in (-1, -2, 2, 1):
        for block in (32, (32, 32)):
            for rule in RULES:
                got = dispatch.quantize_cuda(x, axis, rule, block, resolve(x.device))
                want = quantize(x.cpu(), axis, rule, block)
                tag = f"quantize_cuda axis={axis} block={block} {rule}"
                assert got is not None and got.axis == want.axis and got.block == want.block, tag
                same_bytes(got.data.contiguous(), want.data, tag + " data")
                same_bytes(got.scale.contiguous(), want.scale, tag + " scale")
    be = resolve(x.device)
    assert dispatch.quantize_cuda(x, 0, "rceil", 32, be) is None  # the batch axis: not a kernel case
    assert dispatch.quantize_cuda(x.to(torch.float64), -1, "rceil", 32, be) is None


def _case_columnwise_families(Q, dev, gen, tag="families"):
    """columnwise, dual and 32x32 on a batched input with ragged K tiles, all three scale layouts."""
    w = wide_randn((2, 96, 224), torch.bfloat16, "cpu", gen)
    w[0] = with_special_blocks(with_special_blocks(w[0], -1), 0)
    w = w.to(dev)
    check_columnwise(Q, w, "rceil", "blocked", tag)
    check_columnwise(Q, w[1], "floor", "sm90", tag + " 2D")
    check_dual(Q, w, "floor", "row_major", tag)
    check_dual(Q, w[0], "rceil", "blocked", tag + " 2D")
    check_32x32(Q, w, "rceil", "sm90", tag)
    check_32x32(Q, w, "floor", "blocked", tag)


CASES = {
    "rowwise": _case_rowwise,
    "columnwise": _case_columnwise,
    "dual": _case_dual,
    "batched_weights": _case_batched_weights,
    "32x32": _case_32x32,
    "grouped": _case_grouped,
    "noncontiguous": _case_noncontiguous,
    "wide_k_scale_cols": _case_wide_k_scale_cols,
    "quantize_mx": _case_quantize_mx,
    "columnwise_families": _case_columnwise_families,
}


def run_cases(device: str, cases: dict | None = None) -> dict[str, str | None]:
    """Run every case (of ``cases``, default CASES); name -> None (passed) or the failure message."""
    from mxmoe.kernels import quantize as Q

    out = {}
    for name, fn in (CASES if cases is None else cases).items():
        gen = torch.Generator().manual_seed(hash(name) % 2**31)
        try:
            t0 = time.time()
            fn(Q, device, gen)
            print(f"case {name}: {time.time() - t0:.1f} s", file=sys.stderr)
            out[name] = None
        except Exception as e:  # report, keep going
            out[name] = f"{type(e).__name__}: {e}"
    return out


# ------------------------------------------------------------------------------------------------
# CPU: interpreter cases in one subprocess
# ------------------------------------------------------------------------------------------------

def _have_triton() -> bool:
    try:
        import importlib.util
        return importlib.util.find_spec("triton") is not None
    except Exception:
        return False


def run_interpreted_cases(script: str, timeout: int = 600) -> dict[str, str | None]:
    """Run ``script --cases`` (a test file whose ``--cases`` run prints ``RESULTS`` + run_cases' JSON) under
    TRITON_INTERPRET=1 in one subprocess; its results."""
    if not _have_triton():
        pytest.skip("triton not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(script), "--cases"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")][-1]
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted_cases(__file__)


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter(interpreter_results, case):
    err = interpreter_results[case]
    assert err is None, err


def test_sm90_ref_matches_gemm_contract():
    """Our reading of the Hopper GEMM's scale layout equals its own helper (where it imports)."""
    try:
        from mxmoe.kernels.sm90_scales import sm90_scale_layout
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"sm90 GEMM module not importable here: {e}")
    gen = torch.Generator().manual_seed(3)
    b = torch.randint(0, 256, (3, 37, 11), generator=gen, dtype=torch.int32).to(torch.uint8)
    b[0, 0, :3] = torch.tensor([0, 255, 254], dtype=torch.uint8)
    s = b.view(torch.float8_e8m0fnu)
    same_bytes(sm90_ref(s).view(torch.int32), sm90_scale_layout(s).view(torch.int32), "sm90 layout contract")


def test_import_does_not_need_triton():
    code = "import sys, mxmoe, mxmoe.kernels.quantize; assert 'triton' not in sys.modules, 'triton imported'"
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def patch_launchers(monkeypatch, name, value):
    """Set ``name`` to ``value`` in every quantization launcher module that holds it (each reads its own reference
    to the shared helpers: quantize, qdq, quantize_fused, quantize_launch, quantize_tile_config)."""
    from mxmoe.kernels import qdq, quantize, quantize_fused, quantize_launch, quantize_tile_config

    mods = [m for m in (quantize, qdq, quantize_fused, quantize_launch, quantize_tile_config) if hasattr(m, name)]
    assert mods, name
    for m in mods:
        monkeypatch.setattr(m, name, value)


def test_gluon_launch_contract(monkeypatch):
    """What the sm_90 dispatch hands the Gluon column kernel (recorded, not run: CPU): the output
    buffers it returns, their shapes and dtypes, the covered extent, the modes and scale strides."""
    from types import SimpleNamespace

    from mxmoe.kernels import qdq as QDQ, quantize as Q, quantize_tile_config as QT
    from mxmoe.layouts import blocked_numel

    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((grid, args, kw))

    patch_launchers(monkeypatch, "_interpreting", lambda: True)  # CPU tensors pass _check
    patch_launchers(monkeypatch, "_use_gluon", lambda x3: True)
    patch_launchers(monkeypatch, "_gluon", lambda: SimpleNamespace(mx_quantize_cols_kernel=Recorder()))

    def launch(fn, x, *a):
        calls.clear()
        out = fn(x, "rceil", *a)
        assert len(calls) == 1, f"{fn.__name__}: {len(calls)} launches"
        grid, args, kw = calls[0]
        x3, qc, sc, qr, sr, M, K, m_cover, k_cover, sxb, sxm, sc_b, sr_b, rceil = args
        assert x3.data_ptr() == x.data_ptr() and (M, K) == tuple(x.shape[-2:]) and (sxb, sxm) == tuple(x3.stride()[:2])
        assert rceil == 1 and kw["VEC"] == 8  # 8 elements per thread per load, FP32 included
        g = QT._gluon_tile(kw["ROW"], x3)
        assert g["RS"] == 32 or x.element_size() == 2  # FP32 input: 32 rows per thread in the column layout
        assert all(kw[k] == v for k, v in g.items()) and kw["num_warps"] == g["WM"] * g["WK"]
        assert grid == (x3.shape[0] * -(-m_cover // (32 * g["MB"])) * -(-k_cover // g["BK"]),)
        assert kw["K_FAST"] == (kw["ROW"] != 0 and kw["COL"] == 1)  # k-tiles fastest: row output + E4M3 columns
        return out, (qc, sc, qr, sr, m_cover, k_cover, sc_b, sr_b), kw

    x = torch.randn(3, 96, 200, dtype=torch.bfloat16)  # K = 200: not a multiple of the tile
    (dt, st), (qc, sc, _, _, mc, kc, sc_b, _), kw = launch(Q.quantize_columnwise, x, "blocked")
    assert (kw["ROW"], kw["COL"], kw["LAYOUT"]) == (0, 1, 1) and (mc, kc) == (128, 256)  # blocked: cover 128
    assert dt.data_ptr() == qc.data_ptr() and dt.shape == (3, 200, 96) and dt.dtype == torch.float8_e4m3fn
    assert st.data_ptr() == sc.data_ptr() and sc_b == st[0].numel() == blocked_numel(200, 3)

    x = torch.randn(64, 96, dtype=torch.float32)
    (d, s_, dt, st), (qc, sc, qr, sr, mc, kc, sc_b, sr_b), kw = launch(Q.quantize_dual, x, "sm90")
    assert (kw["ROW"], kw["COL"], kw["LAYOUT"]) == (1, 1, 2) and (mc, kc) == (64, 96)
    assert d.data_ptr() == qr.data_ptr() and d.shape == (64, 96) and s_.data_ptr() == sr.data_ptr()
    assert dt.data_ptr() == qc.data_ptr() and dt.shape == (96, 64) and st.data_ptr() == sc.data_ptr()
    assert st.dtype == s_.dtype == torch.float32 and (sc_b, sr_b) == (st.numel(), s_.numel())

    x = torch.randn(64, 96, dtype=torch.bfloat16)
    (xb, dt, st), (qc, sc, qr, _, mc, kc, sc_b, _), kw = launch(QDQ.qdq_dual, x)
    assert (kw["ROW"], kw["COL"], kw["LAYOUT"]) == (2, 1, 0) and (mc, kc) == (64, 96)
    assert xb.data_ptr() == qr.data_ptr() and xb.dtype == torch.bfloat16 and xb.shape == (64, 96)
    assert dt.data_ptr() == qc.data_ptr() and st.data_ptr() == sc.data_ptr() and sc_b == 96 * 2
    (xb, xbt), (qc, _, qr, _, _, _, _, _), kw = launch(QDQ.qdq_dual_bf16, x)
    assert (kw["ROW"], kw["COL"]) == (2, 2) and xbt.data_ptr() == qc.data_ptr() and xbt.shape == (96, 64)
    assert qc.dtype == torch.bfloat16 and xb.data_ptr() == qr.data_ptr() and not kw["TILE32"]

    w = torch.randn(2, 64, 96, dtype=torch.float32)  # 32x32 tiles, compact Hopper scales: cover 128
    (d, s_, dt, st), (qc, sc, qr, sr, mc, kc, sc_b, sr_b), kw = launch(Q.quantize_32x32, w, "sm90")
    assert kw["TILE32"] and (kw["ROW"], kw["COL"], kw["LAYOUT"]) == (1, 1, 2) and (mc, kc) == (128, 128)
    assert d.data_ptr() == qr.data_ptr() and dt.data_ptr() == qc.data_ptr() and dt.shape == (2, 96, 64)
    assert s_.shape == (2, 3, 4) and st.shape == (2, 2, 4) and (sr_b, sc_b) == (12, 8)  # [K/32, ceil4(M/32)]
    (xb, dt, st), (qc, sc, qr, _, mc, kc, sc_b, _), kw = launch(QDQ.qdq_dual, w, True)
    assert kw["TILE32"] and (kw["ROW"], kw["COL"], kw["LAYOUT"]) == (2, 1, 0) and (mc, kc) == (64, 96)
    assert xb.data_ptr() == qr.data_ptr() and dt.data_ptr() == qc.data_ptr() and st.shape == (2, 96, 2)


def test_gluon_tiles_fit_the_kernel_layouts():
    """Every tile of quantize._GLUON_TILES meets quantize_gluon's layout rules (its docstring): checked here,
    on CPU, so a new tile fails before it reaches a GPU."""
    from mxmoe.kernels import quantize_tile_config as QT

    assert {fam for fam, _ in QT._GLUON_TILES} == {"col", "dual"} and {w for _, w in QT._GLUON_TILES} == {2, 4}
    for key, t in QT._GLUON_TILES.items():
        assert set(t) == {"MB", "BK", "WM", "WK", "TM", "RS"} and QT._gluon_tile_fits(**t), key
        assert (key[1] == 4) <= (t["RS"] == 32), key  # FP32 input keeps 32 rows per thread (session 8)
    # the rule itself: each clause refuses a tile that breaks only it
    ok = dict(MB=4, BK=128, WM=1, WK=4, TM=4, RS=16)
    assert QT._gluon_tile_fits(**ok)
    for bad in (dict(TM=32), dict(RS=12), dict(MB=2), dict(BK=96), dict(WK=64), dict(BK=512), dict(TM=3)):
        assert not QT._gluon_tile_fits(**dict(ok, **bad)), bad


def test_input_errors():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("CPU tensors are accepted by the interpreter")
    from mxmoe.kernels import quantize as Q

    x = torch.randn(64, 64)
    with pytest.raises(ValueError, match="CUDA"):
        Q.quantize_rowwise(x)
    with pytest.raises(TypeError, match="dtype"):
        Q.quantize_rowwise(x.to(torch.int32))
    with pytest.raises(TypeError, match="dtype"):
        Q.quantize_rowwise(x.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="divisible"):
        Q.quantize_rowwise(torch.randn(64, 48, device="meta"))
    with pytest.raises(ValueError, match="divisible"):
        Q.quantize_columnwise(torch.randn(48, 64, device="meta"))
    with pytest.raises(ValueError, match="2D"):
        Q.quantize_rowwise(torch.randn(64, device="meta"))
    with pytest.raises(ValueError, match="scale_layout"):
        Q.quantize_rowwise(torch.randn(64, 64, device="meta"), scale_layout="tiled")
    with pytest.raises(ValueError):
        Q.quantize_rowwise(torch.randn(64, 64, device="meta"), scale_rule="round")
    with pytest.raises(ValueError, match="offs"):
        Q.quantize_grouped_rowwise(torch.randn(64, 64, device="meta"), torch.tensor([64]))


# ------------------------------------------------------------------------------------------------
# GPU
# ------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _poison_cuda_cache():
    """Fill freed blocks of the caching allocator with 0xAB so unwritten outputs show up."""
    blobs = [torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda") for n in (1 << 20, 1 << 24, 1 << 27)]
    del blobs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_cases(case):
    _poison_cuda_cache()
    gen = torch.Generator().manual_seed(1234 + len(case))
    from mxmoe.kernels import quantize as Q

    CASES[case](Q, "cuda", gen)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_real_shapes(dtype):
    """Activations 4096 x 7168 and weights 4 x 1536 x 2048, all kernels, both rules, bit-exact."""
    from mxmoe.kernels import quantize as Q

    gen = torch.Generator().manual_seed(7)
    x = with_special_blocks(wide_randn((4096, 7168), dtype, "cpu", gen), -1).cuda()
    w = wide_randn((4, 1536, 2048), dtype, "cpu", gen).cuda()
    for rule in RULES:
        _poison_cuda_cache()
        check_rowwise(Q, x, rule, "blocked", "act")
        check_columnwise(Q, x, rule, "row_major", "act")
        check_dual(Q, x, rule, "blocked", "act")
        check_32x32(Q, w, rule, "row_major", "weights")
        check_dual(Q, w, rule, "row_major", "weights")
        sizes = torch.distributions.Dirichlet(torch.ones(128)).sample() * 4096
        offs = torch.cumsum(sizes.floor().to(torch.int64), 0).clamp(max=4096)
        offs[:3] = 0  # empty experts first
        offs[-1] = 4096
        check_grouped(Q, x, offs.tolist(), rule, "act 128 groups")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_gluon_columnwise_and_dual(layout, monkeypatch):
    """The Gluon columnwise/dual/32x32 kernel (taken on sm_90): bit-exact against the reference and equal
    to the Triton kernel (MXMOE_QUANT_GLUON=0) on tile-edge shapes, batches, FP16/FP32, strided rows."""
    from mxmoe.kernels import quantize as Q, quantize_launch as QL

    gen = torch.Generator().manual_seed(5)
    big = with_special_blocks(wide_randn((2048, 7168), torch.bfloat16, "cpu", gen), 0).cuda()
    if not QL._use_gluon(big[None]):
        pytest.skip("the Gluon kernel is not used on this GPU")
    wide = wide_randn((256, 520), torch.float32, "cpu", gen).cuda()
    inputs = {
        "bf16 2048x7168 special column blocks": big,
        "bf16 2048x7168 special row blocks": with_special_blocks(big, -1),
        "fp32 96x224 (partial tiles)": with_special_blocks(wide_randn((96, 224), torch.float32, "cpu", gen), 0).cuda(),
        "fp16 3x160x96 batched": wide_randn((3, 160, 96), torch.float16, "cpu", gen).cuda(),
        "fp32 rows strided 256x320 of 256x520": wide[:, :320],
        "bf16 288x33 (odd K, columnwise only)": wide_randn((288, 33), torch.bfloat16, "cpu", gen).cuda(),
        "bf16 batch slice [::2] of 4x160x96": wide_randn((4, 160, 96), torch.bfloat16, "cpu", gen).cuda()[::2],
        "bf16 batch stride < row stride (160x3x96 transposed)":
            wide_randn((160, 3, 96), torch.bfloat16, "cpu", gen).cuda().transpose(0, 1),
        "fp16 view with a storage offset [1:, 32:]": wide_randn((3, 160, 96), torch.float16, "cpu", gen).cuda()[1:, 32:],
    }
    for tag, x in inputs.items():
        for rule in RULES:
            _poison_cuda_cache()
            check_columnwise(Q, x, rule, layout, tag)
            runs = [Q.quantize_columnwise]
            if x.shape[-1] % 32 == 0:
                check_dual(Q, x, rule, layout, tag)
                check_32x32(Q, x, rule, layout, tag)
                runs += [Q.quantize_dual, Q.quantize_32x32]
            for fn in runs:
                got = fn(x, rule, layout)
                monkeypatch.setenv("MXMOE_QUANT_GLUON", "0")
                want = fn(x, rule, layout)  # the Triton kernel
                monkeypatch.delenv("MXMOE_QUANT_GLUON")
                for g, w in zip(got, want, strict=True):
                    same_bytes(g, w, f"{tag} {rule} {fn.__name__}: Gluon vs Triton")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("key", ["row", "col", "colrow", "colrow32", "grouped"])
def test_gpu_tuned_configs(key):
    """Every tile config in use (quantize._TUNED, from the H200 sweeps) on real-size inputs, bit-exact."""
    from mxmoe.kernels import quantize as Q, quantize_tile_config as QT

    assert key in QT._TUNED
    gen = torch.Generator().manual_seed(11)
    x = with_special_blocks(wide_randn((2048, 7168), torch.bfloat16, "cpu", gen), -1).cuda()
    w = wide_randn((4, 1536, 2048), torch.bfloat16, "cpu", gen).cuda()
    for rule in RULES:
        _poison_cuda_cache()
        if key == "row":
            check_rowwise(Q, x, rule, "row_major", "act")
            check_rowwise(Q, w, rule, "blocked", "weights")
        elif key == "col":
            check_columnwise(Q, x, rule, "row_major", "act")
            check_columnwise(Q, w, rule, "sm90", "weights")
        elif key == "colrow":
            check_dual(Q, x, rule, "blocked", "act")
            check_dual(Q, w, rule, "row_major", "weights")
        elif key == "colrow32":
            check_32x32(Q, w, rule, "row_major", "weights")
            check_32x32(Q, w, rule, "sm90", "weights")
        else:
            check_grouped(Q, x, [0, 300, 300, 1500, 2000], rule, "act 5 groups")
    CASES["noncontiguous"](Q, "cuda", gen)


@pytest.mark.gpu
@needs_cuda
def test_gpu_past_2_31_elements():
    """x [65600, 32768] bf16 (2.15e9 elements): indices past 2^31 in input and outputs."""
    from mxmoe.kernels import quantize as Q

    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip("needs ~24 GiB of free GPU memory")
    M, K = 65600, 32768
    assert M * K > 2**31
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x[-7:, -40:] *= 2.0**40
    x[-1, -3] = float("nan")
    d, s, dt, st = Q.quantize_dual(x, "rceil", "row_major")
    tail_r = quantize(x[-64:], axis=-1)
    same_bytes(d[-64:], tail_r.data, "rows past 2^31 data")
    same_bytes(s[-64:], tail_r.scale, "rows past 2^31 scale")
    tail_c = quantize(x[:, -64:], axis=0)  # the last 64 rows of data_t (k near K: k*M + m > 2^31)
    same_bytes(dt[-64:], tail_c.data.t(), "transposed rows past 2^31 data")
    same_bytes(st[-64:], tail_c.scale.t(), "transposed rows past 2^31 scale")
    del d, s, dt, st
    _, sb = Q.quantize_rowwise(x, "rceil", "blocked")  # last 128-row tile holds rows 65536..65599
    same_bytes(sb[-128 * (K // 32):], to_blocked(quantize(x[-(M % 128):], axis=-1).scale), "blocked scales, last tile")


if __name__ == "__main__" and "--cases" in sys.argv:
    results = run_cases("cuda" if "--cuda" in sys.argv else "cpu")
    print("RESULTS " + json.dumps(results))
