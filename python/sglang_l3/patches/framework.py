"""The patch queue: load `series.toml`, verify targets, apply, record state.

Upstream's HookRegistry only *logs* a target it cannot resolve, so a typo or an
upstream rename silently does nothing. Here every target is resolved and
fingerprinted before anything is installed; a missing target is an error that
names the patch and the target, a drifted one is refused unless
SGLANG_L3_ALLOW_DRIFT=1. Every hook records whether it fired, so `doctor`
reports the real state.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import importlib
import inspect
import logging
import pkgutil
import textwrap
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_l3 import envs

logger = logging.getLogger("sglang_l3.patches")

SERIES_PATH = Path(__file__).with_name("series.toml")
KINDS = ("BEFORE", "AFTER", "AROUND", "REPLACE", "REGISTRY")


class PatchError(RuntimeError):
    """A patch could not be verified or applied. Always names patch and target."""


# every str()/format of a state goes through .value, so StrEnum changes no output
class State(enum.StrEnum):
    APPLIED = "applied"
    DISABLED = "disabled"
    DRIFTED = "drifted"
    NOT_APPLICABLE = "not applicable"
    FAILED = "failed"
    PENDING = "pending"


@dataclass(frozen=True)
class TargetSpec:
    path: str  # "package.module:Qual.name" (pkgutil.resolve_name syntax)
    fingerprint: str  # "sha256:<16 hex>" of the target's source in the pinned upstream


@dataclass(frozen=True)
class PatchSpec:
    id: str
    module: str
    kind: str
    why: str
    upstream: tuple[str, ...]
    retire_when: str
    targets: tuple[TargetSpec, ...]
    group: str = "all"
    requires: tuple[str, ...] = ()  # patch ids applied (and required APPLIED) first
    how: str = ""  # what the patch does (why: the upstream defect)
    upstream_none: str = ""  # why there is no upstream reference
    # changes only what is logged: where a target drifted (a torch other than the pin's,
    # say) the patch is skipped with a logged reason instead of refusing the start
    cosmetic: bool = False

    @property
    def kinds(self) -> frozenset[str]:
        """What the patch installs ("REGISTRY+AFTER" -> {REGISTRY, AFTER})."""
        return frozenset(self.kind.split("+"))


@dataclass
class PatchStatus:
    spec: PatchSpec
    state: State = State.PENDING
    detail: str = ""
    drift: dict[str, tuple[str, str]] = field(default_factory=dict)  # path -> (expected, actual)
    fired: dict[str, int] = field(default_factory=dict)  # hook name -> times it ran

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.spec.id,
            "kind": self.spec.kind,
            "state": self.state.value,
            "detail": self.detail,
            "targets": [t.path for t in self.spec.targets],
            "drift": {k: {"expected": e, "actual": a} for k, (e, a) in self.drift.items()},
            "fired": dict(self.fired),
            "why": self.spec.why,
            "how": self.spec.how,
            "upstream": list(self.spec.upstream),
            "upstream_none": self.spec.upstream_none,
            "retire_when": self.spec.retire_when,
            "requires": list(self.spec.requires),
        }


# --------------------------------------------------------------------------- #
# series.toml
# --------------------------------------------------------------------------- #
def load_series(path: Path = SERIES_PATH) -> list[PatchSpec]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    specs: list[PatchSpec] = []
    seen: set[str] = set()
    for entry in data.get("patch", []):
        pid = entry["id"]
        if pid in seen:
            raise PatchError(f"series.toml: patch id {pid!r} appears twice")
        seen.add(pid)
        raw_kind = entry["kind"]
        kinds = [raw_kind] if isinstance(raw_kind, str) else list(raw_kind)
        kinds = [k.upper() for k in kinds]
        for k in kinds:
            if k not in KINDS:
                raise PatchError(f"series.toml: patch {pid!r} has unknown kind {k!r}")
        if not kinds or len(set(kinds)) != len(kinds):
            raise PatchError(f"series.toml: patch {pid!r} has kind {raw_kind!r} (empty or repeated)")
        kind = "+".join(kinds)
        requires = tuple(entry.get("requires", []))
        for r in requires:
            if r not in seen or r == pid:
                raise PatchError(
                    f"series.toml: patch {pid!r} requires {r!r}, which is not an earlier entry "
                    "(a required patch must come before the patches that require it)"
                )
        for key in ("why", "retire_when", "module"):
            if not entry.get(key):
                raise PatchError(f"series.toml: patch {pid!r} lacks {key!r}")
        targets = tuple(TargetSpec(t["path"], t["fingerprint"]) for t in entry.get("target", []))
        if not targets:
            raise PatchError(f"series.toml: patch {pid!r} names no target")
        specs.append(
            PatchSpec(
                id=pid,
                module=entry["module"],
                kind=kind,
                why=entry["why"].strip(),
                upstream=tuple(entry.get("upstream", [])),
                retire_when=entry["retire_when"].strip(),
                targets=targets,
                group=entry.get("group", "all"),
                requires=requires,
                how=entry.get("how", "").strip(),
                upstream_none=entry.get("upstream_none", "").strip(),
                cosmetic=_flag(pid, entry, "cosmetic"),
            )
        )
    return specs


def _flag(pid: str, entry: dict[str, Any], key: str) -> bool:
    value = entry.get(key, False)
    if not isinstance(value, bool):
        raise PatchError(f"series.toml: patch {pid!r} has {key} = {value!r} (true or false)")
    return value


# --------------------------------------------------------------------------- #
# Target resolution and fingerprints
# --------------------------------------------------------------------------- #
def resolve(path: str) -> Any:
    """Resolve "pkg.mod:Qual.name"; raises PatchError naming the path."""
    try:
        return pkgutil.resolve_name(path)
    except Exception as e:  # ImportError, AttributeError, ValueError
        raise PatchError(f"target {path!r} not found: {type(e).__name__}: {e}") from e


def _split_owner(path: str) -> tuple[Any, str]:
    mod, _, qual = path.partition(":")
    if not qual:
        mod, _, attr = path.rpartition(".")
        return importlib.import_module(mod), attr
    owner_path, _, attr = qual.rpartition(".")
    owner = importlib.import_module(mod)
    for part in filter(None, owner_path.split(".")):
        owner = getattr(owner, part)
    return owner, attr


def _original(owner: Any, attr: str) -> Any:
    """The raw attribute (unwrapping our own hooks, keeping static/classmethod)."""
    raw = inspect.getattr_static(owner, attr)
    while getattr(_unwrap_descriptor(raw), "__sglang_l3_original__", None) is not None:
        raw = _unwrap_descriptor(raw).__sglang_l3_original__
    return raw


def _unwrap_descriptor(raw: Any) -> Any:
    return raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw


def fingerprint_of(obj: Any) -> str:
    """sha256 of a target's source (functions, classes) or of its value (data)."""
    fn = _unwrap_descriptor(obj)
    fn = getattr(fn, "__sglang_l3_original__", fn)
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (TypeError, OSError):
        if isinstance(fn, dict):
            text = repr(sorted(map(str, fn.keys())))
        elif isinstance(fn, (list, tuple, set, frozenset)):
            text = repr(sorted(map(str, fn)))
        else:
            text = repr(fn)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_path(path: str) -> str:
    owner, attr = _split_owner(path)
    if isinstance(owner, type) or inspect.ismodule(owner):
        try:
            return fingerprint_of(_original(owner, attr))
        except AttributeError as e:
            raise PatchError(f"target {path!r} not found: {e}") from e
    return fingerprint_of(resolve(path))


