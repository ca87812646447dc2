"""Where patch `mamba-prefill-cuts` ends a prefill: at a branching point exactly where
upstream would track it instead of the extend's end, and one grid step before a prompt
end on the grid; only where a state after the cut remains. The whole path through a
real server: test/e2e/test_l3_restore_server.py (test_branch_keeps_its_own_prompt_end,
test_prompt_on_the_grid_leaves_a_state_for_the_next_call)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sglang_l3.patches.hicache.mamba_prefill_cuts import branch_cut_len, cut_len, tail_cut_len


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


@pytest.mark.parametrize(
    ("prompt", "prefix", "extend", "grid", "cut"),
    [
        (1024, 0, 1024, 64, 960),  # the e2e case: a 1,024-token prompt keeps a state at 960
        (8512, 6720, 1792, 64, 1728),  # CI: 8,512 tokens after 6,720 -> a state at 8,448
        (1000, 0, 1000, 64, None),  # off the grid: its state (960) is before the last token
        (1024, 960, 64, 64, None),  # one step: the state one step back is the prefix's own
        (1024, 0, 512, 64, None),  # not the last extend (a chunk of a longer prompt)
        (1024, 32, 992, 64, None),  # a prefix off the grid: no state lands on it
        (1024, 0, 1024, 256, 768),  # a coarser grid
        (1024, 0, 1024, 0, None),  # no grid
    ],
)
def test_tail_cut_len(prompt, prefix, extend, grid, cut):
    assert tail_cut_len(prompt, prefix, extend, grid) == cut


def test_branch_first_then_tail():
    req = SimpleNamespace(mamba_branching_seqlen=320, full_untruncated_fill_ids=[0] * 512)
    assert cut_len(req, 256, 256, 64) == (64, "branch")  # the branch; the tail is the next chunk's
    req.mamba_branching_seqlen = None
    assert cut_len(req, 256, 256, 64) == (192, "tail")
    req.full_untruncated_fill_ids = [0] * 500
    assert cut_len(req, 256, 244, 64) is None
