"""The key guards follow the storage backend attached *now* (issue 33 item 3).

Upstream's `PUT /hicache/storage-backend` and `DELETE` attach and detach L3 at
runtime; they record the backend in the tokenizer's live config
(`TokenizerManager.config_value`), never in the launch `server_args`. A CPU server
(buffer-only mode needs a backend at launch) started with the file store: the
mm-hashes guard refuses `mm_hashes`; after DELETE it lets the request through
(upstream's behaviour without L3); after PUT it refuses again. `/sglang_l3/sessions`
names the store only while it is attached. Before the fix the guard read the launch
arguments: after DELETE it still refused (the step that fails), and a server started
without L3 and attached later never refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from l3_e2e import STARTUP_TIMEOUT
from sglang_l3.testing.server import Server, ServerConfig, prompt

pytestmark = pytest.mark.e2e

KEY = "sglang-l3-test-admin"  # upstream's attach/detach routes need an admin API key


def _call(s: Server, method: str, path: str, body: Any = None) -> tuple[int, str]:
    req = urllib.request.Request(
        s.base + path,
        data=None if body is None else json.dumps(body).encode(),
        method=method,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as f:
            return f.status, f.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_guard_follows_a_runtime_detach_and_attach(tmp_path, hash_extension_built) -> None:
    from sglang_l3.cpu import accelerator_present

    if accelerator_present():
        pytest.skip("the CPU server variant needs a machine without an accelerator")
    store = str(tmp_path / "store")
    cfg = ServerConfig(storage_dir=store, extra_args=["--admin-api-key", KEY])
    forged = {
        "input_ids": prompt(5, 96),
        "sampling_params": {"temperature": 0, "max_new_tokens": 2},
        "mm_hashes": ["0123456789abcdef"],
    }
    attach = {
        "hicache_storage_backend": "file",
        "hicache_storage_backend_extra_config_json": json.dumps({"store_dir": store}),
    }

    def sessions_store(s: Server) -> Any:
        status, body = _call(s, "GET", "/sglang_l3/sessions")
        assert status == 200, body
        return json.loads(body)["store"]

    with Server(cfg, tmp_path / "server.log", startup_timeout=STARTUP_TIMEOUT) as s:
        status, body = _call(s, "POST", "/generate", forged)
        assert status == 400 and "mm_hashes is not accepted" in body, (status, body)
        assert sessions_store(s) == store

        status, body = _call(s, "DELETE", "/hicache/storage-backend")
        assert status == 200, body
        status, body = _call(s, "POST", "/generate", forged)
        assert status == 200, f"the guard still refuses after a detach: {status} {body}"
        assert len(json.loads(body)["output_ids"]) == 2
        assert sessions_store(s) is None

        status, body = _call(s, "PUT", "/hicache/storage-backend", attach)
        assert status == 200, body
        status, body = _call(s, "POST", "/generate", forged)
        assert status == 400 and "mm_hashes is not accepted" in body, f"attached at runtime: {status} {body}"
        assert sessions_store(s) == store
        assert s.alive(), s.log_tail()
