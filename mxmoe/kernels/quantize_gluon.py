"""Gluon (sm_90) MXFP8 quantization kernel for the column outputs: columnwise and dual.

Same contract and numerics as :func:`mxmoe.kernels.quantize_triton.mx_quantize_kernel` with
``COL=True`` (and ``ROW`` for dual), ``TILE32=False``; the scale and E4M3 rules are those of the
module docstring of :mod:`mxmoe.kernels.quantize_triton` (integer max of the FP32 bits of |x|, E8M0
byte ``E - 8 (+1 rceil)`` clamped to [0, 254], 0xFF / data 0x7F for NaN/Inf blocks, E4M3 by
``cvt.rn.satfinite.e4m3x2.f32``). Selected by ``MXMOE_QUANT_GLUON=1`` in
:mod:`mxmoe.kernels.quantize` (:func:`supported` says when it applies).

Why a separate kernel (benchmarks/NOTES_quantize.md): in the Triton kernel the 32-row maximum of a
column block crosses warps and the transposed byte store goes through shared memory again, and a
CTA only keeps its own next tile's loads in flight. Here the layouts are explicit::

    x [B, M, K] --TMA ring (STAGES tiles in flight per CTA)--> smem tile [W, 32, BK] (128-byte swizzle)
        column read: thread = 32 rows x VEC columns (size_per_thread [1, 32, VEC], lanes along K,
                     warp w = row block w): the 32x1 max is in-thread (no shuffles, no barrier);
                     the 32 E4M3 bytes of a column are stored as one 32-byte run of qc[k, m0:m0+32]
        row read (dual): thread = 1 row x BK/4 columns (lanes [8 rows, 4 along K]): the 1x32 max
                     is in-thread plus 1 (BF16) or 2 (FP32) shuffles; 32-byte runs of qr[m, k..]

Both reads of the 128-byte-swizzled tile are free of bank conflicts (one 128-byte row per column
read instruction; 8 rows x 16 bytes per quarter-warp for the row read, different swizzle phases).

Tile = W row blocks of 32 rows x BK columns (BK = 128 bytes of input: 64 BF16/FP16 or 32 FP32), one
warp per row block; W TMA boxes [1, 32, BK] per tile from a 3D descriptor of x [B, M, K] (zero
fill past M, K: the blocked scale layout's padding rows come out as byte 0). Tile order: bands of
GM m-tiles, M fastest inside a band, then K, then batch; CTA p of a persistent grid takes tiles
p, p + P, ... . A barrier after each tile frees its ring slot for the TMA of tile i + STAGES.

Inputs: ``x3`` [B, M, K] bf16/fp16/fp32 CUDA, last dim contiguous, other strides 16-byte multiples,
data pointer 16-byte aligned, ``M % 32 == 0`` (``K % 32 == 0`` for dual). Outputs (uint8 storage):
qc [B, K, M] (x transposed, M contiguous), sc [B, K, M/32] row-major / blocked / sm90 (as
``_store_scales``), and for dual qr [B, M, K], sr [B, M, K/32] likewise.
Importing this module needs triton with Gluon (3.6+); :data:`HAS_GLUON` is False otherwise.
"""

from __future__ import annotations

import os

import torch

try:  # Gluon is optional: `import mxmoe` (and the CPU tests) must work without it.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = True
except Exception:  # pragma: no cover - depends on the installed triton
    HAS_GLUON = False

__all__ = ["HAS_GLUON", "GluonConfig", "supported", "launch", "config"]

_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class GluonConfig(tuple):
    """(W warps = row blocks per tile, STAGES ring depth, GM m-tiles per band)."""

    def __new__(cls, W: int = 4, STAGES: int = 4, GM: int = 4):
        return super().__new__(cls, (W, STAGES, GM))

    W = property(lambda s: s[0])
    STAGES = property(lambda s: s[1])
    GM = property(lambda s: s[2])


# Launch configs by family ("col", "colrow"); env MXMOE_QUANT_GLUON_CFG="W,STAGES,GM" overrides both
# (used by the benchmark's sweep). Not tuned on a GPU yet.
_CONFIGS = {"col": GluonConfig(4, 4, 4), "colrow": GluonConfig(4, 4, 4)}


