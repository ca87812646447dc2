"""Restorable coverage of an L3 store directory (issue 7).

The fraction of KV bytes in L3 that lie at or before a stored Mamba state of
the same prefix: only those can ever be restored for a hybrid model (the
prefetch is all-or-nothing up to the deepest page with a state). The chain walk
itself lives in the store's offline index (`sglang_l3.storage.index.coverage`,
which follows each KV page header's `prior` link back from every Mamba key);
this module sums it over model digests and adds the state bytes, for the
benchmark and `docs/state-budget.md`. torch- and sglang-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_l3.storage import index


@dataclass(frozen=True)
class Coverage:
    kv_bytes: int
    kv_pages: int
    state_bytes: int
    state_pages: int
    covered_bytes: int
    covered_pages: int
    exact: bool  # False: some KV pages lack a prior link, the fraction is a lower bound

    @property
    def fraction(self) -> float:
        return self.covered_bytes / self.kv_bytes if self.kv_bytes else 0.0

    @property
    def state_to_kv(self) -> float:
        return self.state_bytes / self.kv_bytes if self.kv_bytes else 0.0


def restorable_coverage(store_dir: str) -> Coverage:
    s = index.scan(store_dir, headers=True)
    per_model = index.coverage(s.pages)
    states = [p for p in s.pages if p.name.pool == index.MAMBA_POOL]
    return Coverage(
        kv_bytes=sum(r["kv_bytes"] for r in per_model.values()),
        kv_pages=sum(r["kv_pages"] for r in per_model.values()),
        state_bytes=sum(p.size for p in states),
        state_pages=len(states),
        covered_bytes=sum(r["covered_bytes"] for r in per_model.values()),
        covered_pages=sum(r["covered_pages"] for r in per_model.values()),
        exact=all(r["exact"] for r in per_model.values()),
    )
