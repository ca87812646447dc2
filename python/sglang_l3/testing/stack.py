"""The real upstream cache stack for a Mamba-hybrid model, on CPU or a GPU.

UnifiedRadixCache (Rust or Python tree core) + HybridCacheController +
buffer-only HiCache + the `file` storage backend, over real device pools
(HybridReqToTokenPool/MambaPool, HybridLinearKVPool) allocated on the spec's
device (`sglang_l3.testing.device`: "cpu" unless SGLANG_L3_TEST_DEVICE=cuda).
Used by the integration tests, `make demo` and the benchmarks. On "cpu" it needs
`sglang_l3.cpu.enable()` first (the stack then applies patch cpu-host-pools
itself if the queue has not been applied since); on "cuda" upstream's own host
pools, streams and events run as they do in a server. Nothing here re-implements upstream logic: it
only calls the APIs the scheduler calls, in the order it calls them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import time
from array import array
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_l3.testing.device import stack_device


def _tree_cores() -> tuple[str, ...]:
    from sglang_l3.tree_core import rust_core_mismatch

    return ("python",) if rust_core_mismatch() else ("rust", "python")


# The cores the tests run on: the Python core only where the Rust one does not match
# this torch (sglang_l3.tree_core; the borrowed GPU's torch 2.11), and a stack asked
# for "rust" there runs the Python core, saying so once.
TREE_CORES = _tree_cores()
ALL_TREE_CORES = ("rust", "python")


@dataclass(frozen=True)
class HybridSpec:
    """Shape of a tiny FULL + MAMBA hybrid (defaults follow upstream's kit)."""

    page_size: int = 1
    num_layers: int = 24
    full_attention_layer_ids: tuple[int, ...] = (3, 7, 11, 15, 19, 23)
    kv_size: int = 1024
    head_num: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.bfloat16
    max_num_reqs: int = 16
    max_context_len: int = 2048
    mamba_cache_size: int = 60
    mamba_intermediate_size: int = 256
    mamba_n_groups: int = 1
    mamba_num_heads: int = 2
    mamba_head_dim: int = 16
    mamba_state_size: int = 16
    mamba_conv_kernel: int = 4
    ssm_dtype: str = "bfloat16"
    # "cpu" or "cuda" (sglang_l3.testing.device; SGLANG_L3_TEST_DEVICE when not given)
    device: str = field(default_factory=stack_device)

    @property
    def mamba_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_layers) if i not in self.full_attention_layer_ids]

    @property
    def extra_buffer(self) -> bool:
        # Mamba page_size > 1 requires the extra-buffer strategy (upstream's kit config).
        return self.page_size > 1


@dataclass
class Snapshot:
    """KV of the first full-attention layer at a path + one Mamba slot's state."""

    k: torch.Tensor
    v: torch.Tensor
    mamba: list[torch.Tensor] = field(default_factory=list)

    def equal(self, other: Snapshot) -> bool:
        return (
            torch.equal(self.k, other.k)
            and torch.equal(self.v, other.v)
            and len(self.mamba) == len(other.mamba)
            and all(torch.equal(a, b) for a, b in zip(self.mamba, other.mamba, strict=True))
        )


class RestoreFailed(AssertionError):
    pass


@dataclass
class ForwardRead:
    """What a simulated forward pass read (filled when the forward stream runs)."""

    rows: int
    mamba_slots: list[int] = field(default_factory=list)
    # (layer, rows that differ): a device tensor until the forward stream is drained, so
    # queuing the read never blocks the host on the copies it waits for (on a GPU)
    kv: list[tuple[int, int | torch.Tensor]] = field(default_factory=list)
    mamba: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)


def on_stream(fn: Callable[[], None], what: str = "forward-read") -> None:
    """Queue `fn` on the current stream of the simulated device; run it now otherwise."""
    from sglang_l3.sim import streams as sim_streams

    if sim_streams.installed():
        sim_streams.enqueue(fn, what)
    else:
        fn()


def _sim_active() -> bool:
    from sglang_l3.sim import streams as sim_streams

    return sim_streams.installed()


def sim_chance() -> bool:
    from sglang_l3.sim import streams as sim_streams

    return sim_streams.chance()


def _req_mamba_slot(req: Any) -> int | None:
    idx = getattr(req.kv, "mamba_pool_idx", None)
    return None if idx is None else int(torch.as_tensor(idx).reshape(-1)[0])


# The scheduler polls HiCache events between batches; here this loop is that
# scheduler. A restore waits on it twice (host buffers for a storage hit are
# allocated on this thread; the staged hit is picked up by it), so its period is
# part of every restore's fixed latency. 0.5 ms instead of 2 ms: p50 of a 3 MiB
# restore 18.4 -> 13.9 ms with CPU to spare, no gain on a saturated machine
# (benchmark/restore_latency.py); the rest is thread hand-offs, IO and the copy.
PUMP_PERIOD_S = 0.0005


