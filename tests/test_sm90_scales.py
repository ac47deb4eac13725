"""The Hopper GEMMs' FP32 scale layouts (mxmoe.kernels.sm90_scales): the Triton kernels against the
pure-torch definitions, byte for byte (special bytes 0x00 / 0xFF, strided views, empty and odd groups).

On the CPU the kernels run under Triton's interpreter in one subprocess (TRITON_INTERPRET must be set
before triton is imported); on an sm_90 / CUDA machine they run on the device.
"""
import os
import subprocess
import sys

import pytest
import torch

from mxmoe.kernels import sm90_scales as S

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
gpu = pytest.mark.gpu


def _bytes(shape, gen, device):
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    b.view(-1)[:2] = torch.tensor([0, 255], dtype=torch.uint8)  # 2^-127 and NaN
    return b.to(device).view(torch.float8_e8m0fnu)


def check_all(device: str) -> None:
    """Every case on ``device``; raises AssertionError naming the first that differs."""
    gen = torch.Generator().manual_seed(0)

    def same(got, want, what):
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got.view(torch.int32).cpu(), want.view(torch.int32).cpu()), f"{what}: bytes differ"

    for shape in [(37, 11), (3, 37, 11), (5, 130, 7)]:
        s = _bytes(shape, gen, device)
        same(S.sm90_scale_layout(s), S.sm90_scale_layout_reference(s), f"transpose {shape}")
    s = _bytes((64, 24), gen, device)
    same(S.sm90_scale_layout(s[:, ::4]), S.sm90_scale_layout_reference(s[:, ::4]), "strided rows [:, ::4]")
    w = _bytes((3, 96, 16), gen, device)
    same(S.sm90_scale_layout(w[:, ::32, ::4]), S.sm90_scale_layout_reference(w[:, ::32, ::4]), "weight tiles")
    many = torch.randint(0, 40, (130,), generator=gen).tolist()  # 130 groups (EP2 256), some empty
    many[-3:] = [0, 0, 0]  # empty trailing groups: columns past the last non-empty one
    for counts, extra in [([100, 0, 333, 27, 0], 5), ([0, 130, 70], 0), ([3, 1, 0, 200] * 9, 7), ([0], 4), ([9], 0),
                          (many, 3)]:
        M = sum(counts) + extra
        s = _bytes((M, 20), gen, device)
        offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
        for view, name in ((s, "rows"), (s[:, ::4], "rows [:, ::4]")):
            vals, sched = S.sm90_m_grouped_scales(view, offs, 128, 3)
            want, starts = S.sm90_grouped_scale_layout(view, offs)
            same(vals, want, f"grouped {name} {counts}")
            same(sched, S._schedule_reference(offs, starts, 128, 3), f"schedule {counts}")
    # the wgrad's schedule: experts by rows, most first, ties by id; the tile counter 0
    for counts in [[100, 0, 333, 27, 0], [5], [0, 0], [64] * 7, many, [3, 1, 0, 200] * 9]:
        offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
        got = S.sm90_k_grouped_schedule(offs)
        want = S.sm90_k_grouped_schedule_reference(offs.cpu())
        same(got, want, f"k-grouped schedule {counts}")
        order = want[:-1].long()
        c = torch.tensor(counts)
        assert sorted(order.tolist()) == list(range(len(counts))) and want[-1].item() == 0, counts
        assert all((c[order[i]], -order[i]) >= (c[order[i + 1]], -order[i + 1]) for i in range(len(counts) - 1)), counts


_SCRIPT = f"""
import sys; sys.path.insert(0, {REPO!r})
from tests.test_sm90_scales import check_all
check_all("cpu")
print("OK")
"""


def test_kernels_match_reference_in_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_reference_special_bytes():
    b = torch.tensor([[0], [1], [127], [255]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    v = S.sm90_scale_layout_reference(b)[0]  # [1, 4]: the four values, transposed
    assert v[0].item() == 2.0 ** -127 and v[1].item() == 2.0 ** -126 and v[2].item() == 1.0
    assert torch.isnan(v[3]) and v.view(torch.int32)[3].item() == 0x7FC00000


def test_bad_dtypes():
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        S.sm90_scale_layout(torch.zeros(4, 4))
    with pytest.raises(TypeError, match="int32"):
        S.sm90_m_grouped_scales(torch.zeros(4, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu),
                                torch.tensor([4]), 128, 1)
    with pytest.raises(TypeError, match="int32"):
        S.sm90_k_grouped_schedule(torch.tensor([4, 8]))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_reference_on_gpu():
    check_all("cuda")
