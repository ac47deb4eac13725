"""Hopper (sm_90) MXFP8 grouped GEMMs against the FP64 product of the dequantized operands.

GPU tests need an sm_90 device and are skipped elsewhere (CI has none); the scale re-layout and
the argument checks that fire before any launch run on the CPU.
"""

import pytest
import torch

from mxmoe.formats import MXTensor, quantize
from mxmoe.kernels.sm90_gemm_promote32 import sm90_mxfp8_k_grouped_gemm, sm90_mxfp8_m_grouped_gemm
from mxmoe.kernels.sm90_scales import sm90_grouped_scale_layout, sm90_scale_layout

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
sm90 = pytest.mark.skipif(not IS_SM90, reason="needs an sm_90 (Hopper) GPU")

TOL_FP32_OUT = 2e-4  # FP32 output: Hopper FP8 wgmma sums each 32-deep step with truncated alignment (~4e-5)
TOL_BF16_OUT = 4e-3  # BF16 output: its own rounding (~1.7e-3 relative) dominates


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def _rand_blocks(*shape, device, gen=None):
    """Random data whose 32-blocks (along the last dim) span 2^-6..2^6, so every scale matters."""
    x = torch.randn(*shape, device=device, generator=gen)
    e = torch.randint(-6, 7, (*shape[:-1], shape[-1] // 32), device=device, generator=gen)
    return x * torch.exp2(e.float()).repeat_interleave(32, dim=-1)


def _offs(counts, device):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def _m_grouped_ref(ad, bd, counts, M):
    """FP64 M-grouped product: rows of group e of ad [M, K] times bd[e]^T ([E, N, K]); NaN past the groups."""
    ref = torch.full((M, bd.shape[1]), float("nan"), dtype=torch.float64, device=ad.device)
    start = 0
    for e, n in enumerate(counts):
        ref[start:start + n] = ad[start:start + n] @ bd[e].T
        start += n
    return ref


def _k_grouped_ref(ad, bd, counts):
    """FP64 K-grouped (wgrad) product [E, N, K]: each group's tokens of ad [N, T] times those of bd [K, T]."""
    ref = torch.zeros(len(counts), ad.shape[0], bd.shape[0], dtype=torch.float64, device=ad.device)
    start = 0
    for e, n in enumerate(counts):
        ref[e] = ad[:, start:start + n] @ bd[:, start:start + n].T
        start += n
    return ref


def _m_grouped_case(counts, N, K, weight_block, extra_rows=0, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    M = sum(counts) + extra_rows
    E = len(counts)
    a = quantize(_rand_blocks(M, K, device=device, gen=g))
    b = quantize(_rand_blocks(E, N, K, device=device, gen=g), axis=-1, block=(32, 32) if weight_block == 32 else 32)
    offs = _offs(counts, device)
    ref = _m_grouped_ref(a.dequantize(torch.float64), b.dequantize(torch.float64), counts, M)
    return a, b, offs, ref, sum(counts)


def _k_grouped_case(counts, N, K, extra_tokens=0, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(counts) + extra_tokens
    a = quantize(_rand_blocks(N, T, device=device, gen=g))  # dy^T, quantized along tokens
    b = quantize(_rand_blocks(K, T, device=device, gen=g))  # x^T
    offs = _offs(counts, device)
    return a, b, offs, _k_grouped_ref(a.dequantize(torch.float64), b.dequantize(torch.float64), counts)


def _run_m(a, b, offs, out_dtype, weight_block, config=None):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype, device=a.device)
    return sm90_mxfp8_m_grouped_gemm(a.data, a.scale, b.data, b.scale, offs, out_dtype=out_dtype,
                                     weight_block=weight_block, out=out, config=config)


# ----------------------------------------------------------------------------------------------
# CPU: scale re-layout and argument checks
# ----------------------------------------------------------------------------------------------

def test_scale_layout_values_and_transpose():
    b = torch.tensor([[0, 1, 127, 128], [200, 254, 255, 126], [3, 4, 5, 6]], dtype=torch.uint8)
    s = sm90_scale_layout(b.view(torch.float8_e8m0fnu))
    assert s.shape == (4, 4) and s.dtype == torch.float32  # [C, R padded to 4]
    want = torch.exp2(b.double() - 127).float().T
    want[2, 1] = float("nan")  # byte 0xFF
    torch.testing.assert_close(s[:, :3], want, equal_nan=True, rtol=0, atol=0)
    assert s[0, 0].item() == 2.0 ** -127  # byte 0x00 is 2^-127, not 0
    assert torch.all(s[:, 3] == 0)


def test_scale_layout_batched():
    b = torch.randint(0, 255, (3, 5, 7), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    s = sm90_scale_layout(b)
    assert s.shape == (3, 7, 8)
    assert torch.equal(s[1, :, :5], torch.exp2(b[1].view(torch.uint8).double() - 127).float().T)


@pytest.mark.parametrize("counts, extra", [([100, 0, 333, 27, 0], 5), ([0, 130, 70], 0), ([3, 1, 0, 200] * 9, 7)])
def test_grouped_scale_layout_aligns_every_group(counts, extra):
    M = sum(counts) + extra
    sc = torch.randint(0, 256, (M, 5), dtype=torch.uint8)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    vals, starts = sm90_grouped_scale_layout(sc.view(torch.float8_e8m0fnu), offs)
    assert vals.shape[0] == 5 and vals.shape[1] % 4 == 0 and starts.dtype == torch.int32
    want = sm90_scale_layout(sc.view(torch.float8_e8m0fnu))  # [5, M_pad], same values, ungrouped
    row = 0
    for e, n in enumerate(counts):
        s = int(starts[e])
        assert s % 4 == 0  # a TMA box must start 16-byte aligned in its inner dim
        torch.testing.assert_close(vals[:, s:s + n], want[:, row:row + n], equal_nan=True, rtol=0, atol=0)
        if e + 1 < len(counts):
            assert int(starts[e + 1]) >= s + n  # groups never overlap
        row += n


def test_fit_box_pads_only_small_operands():
    from mxmoe.kernels.sm90_gemm_launch import _fit_box
    big = torch.randn(256, 128).to(torch.float8_e4m3fn)
    assert _fit_box(big, [128, 128]) is big
    small = torch.randn(100, 96).to(torch.float8_e4m3fn)  # K < 128: the TMA box would overhang
    padded = _fit_box(small, [128, 128])
    assert padded.shape == (128, 128) and padded.dtype == small.dtype
    assert torch.equal(padded[:100, :96].view(torch.uint8), small.view(torch.uint8))
    assert padded.view(torch.uint8)[100:].sum() == 0 and padded.view(torch.uint8)[:, 96:].sum() == 0


def test_tile_config_deep_stages_only_for_32x32_m_grouped():
    from mxmoe.kernels.sm90_tile_config import SMEM_PER_CTA, Sm90TileConfig, sm90_tile_config, smem_bytes
    deep = sm90_tile_config(16384, 2048, 4096, 8, weight_block=32)
    assert (deep.block_k, deep.stages) == (256, 2)
    default = Sm90TileConfig()
    assert sm90_tile_config(16384, 2048, 4096, 8, weight_block=1) == default
    assert sm90_tile_config(16384, 2048, 1408, 8, weight_block=32) == default  # K not a multiple of 256
    assert sm90_tile_config(2048, 4096, 16384, 8, k_grouped=True) == default
    # the ring at BK 256 (B-scale boxes of 32x32 weights: [KB, 8]) + the BF16 output staging buffer fit in 227 KB
    smem = smem_bytes(deep, 8, 2)
    assert smem <= SMEM_PER_CTA == 227 * 1024, smem


def test_tile_config_check_refuses_unaligned_scale_boxes():
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig, check_tile_config
    check_tile_config(Sm90TileConfig(block_k=64, stages=8), weight_block=1)  # 1x32: boxes of 4 * BN bytes
    check_tile_config(Sm90TileConfig(block_k=256, stages=3), weight_block=32)
    with pytest.raises(ValueError, match="multiple of 128"):
        check_tile_config(Sm90TileConfig(block_k=64, stages=8), weight_block=32)
    with pytest.raises(ValueError, match="multiple of 32"):
        check_tile_config(Sm90TileConfig(block_k=48))


def test_tma_store_epilogue_only_where_it_fits():
    """The TMA-store epilogue needs 16-byte aligned rows, a tensor at least one box large and room for
    its staging buffer beside the ring; everywhere else the kernel keeps masked register stores."""
    pytest.importorskip("triton.experimental.gluon")
    from mxmoe.kernels.sm90_gemm_launch import _out_desc
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
    cfg = Sm90TileConfig()
    big16 = torch.empty(1024, 512, dtype=torch.bfloat16)
    assert _out_desc(big16, cfg, 128).block_shape == [64, 128]
    assert _out_desc(torch.empty(1024, 512), cfg, 128) is not None  # FP32 (wgrad) fits at 128 x 4
    assert _out_desc(big16, Sm90TileConfig(tma_store=False), 128) is None
    assert _out_desc(torch.empty(1024, 100, dtype=torch.bfloat16), cfg, 128) is None  # 200-byte rows
    assert _out_desc(torch.empty(48, 512, dtype=torch.bfloat16), cfg, 128) is None  # fewer rows than a box
    assert _out_desc(big16, Sm90TileConfig(block_k=256, stages=3), 8) is None  # 210 KB ring + 32 KB: no room
    assert _out_desc(big16, Sm90TileConfig(block_k=256, stages=2), 8) is not None
    assert _out_desc(torch.empty(1024, 512), Sm90TileConfig(block_k=256, stages=2), 8) is not None  # 32x32, FP32 out
    assert _out_desc(torch.empty(1024, 96, dtype=torch.bfloat16), cfg, 128) is None  # narrower than a box
    assert _out_desc(big16.view(-1)[4:4 + 1000 * 512].view(1000, 512), cfg, 128) is None  # base 8 bytes off
    assert _out_desc(big16, Sm90TileConfig(split_wg=False), 128).block_shape == [128, 128]  # one 8-warp partition


def test_argument_checks_before_launch():
    a = quantize(torch.randn(64, 64))
    b = quantize(torch.randn(2, 32, 64))
    offs = torch.tensor([32, 64], dtype=torch.int32)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        sm90_mxfp8_m_grouped_gemm(a.data.float(), a.scale, b.data, b.scale, offs)
    with pytest.raises(ValueError, match="multiple of 32"):
        sm90_mxfp8_m_grouped_gemm(a.data[:, :48].contiguous(), a.scale, b.data, b.scale, offs)
    with pytest.raises(ValueError, match="contiguous"):
        sm90_mxfp8_m_grouped_gemm(a.data.T, a.scale, b.data, b.scale, offs)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        sm90_mxfp8_k_grouped_gemm(a.data.to(torch.bfloat16), a.scale, a.data, a.scale, offs)


# ----------------------------------------------------------------------------------------------
# GPU: M-grouped (fprop / dgrad)
# ----------------------------------------------------------------------------------------------

M_CASES = [
    # (counts per expert, N, K, extra rows past offs[-1])
    ([256, 256, 256, 256], 256, 512, 0),  # balanced, tile-aligned
    ([100, 0, 333, 27, 0], 96, 1408, 5),  # odd groups (one starts at row 433), empty middle/last; K = 1408
    ([0, 130, 70], 160, 1440, 0),  # empty first; K/32 = 45 (not a multiple of 4): a 1-step tail stage
    ([517], 384, 96, 0),  # single group; K shorter than one 128 stage
    ([3, 1, 0, 200, 64, 0, 0, 129] * 5, 128, 256, 7),  # 40 experts, skewed
]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("weight_block", [1, 32])
@pytest.mark.parametrize("case", M_CASES)
def test_m_grouped_matches_fp64(case, weight_block):
    counts, N, K, extra = case
    a, b, offs, ref, rows = _m_grouped_case(counts, N, K, weight_block, extra)
    out32 = _run_m(a, b, offs, torch.float32, weight_block)
    assert not out32[:rows].isnan().any(), "a valid row was not written"
    err32 = _rel_err(out32[:rows], ref[:rows])
    assert err32 <= TOL_FP32_OUT, err32
    out16 = _run_m(a, b, offs, torch.bfloat16, weight_block)
    assert not out16[:rows].isnan().any()
    err16 = _rel_err(out16[:rows], ref[:rows])
    assert err16 <= TOL_BF16_OUT, err16
    print(f"m_grouped counts={counts[:6]} N={N} K={K} wb={weight_block}: rel_err fp32={err32:.2e} bf16={err16:.2e}")


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("weight_block", [1, 32])
@pytest.mark.parametrize("case", [M_CASES[1], M_CASES[2], M_CASES[0]])
@pytest.mark.parametrize("stages", [2, 3])
def test_m_grouped_deep_stages_match_fp64(case, weight_block, stages):
    """BK 256 forced on every weight variant, tails of 4 and 5 MX steps included (K 1408, 1440), against
    the same FP64 reference: 2 stages (the 32x32 default, TMA-store epilogue) and 3 (session 9's
    default; no room for the TMA store's buffer, so register stores)."""
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
    counts, N, K, extra = case
    a, b, offs, ref, rows = _m_grouped_case(counts, N, K, weight_block, extra, seed=7)
    out = _run_m(a, b, offs, torch.float32, weight_block, config=Sm90TileConfig(block_k=256, stages=stages))
    assert not out[:rows].isnan().any(), "a valid row was not written"
    assert _rel_err(out[:rows], ref[:rows]) <= TOL_FP32_OUT


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("weight_block", [1, 32])
def test_m_grouped_vector_search_equals_binary_search(weight_block):
    """The vector group search (vec_search=True: consumers up to 256 groups, the producer's binary search past
    128) against the binary search, byte for byte: 150 groups, a quarter of them empty, odd sizes."""
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
    g = torch.Generator().manual_seed(5)
    counts = torch.randint(1, 150, (150,), generator=g)
    counts[torch.randperm(150, generator=g)[:37]] = 0
    a, b, offs, ref, rows = _m_grouped_case(counts.tolist(), 128, 256, weight_block, 3, seed=9)
    o_vec = _run_m(a, b, offs, torch.float32, weight_block, config=Sm90TileConfig(vec_search=True))
    o_bin = _run_m(a, b, offs, torch.float32, weight_block, config=Sm90TileConfig(vec_search=False))
    assert torch.equal(o_vec[:rows].view(torch.int32), o_bin[:rows].view(torch.int32))
    assert _rel_err(o_vec[:rows], ref[:rows]) <= TOL_FP32_OUT


@sm90
@pytest.mark.gpu
def test_m_grouped_odd_n_1x32():
    a, b, offs, ref, rows = _m_grouped_case([77, 0, 190], 200, 320, 1)
    out = _run_m(a, b, offs, torch.float32, 1)
    assert _rel_err(out[:rows], ref[:rows]) <= TOL_FP32_OUT


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("weight_block", [1, 32])
def test_m_grouped_bitwise_rerun(weight_block):
    a, b, offs, _, _ = _m_grouped_case([300, 0, 129, 600], 256, 1024, weight_block, seed=3)
    o1 = _run_m(a, b, offs, torch.bfloat16, weight_block)
    o2 = _run_m(a, b, offs, torch.bfloat16, weight_block)
    assert torch.equal(o1.view(torch.int16), o2.view(torch.int16))


@sm90
@pytest.mark.gpu
def test_m_grouped_nan_scale_propagates():
    a, b, offs, _, rows = _m_grouped_case([64, 64], 128, 256, 1, seed=5)
    sc = a.scale.view(torch.uint8).clone()
    sc[10, 3] = 0xFF  # one NaN block in row 10
    a_nan = MXTensor(a.data, sc.view(torch.float8_e8m0fnu), a.axis)
    out = _run_m(a_nan, b, offs, torch.float32, 1)
    assert out[10].isnan().all()
    assert not out[:10].isnan().any() and not out[11:rows].isnan().any()


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("weight_block", [1, 32])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_tma_store_epilogue_matches_register_stores(weight_block, out_dtype):
    """Same products, two epilogues: tiles whose rows fill their group go out through shared memory
    and TMA stores, the rest (and everything with tma_store=False) through masked register stores.
    Bit-identical outputs, rows past offs[-1] untouched (still NaN) in both."""
    from mxmoe.kernels.sm90_gemm_launch import _out_desc
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
    a, b, offs, ref, rows = _m_grouped_case([256, 0, 300, 128, 77, 0, 640], 384, 512, weight_block, extra_rows=40,
                                            seed=11)
    cfg_on = Sm90TileConfig(tma_store=True)
    probe = torch.empty(a.shape[0], 384, dtype=out_dtype, device="cuda")
    assert _out_desc(probe, cfg_on, 8 if weight_block == 32 else 128) is not None, "the TMA path must be taken"
    on = _run_m(a, b, offs, out_dtype, weight_block, config=cfg_on)
    off = _run_m(a, b, offs, out_dtype, weight_block, config=Sm90TileConfig(tma_store=False))
    assert torch.equal(on[:rows], off[:rows])
    assert on[rows:].isnan().all() and off[rows:].isnan().all()
    assert _rel_err(on[:rows], ref[:rows]) <= (TOL_FP32_OUT if out_dtype == torch.float32 else TOL_BF16_OUT)


# ----------------------------------------------------------------------------------------------
# GPU: K-grouped (wgrad)
# ----------------------------------------------------------------------------------------------

K_CASES = [
    # (token counts per expert, multiples of 32; N, K; extra tokens past offs[-1])
    ([256, 256, 256, 256], 256, 256, 0),
    ([64, 0, 160, 96, 0], 200, 96, 32),  # empty middle/last, groups not multiples of 128, odd N
    ([0, 32, 416], 128, 160, 0),  # empty first
    ([1024], 384, 256, 0),  # single group
    ([32, 0, 96, 0, 0, 224, 64, 32, 0] * 4, 128, 128, 0),  # 36 experts
    ([1568, 0, 32, 96, 0, 640] + [32] * 26, 512, 384, 0),  # 384 tiles > 132 CTAs, skewed: the tile counter
]


@sm90
@pytest.mark.gpu
@pytest.mark.parametrize("case", K_CASES)
def test_k_grouped_matches_fp64(case):
    counts, N, K, extra = case
    a, b, offs, ref = _k_grouped_case(counts, N, K, extra)
    out = torch.full((len(counts), N, K), float("nan"), device="cuda")
    sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs, out=out)
    assert not out.isnan().any(), "an output element was not written"
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.all(out[e] == 0), "an empty expert must get a zero gradient"
    err = _rel_err(out, ref)
    assert err <= TOL_FP32_OUT, err
    out16 = sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs, out_dtype=torch.bfloat16)
    err16 = _rel_err(out16, ref)
    assert err16 <= TOL_BF16_OUT, err16
    print(f"k_grouped counts={counts[:6]} N={N} K={K}: rel_err fp32={err:.2e} bf16={err16:.2e}")


@sm90
@pytest.mark.gpu
def test_k_grouped_bitwise_rerun_and_offset_check():
    a, b, offs, _ = _k_grouped_case([96, 0, 320], 256, 192, seed=7)
    o1 = sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs)
    o2 = sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs)
    assert torch.equal(o1, o2)
    with pytest.raises(ValueError, match="multiple of 32"):
        sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs + 1)