# What `inflight_forward_write_then_free` keeps a GPU's forward stream busy for before
# its write: ~0.5 s at 2 GHz, longer than the restore it races takes to land its copies.
FORWARD_BUSY_CYCLES = 1_000_000_000

# Longest wait for a streamed-restore piece read before ticking anyway.
STREAM_WAIT_S = 0.05


def wait_for_work(cache: Any) -> None:
    """Block until the next tick has something to do, as upstream's scheduler loop,
    which ticks again at once while a prefetch is in progress: a copy completed whose
    host slots the tick frees (and hands to the next read: on the CPU stack the copy
    runs inside the tick, so that is right after it), or the read a streamed restore
    lands next completes (an event, via its future; a later piece read first lands
    nothing, so it does not wake the loop: 600 passes once went by in 0.5 s that way,
    issue 33), else PUMP_PERIOD_S. This stand-in neither spins a core away from the
    store's reader thread nor sleeps past a landed piece or a freed slot."""
    from sglang_l3.testing.stream_landing import copies_completed, landing_futures

    pipe = getattr(cache, "buffer_pipeline", None)
    if pipe is not None and copies_completed(pipe):
        return
    pieces = landing_futures(pipe) if pipe is not None else []
    if pieces and not any(f.done() for f in pieces):
        futures_wait(pieces, timeout=STREAM_WAIT_S, return_when=FIRST_COMPLETED)
    elif not pieces:
        time.sleep(PUMP_PERIOD_S)


