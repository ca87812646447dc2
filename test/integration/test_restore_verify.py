"""What a benchmark times and what it checks (issue 34): `L3Stack.restore` with
`check_forward=False` runs the restore a request gets — the forward pass only waits
on each layer, reading nothing — and `L3Stack.verify_restored`, called after the
timer, catches a wrong KV row in any full-attention layer and a wrong Mamba state
in either slot. Real upstream stack on CPU, `file` backend through our store."""

from __future__ import annotations

import os
import sys

import pytest
from sglang_l3.testing.stack import HybridSpec, L3Stack, RestoreFailed

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark")


def _restored(tmp_path, page_size: int, marker: float) -> tuple[L3Stack, list[int], object, int]:
    st = L3Stack(HybridSpec(page_size=page_size), str(tmp_path))
    seq = list(range(1, 1 + 6 * page_size))
    st.write(seq, marker=marker)
    st.evict_all()
    st.scribble()
    req, loaded = st.restore(seq, "bench", check_forward=False)
    return st, seq, req, loaded


@pytest.mark.parametrize("page_size", (4, 64))
def test_restore_without_the_forward_check_is_the_same_restore(tmp_path, page_size: int) -> None:
    with L3Stack(HybridSpec(page_size=page_size), str(tmp_path / "ref")) as ref:
        seq = list(range(1, 1 + 6 * page_size))
        want = ref.write(seq, marker=4.0)
    st, seq, req, loaded = _restored(tmp_path / "l3", page_size, 4.0)
    with st:
        assert loaded == len(seq)
        st.verify_restored(seq, req, loaded, 4.0)
        st.check_restored(seq, req, loaded, want, kv=True)  # the tests' own check agrees
        st.release(req)
        st.evict_all()
        assert st.pool_sizes() == st.baseline


@pytest.mark.parametrize("what", ["kv-last-layer", "node-state", "request-state", "marker"])
def test_verify_restored_catches_a_wrong_result(tmp_path, what: str) -> None:
    st, seq, req, loaded = _restored(tmp_path, 4, 2.0)
    with st:
        st.verify_restored(seq, req, loaded, 2.0)
        node = st.match(seq).last_device_node
        marker = 2.0
        if what == "kv-last-layer":
            kv = st.kv_pool
            rows = st.cache.path_device_indices(node)
            kv.get_value_buffer(kv.start_layer + kv.layer_num - 1)[rows[-1]] += 1
        elif what == "node-state":
            st.mamba_cache.conv[-1][-1, st.node_mamba_slot(node)] += 1
        elif what == "request-state":
            st.mamba_cache.temporal[0, int(req.kv.mamba_pool_idx)] += 1
        else:
            marker = 3.0  # another context's state
        with pytest.raises(RestoreFailed):
            st.verify_restored(seq, req, loaded, marker)
        st.release(req)


def test_bench_guard_floors_are_checked() -> None:
    sys.path.insert(0, BENCH)
    try:
        import restore_bench
    finally:
        sys.path.remove(BENCH)
    assert restore_bench.parse_min_ratio("1/16=0.275,1/4=0.4") == {"1/16": 0.275, "1/4": 0.4}
    for bad in ("1/8=0.5", "1/16", "1/16=x"):
        with pytest.raises(SystemExit, match="--min-ratio"):
            restore_bench.parse_min_ratio(bad)