@sm90
@pytest.mark.gpu
def test_k_grouped_tma_store_matches_register_stores():
    """wgrad with N not a multiple of 128: each expert's last row tile spills into the next expert's
    rows of the [E*N, K] view, so it keeps masked stores; the rest go out through TMA stores."""
    from mxmoe.kernels.sm90_gemm_launch import _out_desc
    from mxmoe.kernels.sm90_tile_config import Sm90TileConfig
    a, b, offs, _ = _k_grouped_case([96, 0, 320, 64], 200, 384, seed=13)
    probe = torch.empty(4 * 200, 384, device="cuda")
    assert _out_desc(probe, Sm90TileConfig(tma_store=True), 128) is not None, "the TMA path must be taken"
    on = sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs, config=Sm90TileConfig(tma_store=True))
    off = sm90_mxfp8_k_grouped_gemm(a.data, a.scale, b.data, b.scale, offs, config=Sm90TileConfig(tma_store=False))
    assert torch.equal(on, off)
    assert torch.all(on[1] == 0)



def test_refuses_triton_releases_it_was_not_written_for(monkeypatch):
    """Under a Triton whose Gluon API differs (3.9 renamed what the kernel uses) the products stop with an
    error naming both versions instead of a compile error deep in Gluon."""
    import mxmoe.kernels.sm90_gemm_launch as G

    if not G.HAS_GLUON:
        pytest.skip("triton without Gluon")
    from types import SimpleNamespace

    hopper_tensor = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))  # (no GPU here)
    monkeypatch.setattr(G, "capability", lambda index: (9, 0))
    monkeypatch.setattr(G, "_triton_release", lambda: (3, 9))
    with pytest.raises(RuntimeError, match=r"written for triton 3\.6"):
        G._check_sm90(hopper_tensor)
    with pytest.raises(ValueError, match="CUDA tensors"):  # a CPU tensor is refused first, on any release
        G._check_sm90(torch.empty(1))
    monkeypatch.setattr(G, "_triton_release", lambda: (3, 6))
    G._check_sm90(hopper_tensor)  # passes
