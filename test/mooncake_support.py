"""The Mooncake tests' one gate (integration and e2e): skip with the reason when the
store cannot run here, or fail where it must (SGLANG_L3_REQUIRE_MOONCAKE=1, set by
`make test`)."""

from __future__ import annotations

import os

import pytest
from sglang_l3.testing import mooncake as mc


def require_mooncake() -> None:
    reason = mc.unavailable_reason()
    if reason:
        if os.environ.get("SGLANG_L3_REQUIRE_MOONCAKE") == "1":
            pytest.fail(f"SGLANG_L3_REQUIRE_MOONCAKE=1 but {reason}")
        pytest.skip(reason)