# --------------------------------------------------------------------------- #
# Hook installation (with undo, for tests' negative controls)
# --------------------------------------------------------------------------- #
@dataclass
class _Installed:
    owner: Any
    attr: str
    previous: Any


class PatchContext:
    """Handed to a patch module's `apply(ctx)`; only its declared targets are hookable."""

    def __init__(self, status: PatchStatus):
        self.status = status
        self._installed: list[_Installed] = []
        self._allowed = {t.path for t in status.spec.targets}
        self.kinds_installed: set[str] = set()  # checked against series.toml's `kind`

    @property
    def id(self) -> str:
        return self.status.spec.id

    def fired(self, name: str) -> None:
        """Record that a hook ran (doctor shows counts per process)."""
        with _LOCK:
            self.status.fired[name] = self.status.fired.get(name, 0) + 1

    def _check_target(self, path: str) -> tuple[Any, str, Any]:
        if path not in self._allowed:
            raise PatchError(f"patch {self.id!r} hooks {path!r}, which series.toml does not declare")
        owner, attr = _split_owner(path)
        raw = inspect.getattr_static(owner, attr)
        return owner, attr, raw

    def _install(self, path: str, make: Callable[[Callable], Callable]) -> None:
        owner, attr, raw = self._check_target(path)
        fn = _unwrap_descriptor(raw)
        wrapper = make(fn)
        functools.update_wrapper(wrapper, fn)
        # a function object takes attributes; typeshed's Callable declares none
        wrapper.__sglang_l3_original__ = raw  # type: ignore[attr-defined]
        wrapper.__sglang_l3_patch__ = self.id  # type: ignore[attr-defined]
        if isinstance(raw, staticmethod):
            new: Any = staticmethod(wrapper)
        elif isinstance(raw, classmethod):
            new = classmethod(wrapper)
        else:
            new = wrapper
        setattr(owner, attr, new)
        self._installed.append(_Installed(owner, attr, raw))

    def around(self, path: str, hook: Callable[..., Any]) -> None:
        """hook(original, *args, **kwargs) -> result."""
        self.kinds_installed.add("AROUND")
        self._around(path, hook)

    def _around(self, path: str, hook: Callable[..., Any]) -> None:
        name = path.rsplit(".", 1)[-1]

        def make(fn: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.fired(name)
                return hook(fn, *args, **kwargs)

            return wrapper

        self._install(path, make)

    def after(self, path: str, hook: Callable[..., Any]) -> None:
        """hook(result, *args, **kwargs) -> new result (None keeps the result)."""
        self.kinds_installed.add("AFTER")

        def wrapped(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            new = hook(result, *args, **kwargs)
            return result if new is None else new

        self._around(path, wrapped)

    def before(self, path: str, hook: Callable[..., Any]) -> None:
        """hook(*args, **kwargs) -> None or (args, kwargs)."""
        self.kinds_installed.add("BEFORE")

        def wrapped(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            changed = hook(*args, **kwargs)
            if changed is not None:
                args, kwargs = changed
            return fn(*args, **kwargs)

        self._around(path, wrapped)

    def replace(self, path: str, new: Any) -> None:
        self.kinds_installed.add("REPLACE")
        owner, attr, raw = self._check_target(path)
        if callable(new) and not isinstance(new, type):

            def make(_fn: Callable) -> Callable:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    self.fired(attr)
                    return new(*args, **kwargs)

                return wrapper

            self._install(path, make)
        else:
            setattr(owner, attr, new)
            self._installed.append(_Installed(owner, attr, raw))

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Register the undo of an in-place edit (a registry dict, a module or class
        attribute that is not a declared callable): kind REGISTRY."""
        self.kinds_installed.add("REGISTRY")
        self._installed.append(_Installed(None, "", fn))

    def undo(self) -> None:
        for inst in reversed(self._installed):
            if inst.owner is None:
                inst.previous()
            else:
                setattr(inst.owner, inst.attr, inst.previous)
        self._installed.clear()


# --------------------------------------------------------------------------- #
# The queue
# --------------------------------------------------------------------------- #
_LOCK = threading.RLock()
_STATUS: dict[str, PatchStatus] = {}
_CONTEXTS: dict[str, PatchContext] = {}


def disabled_ids() -> set[str]:
    return {x.strip() for x in envs.value("SGLANG_L3_DISABLE").split(",") if x.strip()}


def allow_drift() -> bool:
    return envs.flag("SGLANG_L3_ALLOW_DRIFT")


def check_spec(spec: PatchSpec) -> dict[str, tuple[str, str]]:
    """Resolve every target; return the drifted ones. Missing → PatchError."""
    drift: dict[str, tuple[str, str]] = {}
    for t in spec.targets:
        try:
            actual = fingerprint_path(t.path)
        except PatchError as e:
            raise PatchError(f"patch {spec.id!r}: {e}") from e
        if actual != t.fingerprint:
            drift[t.path] = (t.fingerprint, actual)
    return drift


def _apply_required(spec: PatchSpec, series: list[PatchSpec] | None) -> str | None:
    """Apply `spec.requires` in order; None when all are applied, else why not."""
    if not spec.requires:
        return None
    by_id = {s.id: s for s in (series if series is not None else load_series())}
    for rid in spec.requires:
        req = by_id.get(rid)
        if req is None:
            raise PatchError(f"patch {spec.id!r} requires {rid!r}, which series.toml does not declare")
        st = apply_one(req, series)
        if st.state != State.APPLIED:
            return f"requires {rid} ({st.state.value}{': ' + st.detail if st.detail else ''})"
    return None


def apply_one(spec: PatchSpec, series: list[PatchSpec] | None = None) -> PatchStatus:
    """Verify and apply one patch (its `requires` first). Idempotent per process."""
    with _LOCK:
        status = _STATUS.get(spec.id)
        if status is not None and status.state == State.APPLIED:
            return status
        status = PatchStatus(spec)
        _STATUS[spec.id] = status
        if spec.id in disabled_ids():
            status.state, status.detail = State.DISABLED, "SGLANG_L3_DISABLE"
            return status
        missing = _apply_required(spec, series)
        if missing:
            status.state, status.detail = State.NOT_APPLICABLE, missing
            return status
        module = importlib.import_module(spec.module)
        reason = module.applicable() if hasattr(module, "applicable") else None
        if reason:
            status.state, status.detail = State.NOT_APPLICABLE, reason
            return status
        drift = check_spec(spec)  # raises PatchError on a missing target
        status.drift = drift
        if drift and not allow_drift() and spec.cosmetic:
            # Nothing but a log line depends on it: skip, say so, start.
            found = "; ".join(f"{p}: expected {e}, found {a}" for p, (e, a) in drift.items())
            status.state = State.NOT_APPLICABLE
            status.detail = f"cosmetic patch skipped: its target drifted ({found})"
            logger.warning("sglang-l3: patch %s: %s", spec.id, status.detail)
            return status
        if drift and not allow_drift():
            status.state = State.DRIFTED
            status.detail = "; ".join(f"{p}: expected {e}, found {a}" for p, (e, a) in drift.items())
            raise PatchError(
                f"patch {spec.id!r} refused: upstream drifted ({status.detail}). "
                "Re-verify the patch against this upstream and update series.toml, "
                "or set SGLANG_L3_ALLOW_DRIFT=1 to apply anyway."
            )
        later = _undo_later_on_shared_targets(spec, series if series is not None else load_series())
        ctx = PatchContext(status)
        try:
            module.apply(ctx)
            if ctx.kinds_installed != spec.kinds:
                raise PatchError(
                    f"series.toml declares kind {spec.kind}, but apply() installed "
                    f"{'+'.join(sorted(ctx.kinds_installed)) or 'nothing'}"
                )
        except Exception as e:
            ctx.undo()
            status.state, status.detail = State.FAILED, f"{type(e).__name__}: {e}"
            for again in later:
                apply_one(again, series)
            raise PatchError(f"patch {spec.id!r} failed to apply: {e}") from e
        _CONTEXTS[spec.id] = ctx
        status.state = State.APPLIED
        status.detail = "drift allowed by SGLANG_L3_ALLOW_DRIFT" if drift else ""
        logger.debug("sglang-l3: applied patch %s", spec.id)
        for again in later:
            apply_one(again, series)
        return status


def _undo_later_on_shared_targets(spec: PatchSpec, order: list[PatchSpec]) -> list[PatchSpec]:
    """Before `spec` is applied (again): if a patch that comes after it in the series is
    already applied and hooks one of its targets, `spec` would wrap that patch's wrapper,
    the reverse of the series' nesting (a negative control that undid and re-applied a
    patch changed how the rest of the suite ran). Undo the applied patches from the first
    such later one on, in reverse, and return their specs, in series order, to apply
    again after `spec`. Nothing to do at start-up, which applies in series order."""
    pos = {s.id: i for i, s in enumerate(order)}
    me = pos.get(spec.id)
    if me is None:
        return []
    ids = list(_CONTEXTS)
    first = next((k for k, pid in enumerate(ids) if pos.get(pid, -1) > me), None)
    if first is None:
        return []
    tail = ids[first:]
    mine = {t.path for t in spec.targets}
    if not any(mine & {t.path for t in _STATUS[pid].spec.targets} for pid in tail):
        return []
    specs = [_STATUS[pid].spec for pid in tail]
    for pid in reversed(tail):
        _CONTEXTS.pop(pid).undo()
        _STATUS.pop(pid, None)
    return sorted(specs, key=lambda s: pos.get(s.id, len(pos)))


def apply_all(specs: list[PatchSpec] | None = None, *, strict: bool = True) -> list[PatchStatus]:
    """Apply every patch in series order. strict: re-raise the first failure."""
    out: list[PatchStatus] = []
    series = specs if specs is not None else load_series()
    for spec in series:
        try:
            out.append(apply_one(spec, series))
        except PatchError:
            if strict:
                raise
            out.append(_STATUS[spec.id])
    return out


def _dependants(patch_id: str, ids: list[str]) -> list[str]:
    """The applied patches (in `ids`, application order) that require `patch_id`, directly or not."""
    out: list[str] = []
    for pid in ids:
        if set(_STATUS[pid].spec.requires) & {patch_id, *out}:
            out.append(pid)
    return out


def undo(patch_id: str) -> list[str]:
    """Remove an applied patch (tests' negative controls in one process).

    Patches applied later wrap hooks installed before them, and a wrapper undone in
    the middle of a stack would be brought back by the undo of one above it (each
    restores what it found when it was applied). So every patch applied from
    `patch_id` on is undone, last first, and the others are applied again in series
    order: only `patch_id` is removed, and the nesting is the series'. Patches that
    require `patch_id` cannot stay without it (applying one applies its
    requirements): they are removed too, and their ids returned, to apply again
    after `patch_id`.
    """
    with _LOCK:
        if patch_id not in _CONTEXTS:
            _STATUS.pop(patch_id, None)
            return []
        ids = list(_CONTEXTS)
        dependants = _dependants(patch_id, ids)
        gone = {patch_id, *dependants}
        tail = ids[min(ids.index(p) for p in gone) :]
        keep = [_STATUS[pid].spec for pid in tail if pid not in gone]
        for pid in reversed(tail):
            _CONTEXTS.pop(pid).undo()
            _STATUS.pop(pid, None)
        order = load_series()
        pos = {s.id: i for i, s in enumerate(order)}
        for spec in sorted(keep, key=lambda s: pos.get(s.id, len(pos))):
            apply_one(spec, order if spec.id in pos else None)
        return dependants


def status() -> dict[str, PatchStatus]:
    return dict(_STATUS)


def get_status(patch_id: str) -> PatchStatus | None:
    return _STATUS.get(patch_id)


def is_applied(patch_id: str) -> bool:
    st = _STATUS.get(patch_id)
    return st is not None and st.state == State.APPLIED
