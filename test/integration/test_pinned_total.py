"""Patch startup-checks in a rank: the pinned total of all ranks' HiCache host
pools, predicted where upstream sizes them (AROUND `kv_cache_builder.auto_size_hicache`,
device pools built, no host pool yet), on the real upstream pools (L3Stack, CPU).

- the prediction is exactly what upstream then allocates (host KV + Mamba pools);
- a total that does not fit the RAM beyond the reserve (or, with
  HSA_USERPTR_FOR_PAGED_MEM=0 on ROCm, the free GTT the ranks share) stops with
  one line naming --hicache-ratio and a ratio that fits; the named ratio fits;
- negative control: without the patch upstream's call lets the same pools through.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from sglang_l3.patches import framework
from sglang_l3.patches.cli import startup_checks
from sglang_l3.testing.stack import HybridSpec, L3Stack

RESERVE = 10 * 1024**3


def _params(st: L3Stack):
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return CacheInitParams(
        req_to_token_pool=st.req_to_token_pool,
        token_to_kv_pool_allocator=st.allocator,
        page_size=st.spec.page_size,
        disable=False,
        tree_components=(ComponentType.FULL, ComponentType.MAMBA),
        enable_mamba_extra_buffer=st.spec.extra_buffer,
    )


def _host_pools(st: L3Stack) -> dict[str, tuple[int, int]]:
    """Each host pool upstream built: (slots or tokens, bytes per slot or token)."""
    host = st.cache.cache_controller.mem_pool_host
    return {
        getattr(e.name, "name", str(e.name)).lower(): (int(e.host_pool.size), int(e.host_pool.size_per_token))
        for e in host.entries
    }


def _auto_size(st: L3Stack):
    from sglang.srt.mem_cache import kv_cache_builder

    with kv_cache_builder.auto_size_hicache(_params(st), None, enabled=True):
        pass


@pytest.fixture
def applied():
    spec = next(s for s in framework.load_series() if s.id == "startup-checks")
    framework.apply_one(spec)
    yield
    framework.apply_one(spec)


@pytest.mark.parametrize("page_size,ratio", [(1, 2.0), (4, 1.2), (64, 0.5)])
def test_prediction_is_what_upstream_allocates(tmp_path: Path, page_size: int, ratio: float) -> None:
    spec = HybridSpec(page_size=page_size, kv_size=1024)
    with L3Stack(spec, str(tmp_path), server_args={"hicache_ratio": ratio}) as st:
        pools = _host_pools(st)
        actual = sum(n * b for n, b in pools.values())
        predicted = startup_checks.rank_host_bytes(_params(st), None, hicache_ratio=ratio, hicache_size=0)
        assert predicted is not None
        assert set(pools) == {"kv", "mamba"}, pools
        assert predicted == actual, (predicted, pools)


def test_rank_refuses_a_total_that_does_not_fit(tmp_path: Path, monkeypatch, applied) -> None:
    ratio = 2.0
    with L3Stack(HybridSpec(page_size=4), str(tmp_path), server_args={"hicache_ratio": ratio}) as st:
        per_rank = startup_checks.rank_host_bytes(_params(st), None, hicache_ratio=ratio, hicache_size=0)
        assert per_rank
        # the RAM beyond upstream's reserve holds half of it
        monkeypatch.setattr(startup_checks, "_available_host_bytes", lambda: RESERVE + per_rank // 2)
        with pytest.raises(RuntimeError) as e:
            _auto_size(st)
        line = str(e.value)
        assert "\n" not in line and line.startswith("sglang-l3: error: --hicache-ratio 2:"), line
        assert "1 rank(s)" in line and "beyond HiCache's 10 GiB reserve" in line, line
        fixed = float(re.search(r"Fix: --hicache-ratio ([0-9.]+) or less", line).group(1))
        assert 0 < fixed < ratio / 2
        # the ratio it names fits that RAM
        per_fixed = startup_checks.rank_host_bytes(_params(st), None, hicache_ratio=fixed, hicache_size=0)
        assert per_fixed <= per_rank // 2
        # enough RAM: the same call lets the pools through
        monkeypatch.setattr(startup_checks, "_available_host_bytes", lambda: RESERVE + per_rank)
        _auto_size(st)


def test_rank_refuses_more_than_the_free_gtt(tmp_path: Path, monkeypatch, applied) -> None:
    """HSA_USERPTR_FOR_PAGED_MEM=0 on ROCm: the pools are GTT; plenty of RAM, little GTT."""
    import sglang.srt.utils

    ratio = 2.0
    with L3Stack(HybridSpec(page_size=4), str(tmp_path), server_args={"hicache_ratio": ratio}) as st:
        per_rank = startup_checks.rank_host_bytes(_params(st), None, hicache_ratio=ratio, hicache_size=0)
        card = tmp_path / "drm" / "card1" / "device"
        card.mkdir(parents=True)
        (card / "mem_info_gtt_total").write_text(str(per_rank))
        (card / "mem_info_gtt_used").write_text(str(per_rank // 2))
        monkeypatch.setattr(startup_checks, "SYSFS_DRM", tmp_path / "drm")
        monkeypatch.setattr(startup_checks, "_available_host_bytes", lambda: RESERVE + 100 * per_rank)
        monkeypatch.setattr(sglang.srt.utils, "is_hip", lambda: True)
        _auto_size(st)  # HSA_USERPTR_FOR_PAGED_MEM unset: hipHostRegister'd RAM, which fits
        monkeypatch.setenv("HSA_USERPTR_FOR_PAGED_MEM", "0")
        with pytest.raises(RuntimeError) as e:
            _auto_size(st)
        line = str(e.value)
        assert "HSA_USERPTR_FOR_PAGED_MEM=0" in line and "GTT" in line, line
        assert "Fix: unset HSA_USERPTR_FOR_PAGED_MEM" in line and "--hicache-ratio" in line, line


def test_negative_control_without_the_patch_upstream_lets_it_through(tmp_path: Path, monkeypatch, applied) -> None:
    ratio = 2.0
    with L3Stack(HybridSpec(page_size=4), str(tmp_path), server_args={"hicache_ratio": ratio}) as st:
        monkeypatch.setattr(startup_checks, "_available_host_bytes", lambda: RESERVE)
        framework.undo("startup-checks")
        _auto_size(st)  # an explicit ratio: upstream's auto-sizing checks nothing here