def pump(cache: Any, cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cache.check_hicache_events()
        if cond():
            return
        wait_for_work(cache)
    raise RestoreFailed(f"timed out waiting for: {what}")


_SWAP_NOTED: list[bool] = [False]


def _note_core_swap(asked: str) -> None:
    from sglang_l3.tree_core import rust_core_mismatch

    if not _SWAP_NOTED[0]:
        _SWAP_NOTED[0] = True
        import logging

        logging.getLogger("sglang_l3.testing").warning(
            "L3Stack: tree core %r asked for, the Python core runs instead (%s)", asked, rust_core_mismatch()
        )


def ensure_cpu_host_pools() -> None:
    """The CPU switch is on but the queue ran before it was (or never ran):
    apply cpu-host-pools now, as sglang_l3.cpu.enable() used to. Without the
    switch a CPU stack has no host transfer ops: say so instead of failing later."""
    import sglang_l3.cpu
    from sglang_l3.patches import framework

    if framework.is_applied("cpu-host-pools"):
        return
    if not sglang_l3.cpu.enabled():
        raise RuntimeError(
            "a cache stack on cpu needs the CPU switch (sglang_l3.cpu.enable(): "
            f"{sglang_l3.cpu.not_applicable_reason()}); on a machine with a GPU, run the stacks there "
            "with SGLANG_L3_TEST_DEVICE=cuda"
        )
    series = framework.load_series()
    st = framework.apply_one(next(s for s in series if s.id == "cpu-host-pools"), series)
    if st.state is not framework.State.APPLIED:
        raise RuntimeError(f"cpu-host-pools: {st.state.value} ({st.detail})")


class L3Stack:
    """One cache instance (one "process") over a storage directory.

    `storage_backend` is the `--hicache-storage-backend` name (default `file`,
    sglang-l3's store; `mooncake` joins the store that `extra_config` names,
    e.g. `sglang_l3.testing.mooncake.MooncakeCluster.extra_config()`).
    `extra_config` is `--hicache-storage-backend-extra-config`.
    `host_budget_bytes`: what upstream may book for the host pools (default half
    of the RAM available now; a benchmark that owns the machine passes more).
    """

    def __init__(
        self,
        spec: HybridSpec,
        storage_dir: str,
        *,
        tree_core: str = "rust",
        prefetch_threshold: int = 1,
        write_policy: str = "write_through",
        storage_backend: str = "file",
        extra_config: dict[str, Any] | None = None,
        server_args: dict[str, Any] | None = None,
        host_budget_bytes: int | None = None,
    ):
        from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
        from sglang.srt.environ import envs
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        if tree_core not in ALL_TREE_CORES:
            raise ValueError(f"tree_core must be one of {ALL_TREE_CORES}")
        if tree_core not in TREE_CORES:
            _note_core_swap(tree_core)
            tree_core = TREE_CORES[0]
        if spec.device == "cpu":
            ensure_cpu_host_pools()
        self.spec = spec
        self.storage_dir = storage_dir
        self._exit = contextlib.ExitStack()
        self._exit.enter_context(get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1))
        self._exit.enter_context(envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir))
        cfg = {"prefetch_threshold": prefetch_threshold, **(extra_config or {})}
        self.server_args = ServerArgs(
            model_path="dummy",
            page_size=spec.page_size,
            hicache_io_backend="direct",
            hicache_mem_layout="page_first_direct",
            hicache_write_policy=write_policy,
            hicache_storage_backend=storage_backend,
            hicache_storage_backend_extra_config=json.dumps(cfg),
            hicache_storage_prefetch_policy="wait_complete",
            hicache_host_memory_mode="buffer_only",
            **(server_args or {}),
        )
        self.server_args._mamba_cache_chunk_size = max(CHUNK_SIZE, spec.page_size)
        set_global_server_args_for_scheduler(self.server_args)
        self.req_to_token_pool, self.allocator, params = self._build_pools(envs)
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(tree_core):
            self.cache = UnifiedRadixCache(params=params)
        if self.cache._tree_core_backend != tree_core:
            raise RuntimeError(f"asked for tree core {tree_core}, got {self.cache._tree_core_backend}")
        # The host pools here are a few MB, but upstream sizes them against free RAM
        # minus a fixed 10 GiB reserve (pool_host.base.HICACHE_HOST_MEMORY_RESERVE_BYTES),
        # which a busy test machine does not always have: book them against half of
        # what is free instead, as upstream's own host_memory_budget_scope allows.
        import psutil
        from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

        budget = psutil.virtual_memory().available // 2 if host_budget_bytes is None else host_budget_bytes
        with host_memory_budget_scope(budget):
            self.cache.init_hicache(self.server_args, params)
        atexit.unregister(self.cache.shutdown)
        cc = self.cache.cache_controller
        # The forward stream, wired as Scheduler.__init__ wires the model runner's: upstream
        # fences every load-back (start_loading) and backup (start_writing) behind it. On the
        # simulated device (sglang_l3.sim.harness) work queued here runs only when waited on,
        # like a forward pass still running beside the scheduler under overlap scheduling.
        from sglang.srt.utils import get_device_module

        self.device_module = get_device_module()
        self.forward_stream = self.device_module.Stream()
        cc.load_fence_stream = self.forward_stream
        cc.write_fence_stream = self.forward_stream
        cc.prefetch_capacity_limit = max(cc.prefetch_capacity_limit, cc.mem_pool_host.size)
        self.cache.load_back_threshold = 0
        # admit() compares the KV a forward pass reads with what fill_kv wrote (every
        # test writes its contexts through write()/fill_kv); off for other contents.
        self.check_forward_kv = True
        self._rid = 0
        self.baseline = self.pool_sizes()

    # ------------------------------------------------------------------ pools
    def _build_pools(self, envs: Any) -> tuple[Any, Any, Any]:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        s = self.spec
        with envs.SGLANG_MAMBA_SSM_DTYPE.override(s.ssm_dtype):
            shape = Mamba2StateShape.create(
                tp_world_size=1,
                intermediate_size=s.mamba_intermediate_size,
                n_groups=s.mamba_n_groups,
                num_heads=s.mamba_num_heads,
                head_dim=s.mamba_head_dim,
                state_size=s.mamba_state_size,
                conv_kernel=s.mamba_conv_kernel,
            )
            cache_params = Mamba2CacheParams(shape=shape, layers=s.mamba_layer_ids)
        rtp = HybridReqToTokenPool(
            size=s.max_num_reqs,
            mamba_size=s.mamba_cache_size,
            mamba_spec_state_size=s.max_num_reqs,
            max_context_len=s.max_context_len,
            device=s.device,
            enable_memory_saver=False,
            cache_params=cache_params,
            mamba_layer_ids=s.mamba_layer_ids,
            enable_mamba_extra_buffer=s.extra_buffer,
            speculative_num_draft_tokens=3,
        )
        kv_pool = HybridLinearKVPool(
            size=s.kv_size,
            dtype=s.dtype,
            page_size=s.page_size,
            head_num=s.head_num,
            head_dim=s.head_dim,
            full_attention_layer_ids=list(s.full_attention_layer_ids),
            device=s.device,
            enable_memory_saver=False,
            mamba_pool=rtp.mamba_pool,
        )
        if s.page_size > 1:
            allocator: Any = PagedTokenToKVPoolAllocator(
                size=s.kv_size, page_size=s.page_size, dtype=s.dtype, device=s.device, kvcache=kv_pool, need_sort=False
            )
        else:
            allocator = TokenToKVPoolAllocator(
                size=s.kv_size, dtype=s.dtype, device=s.device, kvcache=kv_pool, need_sort=False
            )
        params = CacheInitParams(
            req_to_token_pool=rtp,
            token_to_kv_pool_allocator=allocator,
            page_size=s.page_size,
            disable=False,
            tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            enable_mamba_extra_buffer=s.extra_buffer,
        )
        return rtp, allocator, params

    @property
    def kv_pool(self) -> Any:
        pool = self.allocator.get_kvcache()
        return getattr(pool, "full_kv_pool", pool)

    @property
    def mamba_cache(self) -> Any:
        return self.req_to_token_pool.mamba_pool.mamba_cache

    def pool_sizes(self) -> dict[str, int]:
        """Free capacity of every pool (compare with `baseline` after requests finish)."""
        out = {
            "device_kv": int(self.allocator.available_size()),
            "device_mamba": int(self.req_to_token_pool.mamba_allocator.available_size()),
            "req_slots": int(self.req_to_token_pool.available_size()),
        }
        host = self.cache.cache_controller.mem_pool_host
        for entry in getattr(host, "entries", None) or []:
            out[f"host_{getattr(entry.name, 'name', entry.name).lower()}"] = int(entry.host_pool.available_size())
        return out

    # --------------------------------------------------------------- requests
    def new_req(self, rid: str | None = None, input_ids: list[int] | None = None) -> Any:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._rid += 1
        req = Req(
            rid=rid or f"r{self._rid}",
            origin_input_text="",
            origin_input_ids=array("q", input_ids or []),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        return req

    def key(self, seq: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", seq))

    def match(self, seq: list[int]) -> Any:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        return self.cache.match_prefix(MatchPrefixParams(key=self.key(seq)))

    def node_mamba_slot(self, node: Any) -> int | None:
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        v = self.cache.tree_core.get_component_device_value(node, ComponentType.MAMBA)
        return None if v is None else int(torch.as_tensor(v).reshape(-1)[0])

    def snapshot(self, node: Any, mamba_slot: int | None) -> Snapshot:
        idx = self.cache.path_device_indices(node)
        layer = self.kv_pool.start_layer
        k = self.kv_pool.get_key_buffer(layer)[idx].clone()
        v = self.kv_pool.get_value_buffer(layer)[idx].clone()
        mamba: list[torch.Tensor] = []
        if mamba_slot is not None:
            mc = self.mamba_cache
            s = torch.tensor([mamba_slot])
            mamba = [mc.temporal[:, s].clone()] + [c[:, s].clone() for c in mc.conv]
        return Snapshot(k, v, mamba)

    def write(self, seq: list[int], marker: float = 1.0, *, flush: bool = True, state: float | None = None) -> Snapshot:
        """Insert `seq` with its KV and a Mamba state, and write it through to L3.

        KV is a function of (token id, position, layer) only — like a real
        model's, so contexts sharing a prefix agree on it — with values that
        differ page to page, so a misplaced page is caught. The Mamba state is
        `marker`-salted and depends on the whole sequence (or is the constant
        `state`). `flush=False` leaves the L3 write-through queued.
        """
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        value = self.allocator.alloc(len(seq))
        if value is None:
            raise RuntimeError("device KV pool exhausted")
        # A slot owned by the tree from the start, as after a request donates it.
        slot = self.req_to_token_pool.mamba_allocator.alloc(1)
        if slot is None:
            raise RuntimeError("device Mamba pool exhausted")
        slot = slot.reshape(-1)[:1]
        self.fill_kv(value, seq, 0)
        mc = self.mamba_cache
        for i, t in enumerate([mc.temporal, *mc.conv]):
            t[:, slot] = self.state_value(seq, marker, i) if state is None else state
        self.cache.insert(InsertParams(key=self.key(seq), value=value, mamba_value=slot.reshape(1)))
        m = self.match(seq)
        if m.device_prefix_len != len(seq):
            raise RuntimeError(f"insert matched {m.device_prefix_len} of {len(seq)}")
        snap = self.snapshot(m.last_device_node, int(slot))
        if flush:
            self.flush_backups()
        return snap

    @staticmethod
    def state_value(seq: list[int], marker: float, part: int) -> float:
        """The value `write(seq, marker)` gives Mamba state part `part` (0: temporal,
        i: conv i) in every layer: `marker`-salted, a function of the whole sequence."""
        return marker + float(hash(tuple(seq)) % 1009) / 64 + part

    def fill_kv(self, rows: torch.Tensor, token_ids: list[int], start_pos: int) -> None:
        """What a model would write: KV as a function of (token id, position, layer)."""
        dev = self.kv_pool.get_key_buffer(self.kv_pool.start_layer).device
        ids = torch.tensor(list(token_ids), dtype=torch.float32, device=dev)
        pos = torch.arange(start_pos, start_pos + len(ids), dtype=torch.float32, device=dev)
        base = ((ids % 251) / 8 + (pos % 61) / 4).view(-1, 1, 1)
        for layer in range(self.kv_pool.start_layer, self.kv_pool.start_layer + self.kv_pool.layer_num):
            kb, vb = self.kv_pool.get_key_buffer(layer), self.kv_pool.get_value_buffer(layer)
            kb[rows] = (base + layer).to(kb.dtype)
            vb[rows] = (-base - layer).to(vb.dtype)

    def expected_kv(
        self, token_ids: list[int], start_pos: int = 0, layer: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV fill_kv writes for `token_ids` at positions from `start_pos` (default:
        a whole prefix) in `layer` of the full-attention pool (default: its first)."""
        pos = torch.arange(start_pos, start_pos + len(token_ids))
        return self._expected_kv_at(torch.tensor(list(token_ids)), pos, layer)

    def _expected_kv_at(
        self, ids: torch.Tensor, pos: torch.Tensor, layer: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.kv_pool.start_layer if layer is None else layer
        kb = self.kv_pool.k_buffer[layer - self.kv_pool.start_layer]
        ids, pos = ids.to(kb.device), pos.to(kb.device)
        base = ((ids.float() % 251) / 8 + (pos.float() % 61) / 4).view(-1, 1, 1)
        shape = (len(ids),) + tuple(kb.shape[1:])
        return (base + layer).expand(shape).to(kb.dtype), (-base - layer).expand(shape).to(kb.dtype)

    # ----------------------------------------------------- the forward stream
    def forward_read(
        self,
        consumer: int,
        rows: torch.Tensor,
        token_ids: torch.Tensor | None,
        positions: torch.Tensor | None,
        mamba_slots: list[int],
        *,
        check: bool = True,
    ) -> ForwardRead:
        """Queue on the forward stream what a forward pass of a just-admitted batch reads:
        `TpModelWorker.set_hicache_consumer(consumer)`, then per layer upstream's own wait
        (`HybridLinearKVPool.get_key_buffer` / `HybridReqToTokenPool.mamba2_layer_index` ->
        `LayerDoneCounter.wait_until`) followed by the read of `rows` in every full-attention
        layer (compared with the KV fill_kv writes for `token_ids` at `positions`; no
        comparison when None) and of `mamba_slots` in every Mamba layer (kept for
        `check_forward_mamba`). The reads run when the forward stream runs
        (`finish_forward()`); `check_forward_read` reports them. With `check=False`
        only upstream's per-layer waits are issued, as a forward pass issues them:
        nothing is read, cloned or compared (what a benchmark times)."""
        kv = self.allocator.get_kvcache()
        rtp = self.req_to_token_pool
        counter = self.cache.cache_controller.layer_done_counter
        out = ForwardRead(len(rows), list(mamba_slots))
        rows = rows.clone()
        slots = torch.tensor(mamba_slots, dtype=torch.int64)
        mc = self.mamba_cache

        def read_kv(k: torch.Tensor, v: torch.Tensor, local: int) -> None:
            if token_ids is None or positions is None:
                out.kv.append((local, 0))
                return
            want_k, want_v = self._expected_kv_at(token_ids, positions, local)
            bad = (k[rows] != want_k).flatten(1).any(1) | (v[rows] != want_v).flatten(1).any(1)
            out.kv.append((local, bad.sum()))

        def read_mamba(i: int, layer: int) -> None:
            out.mamba.append((layer, [mc.temporal[i, slots].clone()] + [c[i, slots].clone() for c in mc.conv]))

        with self.device_module.stream(self.forward_stream):
            counter.set_consumer(consumer)
            try:
                for layer in range(self.spec.num_layers):
                    if layer in self.spec.full_attention_layer_ids:
                        k, v = kv.get_key_buffer(layer), kv.get_value_buffer(layer)  # waits for the layer
                        local = kv.full_attention_layer_id_mapping[layer]  # fill_kv's layer id
                        if check:
                            on_stream(lambda k=k, v=v, L=local: read_kv(k, v, L))
                    elif len(slots):
                        i = rtp.mamba2_layer_index(layer)  # waits for the layer
                        if check:
                            on_stream(lambda i=i, L=layer: read_mamba(i, L))
            finally:
                counter.set_consumer(-1)  # the next batch loads nothing
        return out

    def finish_forward(self) -> None:
        """The forward pass has run (the scheduler reads its result back): drain the forward
        stream only, so its reads see what its own waits ordered, nothing more. (torch.cpu's
        plain streams have no queue and no synchronize.)"""
        sync = getattr(self.forward_stream, "synchronize", None)
        if sync is not None:
            sync()

    def check_forward_read(self, read: ForwardRead) -> None:
        """The forward read the KV fill_kv wrote in every row it read."""
        assert len(read.kv) == len(self.spec.full_attention_layer_ids), "the forward read has not run"
        for layer, n in read.kv:
            bad = int(n)
            if bad:
                raise RestoreFailed(
                    f"the forward pass read wrong KV in layer {layer}: {bad} of {read.rows} restored rows differ "
                    "(a copy landed after the forward read it, or something overwrote the rows)"
                )

    def check_forward_mamba(self, read: ForwardRead) -> None:
        """The Mamba states the forward read equal what is there once every copy has landed."""
        mc = self.mamba_cache
        layer_index = dict(self.req_to_token_pool.mamba_map)
        slots = torch.tensor(read.mamba_slots, dtype=torch.int64)
        for layer, got in read.mamba:
            i = layer_index[layer]
            now = [mc.temporal[i, slots]] + [c[i, slots] for c in mc.conv]
            if not all(a.equal(b) for a, b in zip(got, now, strict=True)):
                raise RestoreFailed(f"the forward pass read a Mamba state in layer {layer} before it landed")

    def inflight_forward_write_then_free(self, value: float = 123.0) -> torch.Tensor:
        """Test fault: what overlap scheduling does when a request is found finished — its
        rows are freed while the forward pass already launched still writes its last token
        there. Takes every free device KV row, queues a write of `value` into all of them on
        the forward stream, and frees them. Returns the rows. (On a synchronous device the
        write lands at once and is harmless.) On a GPU the forward stream first spins for
        FORWARD_BUSY_CYCLES (a forward still running), so a copy not fenced behind it lands
        before the write and is overwritten, as on the simulated device."""
        if self.spec.device == "cuda":
            with self.device_module.stream(self.forward_stream):
                torch.cuda._sleep(FORWARD_BUSY_CYCLES)
        n = self.allocator.available_size()
        rows = self.allocator.alloc(n // self.spec.page_size * self.spec.page_size)
        kv = self.kv_pool
        layers = [(kv.k_buffer[i], kv.v_buffer[i]) for i in range(kv.layer_num)]
        r = rows.clone()

        def write() -> None:
            for kb, vb in layers:
                kb[r] = value
                vb[r] = value

        with self.device_module.stream(self.forward_stream):
            on_stream(write, "forward-write")
        self.allocator.free(rows)
        return r

    def forward_busy(self) -> bool:
        """The forward stream still has queued work (the in-flight forward of
        `inflight_forward_write_then_free` has not run yet)."""
        pending = getattr(self.forward_stream, "pending", None)
        if pending is not None:  # the simulated device
            return bool(pending())
        return not self.forward_stream.query()

    def flush_backups(self) -> None:
        bp = self.cache.buffer_pipeline
        bp.flush_pending_writes()
        pump(
            self.cache,
            lambda: not bp.inflight_backup_node_ids and not bp.ongoing_backup and not bp.pending_write_queue,
            "L3 write-through to drain",
        )

    def drain_host_writes(self) -> None:
        """Wait until every device-to-host write is acked. A node whose host backup is
        still in flight stays protected (its device rows are being read), and on a
        device whose acks lag (the simulated one, a GPU) that lasts some ticks."""
        cc = self.cache.cache_controller
        pump(self.cache, lambda: not cc.ack_write_queue, "device-to-host writes to be acked")

    def settle(self, timeout: float = 30.0, quiet_s: float = 1.0) -> None:
        """Drain write-through and the controller's host-release queues: backups
        finish in the storage thread and their staging memory comes back through
        the release queues, so wait until nothing has moved for `quiet_s`."""
        self.flush_backups()
        cc = self.cache.cache_controller
        queues = [cc.host_mem_release_queue, *getattr(cc, "extra_host_mem_release_queues", {}).values()]
        deadline = time.monotonic() + timeout
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            self.cache.check_hicache_events()
            now = self.pool_sizes()
            if now != last or not all(q.empty() for q in queues):
                last, since = now, time.monotonic()
            elif now == self.baseline or time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.005)

    def evict_all(self, *, stage_queued_writes: bool = True) -> None:
        """Evict everything evictable. A node whose L3 write is still queued stays on the
        device until the write staged (patch write-guard); by default the queue is staged
        first, as a busy server's next eviction would find it."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        bp = self.cache.buffer_pipeline
        if stage_queued_writes and bp is not None and bp.pending_write_queue:
            bp.flush_pending_writes()
            pump(
                self.cache,
                lambda: not bp.pending_write_queue and not bp.ongoing_write_through,
                "queued L3 writes to stage before the eviction",
            )
        self.cache.evict(EvictParams(num_tokens=self.spec.kv_size, mamba_num=self.spec.mamba_cache_size))

    def scribble(self) -> None:
        """Overwrite every device pool so a restore that reads stale memory is caught."""
        for layer in range(self.kv_pool.start_layer, self.kv_pool.start_layer + self.kv_pool.layer_num):
            self.kv_pool.get_key_buffer(layer).fill_(-7)
            self.kv_pool.get_value_buffer(layer).fill_(-7)
        self.mamba_cache.temporal.fill_(-7)
        for c in self.mamba_cache.conv:
            c.fill_(-7)

    def start_prefetch(self, seq: list[int], rid: str) -> Any:
        """Issue upstream's prefetch_from_storage for `seq` from the root; returns its handle."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        h = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(h, self.cache.root_node_handle(), array("q", seq), None, None)
        return h

    def prefetch(self, seq: list[int], rid: str) -> tuple[Any, int]:
        """prefetch_from_storage → staged hold; returns (handle, loaded tokens)."""
        h = self.start_prefetch(seq, rid)
        bp = self.cache.buffer_pipeline
        pump(
            self.cache,
            lambda: self.cache.check_prefetch_progress(h) and (bp.has_staged(h) or h not in bp.staged_prefetches),
            "prefetch to complete",
        )
        loaded = self.cache.pop_prefetch_loaded_tokens(h)
        return h, int(loaded or 0)

    def restore(self, seq: list[int], rid: str, *, check_forward: bool = True) -> tuple[Any, int]:
        """Storage → staged → admission-style init_load_back → ack. Returns (req, loaded_len).
        `check_forward`: as for `admit`."""
        h, _ = self.prefetch(seq, rid)
        return self.admit(h, seq, rid, check_forward=check_forward)

    def admit(
        self,
        h: Any,
        seq: list[int],
        rid: str,
        *,
        loads_first: bool | None = None,
        check_forward: bool = True,
    ) -> tuple[Any, int]:
        """Admission of a staged prefetch (handle `h`): prepare → init_load_back → the
        batch's forward (reads behind the per-layer waits, checked) → ack. On the simulated
        device the load stream may run ahead of the forward stream (a copy engine that got
        there first): `loads_first`, or a seeded coin when None.

        `check_forward=False` is for benchmarks, which time this call: the forward pass
        only waits on each layer as upstream's does, and reads nothing. The forward-time
        read (every restored row and state read and cloned, the KV compared) is the
        tests' check of the copies' ordering and costs more than the restore itself at
        real model sizes (issue 34); a benchmark checks the result with
        `verify_restored` after its timer stops."""
        from sglang.srt.managers.schedule_policy import PrefillAdder
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        if not self.cache.buffer_pipeline.has_staged(h):
            raise RestoreFailed(f"nothing staged for {rid}")
        req = self.new_req(rid, seq)
        self.req_to_token_pool.alloc([req])
        req.cache_request_handle = h
        m = self.match(seq)
        req.prefix_len = m.device_prefix_len
        req.last_node = m.last_device_node
        if not self.cache.buffer_pipeline.prepare_staged_prefetch(req):
            raise RestoreFailed("prepare_staged_prefetch refused the staged hold")
        adder = PrefillAdder.__new__(PrefillAdder)
        adder.tree_cache = self.cache
        with adder._lock_node(req.last_node):
            loaded = self.cache.init_load_back(
                InitLoadBackParams(best_match_node=None, host_hit_length=req.host_hit_length, req=req)
            )
        if loaded is None:
            raise RestoreFailed("init_load_back fell back to recompute")
        loaded_len, node = loaded
        req.last_node = node  # what PrefillAdder.add_one_req does with the result
        consumer = self.cache.ready_to_load_host_cache()
        if _sim_active() and (sim_chance() if loads_first is None else loads_first):
            self.cache.cache_controller.l2_transfer_engine.host_to_device_stream.synchronize()
        # The batch's forward pass runs before the ack is seen: it reads the restored rows
        # and states behind upstream's per-layer waits only.
        rows = self.cache.path_device_indices(node)
        n, end = int(loaded_len), len(rows)
        slots = [s for s in (self.node_mamba_slot(node), _req_mamba_slot(req)) if s is not None]
        ids = torch.tensor(seq[end - n : end]) if self.check_forward_kv and check_forward else None
        read = self.forward_read(consumer, rows[end - n :], ids, torch.arange(end - n, end), slots, check=check_forward)
        self.finish_forward()
        if check_forward:
            self.check_forward_read(read)
        pump(self.cache, lambda: not self.cache.buffer_pipeline.ongoing_buffer_load_back, "load-back ack")
        if check_forward:
            self.check_forward_mamba(read)
        return req, n

    def verify_restored(self, seq: list[int], req: Any, loaded: int, marker: float) -> None:
        """After a restore of `seq` written by `write(seq, marker)` (all of it on the device
        once restored): the request is bound to the node at its end, every full-attention
        layer's KV on the whole path is what `fill_kv` writes, and the node's and the
        request's Mamba slots (two different slots) hold the written state. Raises
        RestoreFailed naming what differs. Reads everything once: call it outside a timer."""
        m = self.match(seq)
        node = m.last_device_node
        if loaded <= 0 or m.device_prefix_len != len(seq):
            raise RestoreFailed(f"restored {loaded}; the device holds {m.device_prefix_len} of {len(seq)} tokens")
        if req.last_node is not node:
            raise RestoreFailed("the request is not bound to the restored node")
        rows = self.cache.path_device_indices(node)
        ids, pos = torch.tensor(seq), torch.arange(len(seq))
        kv = self.kv_pool
        for layer in range(kv.start_layer, kv.start_layer + kv.layer_num):
            want_k, want_v = self._expected_kv_at(ids, pos, layer)
            if not (kv.get_key_buffer(layer)[rows].equal(want_k) and kv.get_value_buffer(layer)[rows].equal(want_v)):
                raise RestoreFailed(f"restored KV differs in full-attention layer {layer}")
            del want_k, want_v
        node_slot, req_slot = self.node_mamba_slot(node), _req_mamba_slot(req)
        if node_slot is None or req_slot is None or node_slot == req_slot:
            raise RestoreFailed(f"Mamba slots: node {node_slot}, request {req_slot} (two different slots expected)")
        mc = self.mamba_cache
        for part, t in enumerate([mc.temporal, *mc.conv]):
            want = self.state_value(seq, marker, part)
            for slot in (node_slot, req_slot):
                got = t[:, slot]
                if not bool((got == torch.tensor(want, dtype=got.dtype)).all()):
                    raise RestoreFailed(f"Mamba state part {part} in slot {slot} differs from the written state")

    def check_restored(
        self, seq: list[int], req: Any, loaded: int, want: Snapshot, *, kv: bool = False, resident: int = 0
    ) -> None:
        """Assert a whole-sequence restore: the request is bound to the restored node, the
        node and the request hold the Mamba state in different slots, and both equal `want`
        (with `kv`, the device KV also equals what `write` stored). `loaded` tokens came
        from the host after `resident` tokens the device already held."""
        m = self.match(seq)
        assert resident + loaded == len(seq) == m.device_prefix_len, (resident, loaded, len(seq), m.device_prefix_len)
        assert req.last_node == m.last_device_node, "request not bound to the restored node"
        node_slot = self.node_mamba_slot(m.last_device_node)
        req_slot = int(req.kv.mamba_pool_idx)
        assert node_slot is not None, "restored node has no device Mamba state"
        assert node_slot != req_slot, "request must never decode in the node's slot"
        assert self.snapshot(m.last_device_node, req_slot).equal(want), "request Mamba slot / KV differ"
        assert self.snapshot(m.last_device_node, node_slot).equal(want), "node Mamba slot / KV differ"
        if kv:
            k, v = self.expected_kv(seq)
            got = self.snapshot(m.last_device_node, None)
            assert got.k.equal(k) and got.v.equal(v), "restored KV differs"

    def assert_recompute(self, seq: list[int], rid: str, timeout: float = 30.0) -> None:
        """The restore attempt ends in recompute: nothing staged, and once the discarded
        prefetch buffers come back (asynchronously), every pool is at its baseline."""
        try:
            self.restore(seq, rid)
        except RestoreFailed:
            pass
        else:
            raise AssertionError(f"{rid}: restored, but a recompute was expected")
        assert self.match(seq).device_prefix_len == 0
        self.evict_all()
        deadline = time.monotonic() + timeout
        while self.pool_sizes() != self.baseline and time.monotonic() < deadline:
            self.cache.check_hicache_events()
            time.sleep(0.01)
        assert self.pool_sizes() == self.baseline, "a failed restore leaked pool capacity"

    def release(self, req: Any) -> None:
        """Finish a restored request: drop its private Mamba slot(s) and its row."""
        if req.kv.mamba_pool_idx is not None:
            self.req_to_token_pool.free_mamba_cache(req)
        self.req_to_token_pool.free(req)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.device_module.synchronize()  # no queued copy outlives the pools
        with contextlib.suppress(Exception):
            self.cache.cache_controller._stop_storage_threads()
        with contextlib.suppress(Exception):
            self.cache.release_host_resources()
        backend = getattr(self.cache.cache_controller, "storage_backend", None)
        close_backend = getattr(backend, "close", None)
        if close_backend is not None:  # our store's session-table writer thread and directory fds
            with contextlib.suppress(Exception):
                close_backend()
        self._exit.close()

    def __enter__(self) -> L3Stack:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
