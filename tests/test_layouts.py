"""Blocked (cuBLAS 128x4) scale layout: placement of every entry, padding, groups."""

import pytest
import torch

import mxmoe
from mxmoe import layouts


def expected_index(r: int, c: int, cols: int) -> int:
    """cuBLAS block-scaling layout, written from the documented formula."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    rr = r % 128
    return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4


@pytest.mark.parametrize("rows,cols", [(1, 1), (37, 5), (128, 4), (200, 7), (300, 44), (129, 9)])
def test_every_entry_placed(rows, cols):
    vals = (torch.arange(rows * cols) % 253 + 1).to(torch.uint8).view(rows, cols)
    b = mxmoe.to_blocked(vals.view(torch.float8_e8m0fnu)).view(torch.uint8)
    assert b.numel() == layouts.blocked_numel(rows, cols) == (-(-rows // 128) * 128) * (-(-cols // 4) * 4)
    seen = torch.zeros(b.numel(), dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            i = expected_index(r, c, cols)
            assert b[i].item() == vals[r, c].item()
            seen[i] = True
    assert bool((b[~seen] == 0).all()), "padding must be zero"
    assert torch.equal(mxmoe.from_blocked(b, rows, cols), vals)


def test_grouped_blocked_layout_starts_each_group_on_128_rows():
    cols = 7
    sizes = [0, 130, 0, 5, 128, 0]
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    M = int(offs[-1])
    s = torch.randint(1, 250, (M, cols), dtype=torch.uint8)
    blocked, boffs = mxmoe.to_blocked_grouped(s.view(torch.float8_e8m0fnu), offs)
    assert boffs.tolist() == torch.tensor([0, 256, 0, 128, 128, 0]).cumsum(0).tolist()
    C = 8
    assert blocked.numel() == int(boffs[-1]) * C
    b = blocked.view(torch.uint8)
    start, pstart = 0, 0
    for n, pend in zip(sizes, boffs.tolist()):
        chunk = b[pstart * C: pend * C]
        assert torch.equal(layouts.from_blocked(chunk, n, cols), s[start:start + n]) if n else chunk.numel() == 0
        start, pstart = start + n, pend


def test_bad_input_more():
    with pytest.raises(TypeError, match="e8m0"):
        mxmoe.to_blocked(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="non-decreasing"):
        mxmoe.to_blocked_grouped(torch.zeros(8, 2, dtype=torch.uint8), torch.tensor([5, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="past"):
        mxmoe.to_blocked_grouped(torch.zeros(8, 2, dtype=torch.uint8), torch.tensor([5, 9], dtype=torch.int32))


def test_bad_input():
    with pytest.raises(ValueError, match="2D"):
        mxmoe.to_blocked(torch.zeros(2, 3, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected"):
        mxmoe.from_blocked(torch.zeros(10, dtype=torch.uint8), 3, 3)
