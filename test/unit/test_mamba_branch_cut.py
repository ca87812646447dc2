"""Where patch `mamba-branch-cut` ends a prefill: exactly where upstream would track the
branching point instead of the extend's end, and only where a state after it remains
(the whole path through a real server: test/e2e/test_l3_restore_server.py
test_branch_keeps_its_own_prompt_end)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_l3.patches.hicache.mamba_branch_cut import branch_cut_len


@pytest.mark.parametrize(
    ("branch", "prefix", "extend", "grid", "cut"),
    [
        (320, 256, 174, 64, 64),  # the e2e case: 256..430, branch 320 -> first chunk 256..320
        (5824, 4096, 2643, 64, 1728),  # the Hermes replay: the two system prompts' last common page
        (None, 256, 174, 64, None),  # no branching point
        (256, 256, 174, 64, None),  # at the prefix: nothing to track before it
        (430, 256, 174, 64, None),  # at the end
        (500, 256, 174, 64, None),  # past the end
        (288, 256, 174, 64, None),  # off the grid: upstream does not track it, the end keeps its state
        (384, 256, 174, 64, None),  # less than one grid step after it: no state of its own to keep
        (320, 256, 128, 64, 64),  # exactly one grid step after it
        (384, 256, 300, 128, 128),  # a coarser grid (page 128)
        (320, 256, 300, 128, None),  # ... which 320 is off
        (320, 256, 174, 0, None),  # no grid
    ],
)
def test_branch_cut_len(branch, prefix, extend, grid, cut):
    assert branch_cut_len(SimpleNamespace(mamba_branching_seqlen=branch), prefix, extend, grid) == cut


def test_request_without_the_attribute_is_left_alone():
    assert branch_cut_len(SimpleNamespace(), 256, 174, 64) is None
