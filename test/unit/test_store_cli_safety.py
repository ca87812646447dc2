"""`sglang-l3 store`: nothing destructive by accident (issue 15) and every
subcommand refuses exactly what the server refuses (issue 17). The concrete
checks run the real console entry (`python -m sglang_l3.cli`) with standard
input that is not a terminal, as a script or CI would."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import subprocess
import sys

import pytest
from sglang_l3.storage import doctor
from sglang_l3.storage.config import SIZE_EXAMPLES, StoreSettings
from sglang_l3.storage.identity import ModelIdentity, PoolLayout, Shard
from sglang_l3.storage.safety import UnsafeStoreError
from sglang_l3.storage.store import PageStore, WriteItem

PAYLOAD = 8192
N = 12
SUBCOMMANDS = {
    "stats": ["stats"],
    "ls": ["ls"],
    "verify": ["verify"],
    "evict": ["evict", "--to", "0", "--yes"],
    "clear": ["clear", "--yes"],
}


def _store(root, n=N, model="org/model"):
    st = PageStore(
        StoreSettings(root=root, min_free="0"),
        ModelIdentity(model=model),
        Shard(),
        sweep_strays=False,
    )
    spec = st.pool_spec(PoolLayout("kv", "raw", 1, (("uint8", (PAYLOAD,)),), PAYLOAD))
    items = [
        WriteItem(
            hashlib.sha256(f"{model}{i}".encode()).hexdigest(),
            spec,
            [memoryview(bytearray(os.urandom(PAYLOAD)))],
        )
        for i in range(n)
    ]
    assert all(st.write(items))
    for i, it in enumerate(items):  # deterministic recency
        os.utime(st.path_of(it.key, spec), (1000 + i, 1000 + i))
    st.close()
    return st


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "store"
    _store(root)
    return root


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def cli(*argv, stdin=subprocess.DEVNULL):
    r = subprocess.run(
        [sys.executable, "-m", "sglang_l3.cli", "store", *map(str, argv)],
        stdin=stdin,
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    return r.returncode, r.stdout, r.stderr


def pages(root):
    return sorted(os.listdir(root / "pages"))


@pytest.mark.parametrize("value", ["", "0.5", "-5G", "5X", "1.5", "abc", "5%%", "-1"])
def test_evict_bad_size_exits_2_and_removes_nothing(store, value):
    before = pages(store)
    rc, out, err = cli("--dir", store, "evict", "--to", value)
    assert rc == 2, (out, err)
    assert "--to" in err and "Traceback" not in err
    assert pages(store) == before
    rc, _, err = cli("--dir", store, "evict", f"--to={value}", "--yes")
    assert rc == 2 and pages(store) == before


def test_every_size_example_in_the_help_works(store):
    rc, out, _ = cli("evict", "--help")
    assert rc == 0
    examples = [e.strip() for e in SIZE_EXAMPLES.split(",")]
    assert all(e in " ".join(out.split()) for e in examples)
    for e in examples + ["5%", "1kib", "180Gi", "1KiB", "20gb"]:
        for form in (["--to", e], [f"--to={e}"]):
            rc, out, err = cli("--dir", store, "evict", *form, "--dry-run")
            assert rc == 0, (e, err)
            assert "dry run" in out
    assert len(pages(store)) == N


def test_clear_without_terminal_needs_yes(store):
    rc, _, err = cli("--dir", store, "clear")
    assert rc != 0 and "--yes" in err
    assert len(pages(store)) == N
    rc, _, err = cli("--dir", store, "clear", "--yes")
    assert rc == 0, err
    assert pages(store) == []


def test_evict_of_more_than_half_needs_yes(store):
    one = PAYLOAD + 4096
    rc, _, err = cli("--dir", store, "evict", "--to", str(3 * one))  # would remove 9 of 12
    assert rc == 3 and "--yes" in err and len(pages(store)) == N
    rc, _, _ = cli("--dir", store, "evict", "--to", str(8 * one))  # 4 of 12: no question
    assert rc == 0 and len(pages(store)) == 8
    rc, _, _ = cli("--dir", store, "evict", "--to", "0", "--yes")
    assert rc == 0 and pages(store) == []


def _on_terminal(argv, answer):
    """Run the CLI with a pseudo-terminal as stdin and `answer` typed ahead."""
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "sglang_l3.cli", "store", *map(str, argv)],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_env(),
            text=True,
        )
        os.write(master, answer.encode())  # queued in the terminal until the prompt reads it
        out, err = p.communicate(timeout=300)
    finally:
        os.close(slave)
        os.close(master)
    return p.returncode, out, err


def test_clear_on_a_terminal_asks(store):
    rc, _, err = _on_terminal(["--dir", store, "clear"], "n\n")
    assert rc == 3 and "Proceed? [y/N]" in err and len(pages(store)) == N
    rc, _, err = _on_terminal(["--dir", store, "evict", "--to", "0"], "\n")  # Enter = no
    assert rc == 3 and len(pages(store)) == N
    rc, _, err = _on_terminal(["--dir", store, "clear"], "y\n")
    assert rc == 0 and pages(store) == []


@pytest.mark.parametrize("sub", ["stats", "ls", "verify", "evict", "clear"])
def test_options_after_the_subcommand(tmp_path, sub):
    a, b = tmp_path / "a", tmp_path / "b"
    _store(a)
    _store(b)
    extra = {
        "stats": ["--json"],
        "ls": ["--json"],
        "verify": ["--json"],
        "evict": ["--to", "0", "--dry-run"],
        "clear": ["--dry-run"],
    }[sub]
    rc1, out1, err1 = cli("--dir", a, sub, *extra)
    rc2, out2, err2 = cli(sub, *extra, "--dir", b)
    assert rc1 == rc2 == 0, (err1, err2)
    assert out2.replace(str(b), str(a)) == out1 or sub in ("stats", "verify")
    if sub == "stats":
        assert json.loads(out1)["pages"] == json.loads(out2)["pages"] == N
    if sub == "verify":
        assert json.loads(out1)["checked"] == json.loads(out2)["checked"] == N


@pytest.mark.parametrize("sub", sorted(SUBCOMMANDS))
def test_no_store_is_an_error_with_a_hint(tmp_path, sub):
    rc, out, err = cli("--dir", tmp_path / "missing", *SUBCOMMANDS[sub])
    assert rc == 1 and "no store" in err and "--dir" in err and out == ""
    f = tmp_path / "file"
    f.write_text("x")
    rc, out, err = cli("--dir", f, *SUBCOMMANDS[sub])
    assert rc == 2 and "not a directory" in err and "regular file" in err and out == ""
    assert f.read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = cli(*SUBCOMMANDS[sub], "--dir", empty)
    assert rc == 1 and "no store" in err and out == ""


def _unsafe(kind, root, tmp_path):
    if kind == "root-0777":
        os.chmod(root, 0o777)
    elif kind == "pages-0770":
        os.chmod(root / "pages", 0o770)
    elif kind == "quarantine-0777":
        os.chmod(root / "quarantine", 0o777)
    elif kind == "later-table-0777":  # a table directory added by a later feature
        (root / "sessions").mkdir(mode=0o700)
        os.chmod(root / "sessions", 0o777)
    elif kind == "tmp-link":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        os.rmdir(root / "tmp")
        os.symlink(elsewhere, root / "tmp")
    elif kind in ("pages-foreign", "quarantine-foreign"):
        if os.geteuid() != 0:
            pytest.skip("needs root to hand a directory to another user")
        os.chown(root / kind.split("-")[0], 65534, 65534)


UNSAFE = [
    "root-0777",
    "pages-0770",
    "quarantine-0777",
    "later-table-0777",
    "tmp-link",
    "pages-foreign",
    "quarantine-foreign",
]


@pytest.mark.parametrize("kind", UNSAFE)
def test_every_subcommand_refuses_what_the_server_refuses(tmp_path, kind):
    root = tmp_path / "store"
    _store(root)
    _unsafe(kind, root, tmp_path)
    before = pages(root)
    with pytest.raises(UnsafeStoreError):  # the server's verdict
        PageStore(
            StoreSettings(root=root, min_free="0"),
            ModelIdentity(model="org/model"),
            Shard(),
            sweep_strays=False,
        )
    for sub, argv in SUBCOMMANDS.items():
        rc, out, err = cli("--dir", root, *argv)
        assert rc == 2, (sub, out, err)
        assert out == "", f"{sub} printed data from a store it refuses: {out!r}"
        assert "Fix" in err and "refusing" not in err.split(":")[0], (sub, err)
        assert pages(root) == before, f"{sub} removed pages from a store the server refuses"


def test_ls_header_count_limit_and_no_match(store):
    rc, out, _ = cli("--dir", store, "ls", "--limit", "5")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split()[:3] == ["modified", "size", "pool"]
    assert len(lines) == 1 + 5 + 1 and lines[-1].startswith(f"5 of {N} pages shown")
    rc, out, _ = cli("--dir", store, "ls", "--limit", "0")
    assert rc == 0 and len(out.splitlines()) == 1 + N + 1 and out.splitlines()[-1] == f"{N} pages"
    rc, out, err = cli("--dir", store, "ls", "--model", "nosuch")
    assert rc == 1 and "no model matches 'nosuch'" in err and "org/model" in err and out == ""
    rc, _, err = cli("--dir", store, "ls", "--limit", "-5")
    assert rc == 2 and "--limit" in err


def test_verify_progress_line_leaves_no_garbage(store):
    r = subprocess.run(
        [sys.executable, "-m", "sglang_l3.cli", "store", "--dir", str(store), "verify"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        env=_env(),
        timeout=300,
        check=False,
    )
    assert r.returncode == 0 and f"verified {N} pages" in r.stdout.decode()
    err = r.stderr.decode()  # bytes: text mode would turn each \r into a newline
    updates = err.split("\r")[1:]
    assert updates and all(u.rstrip("\n").endswith("\x1b[K") for u in updates)
    assert err.endswith("\n") and "100.0%" in updates[-1]


@pytest.mark.parametrize("how", [["evict", "--to", "100G"], ["clear", "--yes"], ["verify", "--repair"]])
def test_dead_writers_tmp_files_removed_live_ones_kept(tmp_path, how):
    root = tmp_path / "store"
    _store(root)
    live_store = PageStore(
        StoreSettings(root=root, min_free="0"),
        ModelIdentity(model="org/model"),
        Shard(),
        sweep_strays=False,
    )  # this process is a live writer (holds its writer lock)
    live = root / "tmp" / f"{os.getpid()}-live.tmp"
    live.write_bytes(b"in flight")
    dead = root / "tmp" / "999999999-dead.tmp"
    dead.write_bytes(b"left behind")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, root / "tmp" / "999999998-link.tmp")
    rc, _, err = cli("--dir", root, *how)
    assert rc == 0, err
    assert live.exists() and not dead.exists() and not os.path.lexists(root / "tmp" / "999999998-link.tmp")
    assert victim.read_bytes() == b"keep"
    live_store.close()


def test_stats_says_how_to_remove_leftovers(store):
    (store / "tmp" / "999999999-dead.tmp").write_bytes(b"x")
    rc, out, _ = cli("--dir", store, "stats")
    assert rc == 0 and "leftover tmp files 1" in out and "evict" in out


@pytest.mark.parametrize("bad", ["x\n", "a\rb", "a\0b", "", "é", "../..", "/", "a" * 200, "a b", "a/../b"])
def test_model_argument_validated(store, bad, capsys):
    from sglang_l3.storage import cli as store_cli

    for sub in (["ls"], ["clear", "--yes"]):
        if "\0" in bad:  # no process can receive a NUL in argv: call the entry point in-process
            with pytest.raises(SystemExit) as e:
                store_cli.main(["store", "--dir", str(store), *sub, "--model", bad])
            rc, (out, err) = e.value.code, capsys.readouterr()
        else:
            rc, out, err = cli("--dir", store, *sub, "--model", bad)
        assert rc == 2 and "--model" in err and out == "", (sub, bad, err)
    assert len(pages(store)) == N


def test_doctor_on_a_file_does_not_contradict_itself(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    r = doctor.report(str(f))
    assert not r["ok"] and r["data"]["exists"] is True
    text = " ".join(r["lines"])
    assert "not a directory" in text and "created" not in text and "first start" not in text
    from sglang_l3 import doctor as top

    assert not top.check_store_dir(str(f)).ok


def test_doctor_does_not_list_a_store_it_refuses(store):
    os.chmod(store / "pages", 0o777)
    r = doctor.report(str(store))
    assert (
        not r["ok"]
        and "pages" not in r["data"]
        and any("UNSAFE" in line and "chmod 700" in line for line in r["lines"])
    )