def config(row: bool) -> GluonConfig:
    env = os.environ.get("MXMOE_QUANT_GLUON_CFG")
    if env:
        return GluonConfig(*map(int, env.split(",")))
    return _CONFIGS["colrow" if row else "col"]


if HAS_GLUON:

    @gluon.jit
    def _e8m0_g(amax_bits, rceil):
        """E8M0 byte (int32) from the FP32 bits of a block's |max| (NaN/Inf -> 255)."""
        e = amax_bits >> 23
        mant = amax_bits & 0x7FFFFF
        byte = e - 8 + ((mant > 0x600000) & (rceil != 0)).to(gl.int32)
        byte = gl.minimum(gl.maximum(byte, 0), 254)
        return gl.where(e == 255, 255, byte)

    @gluon.jit
    def _quant_g(x, byte):
        """E4M3 bytes (uint8) of x (fp32) * 2^(127 - byte); NaN (-> 0x7F) for byte 255."""
        mult = gl.where(byte == 255, 0x7FC00000, (254 - byte) << 23).to(gl.float32, bitcast=True)
        return (x * mult).to(gl.float8e4nv).to(gl.uint8, bitcast=True)

    @gluon.jit
    def _store_scales_g(s_ptr, r, c, byte, n_rows, n_cols, LAYOUT: gl.constexpr):
        """Scales (r, c) of a [n_rows, n_cols] scale matrix (quantize_triton._store_scales):
        0 row-major bytes, 1 cuBLAS 128x4 blocked (zero padding), 2 Hopper FP32 [n_cols, ceil4(n_rows)]."""
        r64 = r.to(gl.int64)
        if LAYOUT == 1:
            n_col_tiles = (n_cols + 3) // 4
            mask = (r < ((n_rows + 127) // 128) * 128) & (c < n_col_tiles * 4)
            idx = ((r64 // 128) * n_col_tiles + c // 4) * 512 + (r64 % 32) * 16 + ((r64 // 32) % 4) * 4 + (c % 4)
            gl.store(s_ptr + idx, byte.to(gl.uint8), mask=mask)
        elif LAYOUT == 2:
            rows_pad = (n_rows + 3) // 4 * 4
            bits = gl.where(byte == 0, 0x00400000, gl.where(byte == 255, 0x7FC00000, byte << 23))
            bits = gl.where(r < n_rows, bits, 0)
            mask = (r < rows_pad) & (c < n_cols)
            gl.store(s_ptr + c.to(gl.int64) * rows_pad + r64, bits.to(gl.int32), mask=mask)
        else:
            mask = (r < n_rows) & (c < n_cols)
            gl.store(s_ptr + r64 * n_cols + c, byte.to(gl.uint8), mask=mask)

    @gluon.jit
    def _tile_coords_g(t, n_m, n_k, GM: gl.constexpr):
        """Tile t -> (batch, m-tile, k-tile): bands of GM m-tiles, M fastest inside a band."""
        per_b = n_m * n_k
        b = t // per_b
        r = t - b * per_b
        band = r // (GM * n_k)
        in_band = r - band * (GM * n_k)
        gm = gl.minimum(n_m - band * GM, GM)
        tm = band * GM + in_band % gm
        tk = in_band // gm
        return b, tm, tk

    @gluon.jit
    def _issue(x_desc, bufs, ready, s, t, n_m, n_k, W: gl.constexpr, BK: gl.constexpr, GM: gl.constexpr):
        """TMA of tile t into ring slot s: one box [1, 32 * W, BK], one mbarrier."""
        b, tm, tk = _tile_coords_g(t, n_m, n_k, GM)
        bar = ready.index(s)
        mbarrier.expect(bar, x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [b, tm * (32 * W), tk * BK], bar,
                                        bufs.index(s).reshape([1, 32 * W, BK]))

    @gluon.jit(do_not_specialize=["rceil"])
    def mx_quantize_gluon_kernel(
        x_desc, qr_ptr, sr_ptr, qc_ptr, sc_ptr,
        M, K, B, M_cover, K_cover, sr_stride_b, sc_stride_b, rceil,
        ROW: gl.constexpr, LAYOUT: gl.constexpr, STAGES: gl.constexpr, GM: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Columnwise (+ rowwise when ROW) MXFP8 of x [B, M, K] given as a TMA descriptor with
        block [1, 32 * num_warps, BK]; tiles [num_warps * 32, BK] cover [M_cover, K_cover] (see module doc)."""
        W: gl.constexpr = num_warps
        BK: gl.constexpr = x_desc.block_type.shape[2]
        VEC: gl.constexpr = BK // 32  # columns per thread in the column read
        NB: gl.constexpr = BK // 32  # 32-blocks per row in a tile
        RV: gl.constexpr = BK // 4  # elements per thread in the row read (lanes: 8 rows x 4)
        BM: gl.constexpr = 32 * W
        col_l: gl.constexpr = gl.BlockedLayout([1, 32, VEC], [1, 1, 32], [W, 1, 1], [1, 2, 0])
        row_l: gl.constexpr = gl.BlockedLayout([1, 1, RV], [1, 8, 4], [W, 1, 1], [2, 1, 0])

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        n_m = gl.cdiv(M_cover, BM)
        n_k = gl.cdiv(K_cover, BK)
        total = n_m * n_k * B

        bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, W, 32, BK], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        for s in gl.static_range(STAGES):
            t0 = pid + s * nprog
            if t0 < total:
                _issue(x_desc, bufs, ready, s, t0, n_m, n_k, W, BK, GM)

        # index vectors (tile-relative), column read: [W, 32, BK] in col_l
        cw = gl.arange(0, W, gl.SliceLayout(1, gl.SliceLayout(2, col_l)))
        ci = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(2, col_l)))
        ck = gl.arange(0, BK, gl.SliceLayout(0, gl.SliceLayout(1, col_l)))
        c_m_off = gl.expand_dims(gl.expand_dims(cw * 32, 1), 2) + gl.expand_dims(gl.expand_dims(ci, 0), 2)  # [W,32,1]
        c_w2 = gl.arange(0, W, gl.SliceLayout(1, gl.SliceLayout(1, col_l)))  # [W] for the [W, BK] scales
        c_k2 = gl.arange(0, BK, gl.SliceLayout(0, gl.SliceLayout(1, col_l)))
        if ROW:
            rw = gl.arange(0, W, gl.SliceLayout(1, gl.SliceLayout(2, row_l)))
            ri = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(2, row_l)))
            rk = gl.arange(0, BK, gl.SliceLayout(0, gl.SliceLayout(1, row_l)))
            r_m = gl.expand_dims(gl.expand_dims(rw * 32, 1), 2) + gl.expand_dims(gl.expand_dims(ri, 0), 2)  # [W,32,1]
            r_k = gl.expand_dims(gl.expand_dims(rk, 0), 1)  # [1,1,BK]

        i = 0
        for t in range(pid, total, nprog):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            tile = bufs.index(slot)
            b, tm, tk = _tile_coords_g(t, n_m, n_k, GM)
            b64 = b.to(gl.int64)
            m0 = tm * BM
            k0 = tk * BK
            plane = b64 * M * K

            # ---- columns: 32x1 blocks along M, in-thread ----
            x = tile.load(col_l).to(gl.float32)  # [W, 32, BK]
            bits = x.to(gl.int32, bitcast=True) & 0x7FFFFFFF
            byte = _e8m0_g(gl.max(bits, axis=1), rceil)  # [W, BK]
            q = _quant_g(x, gl.expand_dims(byte, 1))
            kk = gl.expand_dims(gl.expand_dims(ck, 0), 1) + k0  # [1, 1, BK]
            mrow = gl.expand_dims(gl.expand_dims(cw * 32, 1), 2) + m0  # [W, 1, 1] first row of each block
            cmask = (mrow < M) & (kk < K)
            gl.store(qc_ptr + plane + kk.to(gl.int64) * M + (m0 + c_m_off), q, mask=cmask)
            sk = gl.expand_dims(c_k2, 0) + k0  # [1, BK] scale row (= k)
            sm = gl.expand_dims(c_w2, 1) + tm * W  # [W, 1] scale column (= m block)
            _store_scales_g(sc_ptr + b64 * sc_stride_b, sk, sm, byte, K, M // 32, LAYOUT)

            # ---- rows (dual): 1x32 blocks along K ----
            if ROW:
                xr = tile.load(row_l).to(gl.float32)  # [W, 32, BK]
                x4 = gl.reshape(xr, [W, 32, NB, 32])
                bits4 = x4.to(gl.int32, bitcast=True) & 0x7FFFFFFF
                rbyte = _e8m0_g(gl.max(bits4, axis=3), rceil)  # [W, 32, NB]
                qr4 = _quant_g(x4, gl.expand_dims(rbyte, 3))
                qr3 = gl.convert_layout(gl.reshape(qr4, [W, 32, BK]), row_l)
                mm = r_m + m0
                kr = r_k + k0
                rmask = (mm < M) & (kr < K)
                gl.store(qr_ptr + plane + mm.to(gl.int64) * K + kr, qr3, mask=rmask)
                # scales [W, 32, NB]: convert to a plain layout (one byte per thread) and store
                sl: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 32 // NB, NB], [W, 1, 1], [2, 1, 0])
                rb = gl.convert_layout(rbyte, sl)
                sw = gl.arange(0, W, gl.SliceLayout(1, gl.SliceLayout(2, sl)))
                si = gl.arange(0, 32, gl.SliceLayout(0, gl.SliceLayout(2, sl)))
                sb = gl.arange(0, NB, gl.SliceLayout(0, gl.SliceLayout(1, sl)))
                srow = gl.expand_dims(gl.expand_dims(sw * 32, 1), 2) + gl.expand_dims(gl.expand_dims(si, 0), 2) + m0
                scol = gl.expand_dims(gl.expand_dims(sb, 0), 1) + tk * NB
                _store_scales_g(sr_ptr + b64 * sr_stride_b, srow, scol, rb, M, K // 32, LAYOUT)

            gl.thread_barrier()  # every warp is done with this slot
            tn = t + STAGES * nprog
            if tn < total:
                _issue(x_desc, bufs, ready, slot, tn, n_m, n_k, W, BK, GM)
            i += 1

        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))


def _block_k(dtype: torch.dtype) -> int:
    return 128 // torch.empty((), dtype=dtype).element_size()


def supported(x3: torch.Tensor, row: bool, col: bool, tile32: bool) -> bool:
    """Whether the Gluon kernel can run on x3 [B, M, K] for this output set: Gluon importable,
    CUDA sm_90+, columnwise or dual (not 32x32), last dim contiguous, TMA-legal strides and base."""
    if not (HAS_GLUON and col and not tile32 and x3.is_cuda and x3.dtype in _GL_DTYPES):
        return False
    if torch.cuda.get_device_capability(x3.device)[0] < 9:
        return False
    es = x3.element_size()
    if x3.stride(-1) != 1 and x3.shape[-1] > 1:
        return False
    if any((st * es) % 16 for st in x3.stride()[:-1]) or x3.data_ptr() % 16:
        return False
    return x3.numel() < 2**31 * 16  # TMA coordinates are int32; every dim is < 2^31 then


def make_descriptor(x3: torch.Tensor, W: int):
    """3D TMA descriptor of x [B, M, K], block [1, 32 * W, BK] (BK: 128 bytes of K), 128-byte swizzle."""
    gdt = getattr(gl, _GL_DTYPES[x3.dtype])
    block = [1, 32 * W, _block_k(x3.dtype)]
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=gdt.primitive_bitwidth, rank=3)
    return TensorDescriptor(x3, list(x3.shape), list(x3.stride()), block, layout)


_OCCUPANCY: dict = {}


def _grid(kernel, args, kwargs, total: int, x3: torch.Tensor) -> int:
    """Persistent grid: CTAs that fit on the GPU at once (registers, warps, shared memory of the
    compiled kernel; Hopper: 64K registers, 64 warps, 32 CTAs, 227 KB per SM), at most ``total``."""
    key = (x3.dtype, x3.device.index, tuple(sorted(kwargs.items())))
    per_sm = _OCCUPANCY.get(key)
    if per_sm is None:
        W = kwargs["num_warps"]
        smem = kwargs["STAGES"] * 32 * W * 128 + 1024
        per_sm = max(1, min(64 // W, 32, (227 * 1024) // smem))
        try:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            compiled._init_handles()
            regs_per_warp = -(-max(compiled.n_regs, 1) * 32 // 256) * 256
            smem = compiled.metadata.shared
            per_sm = max(1, min(65536 // (regs_per_warp * W), 64 // W, 32, (227 * 1024) // smem))
        except Exception:  # pragma: no cover - triton internals differ: keep the shared-memory bound
            pass
        _OCCUPANCY[key] = per_sm
    n_sm = torch.cuda.get_device_properties(x3.device).multi_processor_count
    return max(1, min(total, per_sm * n_sm))


def launch(x3, qr, sr, qc, sc, M, K, B, m_cover, k_cover, sr_stride_b, sc_stride_b, rceil, row: bool,
           layout: int) -> None:
    """Run mx_quantize_gluon_kernel on x3 [B, M, K] (the quantize.py glue checks :func:`supported`,
    allocates the outputs as for mx_quantize_kernel and rounds M, K up to the cover)."""
    cfg = config(row)
    desc = make_descriptor(x3, cfg.W)
    BK = _block_k(x3.dtype)
    total = -(-m_cover // (32 * cfg.W)) * -(-k_cover // BK) * B
    args = (desc, qr if row else qc, sr if row else sc, qc, sc, M, K, B, m_cover, k_cover,
            sr_stride_b, sc_stride_b, rceil)
    kwargs = dict(ROW=row, LAYOUT=layout, STAGES=cfg.STAGES, GM=cfg.GM, num_warps=cfg.W)
    grid = _grid(mx_quantize_gluon_kernel, args, kwargs, total, x3)
    mx_quantize_gluon_kernel[(grid,)](*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# Offline compile for sm_90 on a machine without a GPU (python -m mxmoe.kernels.quantize_gluon)
# ----------------------------------------------------------------------------------------------

def compile_offline(dtype=torch.bfloat16, row: bool = False, layout: int = 0, cfg: GluonConfig | None = None):
    """Compile the kernel for sm_90 without a GPU; returns triton's CompiledKernel (asm: ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    cfg = cfg or config(row)
    x = torch.empty(2, 64, 128, dtype=dtype)
    desc = make_descriptor(x, cfg.W)
    sig_args = {"x_desc": mangle_type(desc), "qr_ptr": "*u8", "sr_ptr": "*u8", "qc_ptr": "*u8",
                "sc_ptr": "*i32" if layout == 2 else "*u8"}
    for n in ("M", "K", "B", "M_cover", "K_cover", "sr_stride_b", "sc_stride_b", "rceil"):
        sig_args[n] = "i32"
    constexprs = {"ROW": row, "LAYOUT": layout, "STAGES": cfg.STAGES, "GM": cfg.GM, "num_warps": cfg.W}
    for k, v in constexprs.items():
        sig_args[k] = "constexpr"
    fn = mx_quantize_gluon_kernel
    names = list(fn.arg_names)
    # tt.divisibility 16 for pointers and the sizes (what the JIT's specialization gives real shapes)
    div = ["qr_ptr", "sr_ptr", "qc_ptr", "sc_ptr", "M", "K", "M_cover", "K_cover", "sr_stride_b", "sc_stride_b"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = GluonASTSource(fn, {n: sig_args[n] for n in names}, {(names.index(k),): v for k, v in constexprs.items()},
                         attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.W})


def _sass_report(ck) -> str:
    """Registers, spills, shared memory and instruction counts of a compiled kernel (cuobjdump)."""
    import re
    import subprocess
    import tempfile

    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(ck.asm["cubin"])
        path = f.name
    res = subprocess.run([os.path.join(bindir, "cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                         text=True).stdout
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", path], capture_output=True, text=True).stdout
    os.unlink(path)
    ops = re.findall(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)(?:\.[A-Z0-9_.]+)?", sass, re.M)
    from collections import Counter

    cnt = Counter(ops)
    keys = ["LDS", "STS", "STG", "LDG", "SHFL", "BAR", "F2FP", "FMUL", "SYNCS", "UTMALDG", "LDL", "STL", "PRMT"]
    line = " ".join(f"{k}={cnt.get(k, 0)}" for k in keys)
    res_line = " ".join(l.strip() for l in res.splitlines() if "REG" in l)
    return f"{res_line}\n  total SASS instructions {sum(cnt.values())}; {line}; shared {ck.metadata.shared} B"


if __name__ == "__main__":  # pragma: no cover - offline tool
    for dt in (torch.bfloat16, torch.float32):
        for row in (False, True):
            for lay in (0, 1, 2):
                ck = compile_offline(dt, row, lay)
                print(f"{str(dt):15s} {'dual' if row else 'col '} layout {lay}: {_sass_report(ck)}")
