"""Every check fails when it should, every command names the layers it read, settings have one
home and one policy, Ctrl-C stops a build, progress suits its reader. Through CliRunner (with
settings.scope for settings) or a subprocess; builds use the stub compiler."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from stub_store import (
    ROOT,
    artifact_dirs,
    build_stub,
    cli,
    popen_cli,
    reseal,
    stub_env,
    write_spec,
)

from fa4aot import settings
from fa4aot.cli import main
from fa4aot.errors import SettingError

TINY = (Path(__file__).parents[1] / "specs" / "tiny.toml").read_text()


@pytest.fixture
def spec_file(tmp_path) -> Path:
    return write_spec(tmp_path, TINY)


def _real(store) -> list[Path]:
    """Make a stub store's records look like real kernels' (sealed again): coverage, explain
    and the runtime skip stubs, and these tests are about checksums."""
    dirs = artifact_dirs(store)
    for d in dirs:
        reseal(d, stub=False)
    return dirs


def _flip(art_dir: Path) -> None:
    so = art_dir / "fwd.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 1
    so.write_bytes(bytes(data))


@pytest.fixture
def real_store(tmp_path, spec_file, monkeypatch):
    root = tmp_path / "store"
    with settings.scope(stub_compiler="1", stub_delay="0"):
        store, _ = build_stub(root, spec_file, monkeypatch)
    return root, store, _real(store)


# -- A. every check fails when it should -----------------------------------------------------


def test_verify_refuses_a_missing_or_unreadable_root(run, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a store")
    for root, why in ((tmp_path / "typo", "no such directory"), (a_file, "not a directory")):
        r = run("verify", "--cache", str(root))
        assert r.exit_code == 1 and r.stdout == ""
        assert r.stderr == f"error: store layer {root}: {why} (--cache)\n"
        r = run("doctor", "--cache", str(root), "--json")
        assert r.exit_code == 1
        assert f"store layer {root}: {why} (--cache)" in json.loads(r.stdout)["problems"]
        r = run("coverage", "--cache", str(root), "--spec", "llama-3.1-8b", "--no-trace")
        assert r.exit_code == 1 and r.stderr == f"error: store layer {root}: {why} (--cache)\n"
    r = run("verify")  # the default layer does not exist: nothing was verified
    assert r.exit_code == 1 and "no store layer to verify" in r.stderr


def test_a_flipped_byte_fails_doctor_coverage_and_explain(run, real_store, spec_file):
    root, store, dirs = real_store
    assert run("coverage", "--cache", str(root), "--spec", str(spec_file), "--no-trace").exit_code == 0
    r = run("doctor", "--cache", str(root), "--json")
    assert not [p for p in json.loads(r.stdout)["problems"] if "corrupt" in p]
    bad = dirs[0]
    _flip(bad)

    r = run("doctor", "--cache", str(root), "--json")
    assert r.exit_code == 1
    problems = [p for p in json.loads(r.stdout)["problems"] if "corrupt artifact" in p]
    assert len(problems) == 1 and bad.name in problems[0] and "sha256" in problems[0]
    assert "no problems found" not in run("doctor", "--cache", str(root)).stdout

    r = run("coverage", "--cache", str(root), "--spec", str(spec_file), "--no-trace", "--json")
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["counts"]["corrupt"] == 1 and doc["counts"]["hit"] == len(dirs) - 1
    (row,) = [row for row in doc["rows"] if row["id"] == bad.name]
    assert row["status"] == "missing" and row["detail"].startswith("corrupt: ")

    rec = json.loads((bad / "record.json").read_text())
    call = rec["representative_call"]
    args = ["--heads", f"{call['num_heads']}:{call['num_heads_kv']}"]
    args += ["--head-dim", str(call["head_dim"]), "--cache", str(root), "--json"]
    args += ["--lse"] if call["return_lse"] else []
    doc = json.loads(run("explain", *args).stdout)
    assert doc["id"] == bad.name and doc["corrupt"] and "sha256" in doc["corrupt"]
    assert not any(c["exact"] for c in doc["choices"])  # never served by the corrupt copy


def test_coverage_names_the_stores_that_exist_for_another_python(run, real_store, spec_file):
    root, store, _ = real_store
    other = "3.12" if sys.version_info[:2] != (3, 12) else "3.11"
    r = run("coverage", "--cache", str(root), "--spec", str(spec_file), "--python", other)
    assert r.exit_code == 1 and r.stdout == ""
    msg = r.stderr
    assert msg.startswith(f"error: no store for sm90 with 132 SMs, python {other}")
    assert str(store.dir) in msg and f"python {store.toolchain['python']}" in msg
    assert f"fa4aot build --arch sm90 --num-sms 132 --python {other}" in msg
    r = run("coverage", "--cache", str(root), "--spec", str(spec_file), "--num-sms", "100")
    assert r.exit_code == 1 and str(store.dir) in r.stderr


def test_unsupported_layers_fail_coverage_unless_accepted(run, tmp_path, monkeypatch):
    from fa4aot.model.specs import resolve_specs

    root = tmp_path / "gemma"
    gemma = tmp_path / "gemma-4.toml"
    gemma.write_text((ROOT / "fa4aot" / "specs" / "gemma-4.toml").read_text())
    assert resolve_specs(["gemma-4"])
    with settings.scope(stub_compiler="1", stub_delay="0"):
        store, _ = build_stub(root, gemma, monkeypatch)
    _real(store)
    args = ["coverage", "--cache", str(root), "--spec", "gemma-4", "--no-trace", "--json"]
    r = run(*args)
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["counts"]["unsupported"] >= 1 and doc["counts"]["missing"] == 0
    text = run(*args[:-1]).stdout
    assert "unsupported layers fail the check" in text and "--allow-unsupported" in text
    r = run(*args, "--allow-unsupported")
    assert r.exit_code == 0 and json.loads(r.stdout)["counts"]["unsupported"] >= 1


@pytest.mark.parametrize(
    "attr, value, variable, allowed",
    [
        ("padding", "maybe", "FA4AOT_PADDING", "allow or deny"),
        ("on_miss", "bogus", "FA4AOT_ON_MISS", "error, warn or jit"),
        ("decode_fold", "yes", "FA4AOT_DECODE_FOLD", "0 or 1"),
        ("cache_dir", "::", "FA4AOT_CACHE_DIR", "':'-separated directories"),
        ("split_kv", "-2", "FA4AOT_SPLIT_KV", "auto, 0 or a positive integer"),
    ],
)
def test_invalid_settings_fail_verify_coverage_and_doctor(
    run, real_store, spec_file, attr, value, variable, allowed
):
    root, _, _ = real_store
    line = f"{variable}={value!r} is invalid: expected {allowed}"
    with settings.scope(**{attr: value}):
        with pytest.raises(SettingError, match="^" + line.replace("(", r"\(").replace(")", r"\)")):
            settings.check()
        for cmd in (
            ["verify", "--cache", str(root)],
            ["coverage", "--cache", str(root), "--spec", str(spec_file), "--no-trace"],
        ):
            r = CliRunner().invoke(main, cmd)
            assert r.exit_code == 1 and r.stderr == f"error: {line}\n", cmd
        r = CliRunner().invoke(main, ["doctor", "--cache", str(root), "--json"])
        doc = json.loads(r.stdout)
        assert r.exit_code == 1 and line in doc["problems"]
        (row,) = [s for s in doc["settings"] if s["variable"] == variable]
        assert row["error"] == line and row["source"] == "scope"


def test_coverage_trace_falls_back_without_the_compiler(run, real_store, spec_file, monkeypatch):
    root, _, dirs = real_store
    monkeypatch.setitem(sys.modules, "cutlass", None)  # as in a serving image: no compiler
    r = run("coverage", "--cache", str(root), "--spec", str(spec_file), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["trace"].startswith("skipped: cutlass is not installed")
    assert doc["counts"]["hit"] == len(dirs)
    warns = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: --trace skipped")]
    assert len(warns) == 1 and "ModuleNotFoundError" not in r.stderr


# -- B. one layer resolution, named ----------------------------------------------------------


def test_ls_and_inspect_see_installed_cache_wheels(run, real_store, monkeypatch, tmp_path):
    import fa4aot.store.layers as S

    root, store, dirs = real_store
    monkeypatch.setattr(S, "entry_point_stores", lambda: [("sm90", root)])
    r = run("ls", "--json")  # FA4AOT_CACHE_DIR's layer is absent; the wheel's store is listed
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert sorted(row["id"] for row in doc["rows"]) == sorted(d.name for d in dirs)
    assert [(lay["root"], lay["source"]) for lay in doc["layers"]] == [
        (str(tmp_path / "default"), "FA4AOT_CACHE_DIR"),
        (str(root), "cache wheel sm90"),
    ]
    r = run("inspect", dirs[0].name[:8])
    assert r.exit_code == 0 and json.loads(r.stdout)["layer"] == str(root)
    assert "cache wheel sm90" in r.stderr  # named for humans too


def test_every_command_reads_cache_as_layers(run, real_store, tmp_path):
    root, store, dirs = real_store
    empty = tmp_path / "empty"
    empty.mkdir()
    layers = f"{empty}{os.pathsep}{root}"
    r = run("pack", str(tmp_path / "s.tar.gz"), "--cache", layers, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["store"] == store.dir.name and len(doc["rows"]) == len(dirs)
    assert [lay["root"] for lay in doc["layers"]] == [str(empty), str(root)]
    for cmd in (["ls"], ["verify"], ["inspect", dirs[0].name]):
        r = run(*cmd, "--cache", layers, "--json")
        assert r.exit_code == 0, (cmd, r.output)
        assert [lay["root"] for lay in json.loads(r.stdout)["layers"]] == [str(empty), str(root)]


def test_build_says_how_to_serve_what_it_built(run, tmp_path, spec_file):
    r = run("build", "--cache", str(tmp_path / "s"), "--spec", str(spec_file), "-j", "1")
    assert r.exit_code == 0, r.output
    last = r.stdout.splitlines()[-1]
    assert last == (
        f"serve it with: export FA4AOT_CACHE_DIR={tmp_path / 's'}{os.pathsep}{tmp_path / 'default'}"
    )
    r = run("build", "--spec", str(spec_file), "-j", "1", "--json")  # into the default layer
    assert json.loads(r.stdout)["serve"].startswith("the runtime reads it already: ")


# -- C. settings -----------------------------------------------------------------------------


def test_settings_are_typed_scoped_and_reported():
    from fa4aot.settings import Settings

    with settings.scope(split_kv=None, padding=None, lock_lease_s=None):
        assert settings.split_kv() == "auto" and settings.padding() == "allow"
        assert settings.lock_lease_s() == 60.0
    for raw, want in (("auto", "auto"), ("0", 0), ("4", 4)):
        with settings.scope(split_kv=raw):
            assert settings.split_kv() == want
    for raw in ("-1", "x", "1.5", "four"):
        with settings.scope(split_kv=raw), pytest.raises(SettingError, match="FA4AOT_SPLIT_KV"):
            settings.split_kv()
    with settings.scope(lock_lease_s="0.5"), pytest.raises(SettingError, match="seconds >= 1"):
        settings.lock_lease_s()
    with settings.scope(padding="deny"):
        with settings.scope(padding="allow"):
            assert settings.padding() == "allow"
        assert settings.padding() == "deny" and settings.settings.source("padding") == "scope"
    names = {r["variable"] for r in settings.settings.report()}
    assert names == {s.env for s in Settings.all()} and len(names) >= 18


def test_doctor_lists_every_setting_with_its_source(tmp_path):
    from fa4aot.settings import Settings

    env = stub_env(FA4AOT_CACHE_DIR=str(tmp_path), FA4AOT_PADDING="deny")
    r = cli("doctor", "--json", env=env)
    rows = {s["variable"]: s for s in json.loads(r.stdout)["settings"]}
    assert set(rows) == {s.env for s in Settings.all()}
    assert (rows["FA4AOT_PADDING"]["value"], rows["FA4AOT_PADDING"]["source"]) == ("deny", "env")
    assert (rows["FA4AOT_ON_MISS"]["value"], rows["FA4AOT_ON_MISS"]["source"]) == (
        "error",
        "default",
    )
    text = cli("doctor", env=env).stdout
    assert "FA4AOT_PADDING" in text and "deny  [env]" in text and "[default]" in text


def test_an_invalid_install_mode_warns_once_per_process(tmp_path):
    code = "import fa4aot._autoinstall as a; a.activate(); a.activate()"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=stub_env(FA4AOT_INSTALL="bogus"),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0
    assert r.stderr == (
        "fa4aot: ignored: FA4AOT_INSTALL='bogus' is invalid: expected error, warn or jit\n"
    )


# -- D. Ctrl-C stops a build -----------------------------------------------------------------


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
            out |= {int(x) for x in text.split()}
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_for(cond, what: str, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("jobs", ["1", "2"])  # -j 1 compiles in the parent itself
def test_ctrl_c_stops_the_workers_and_exits_130(tmp_path, jobs):
    spec = write_spec(tmp_path)  # 8 variants
    root = tmp_path / "store"
    env = stub_env(FA4AOT_STUB_DELAY="4")  # each fake compile takes seconds: stopped midway
    # SIGINT as a terminal's Ctrl-C delivers it (a test runner started in the background may
    # have it ignored, and a child inherits that)
    p = popen_cli(
        "build", "--cache", str(root), "--spec", str(spec), "-j", jobs, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        tmp_dirs = lambda: [d for d in root.glob("v1/*/tmp/*") if d.is_dir()]  # noqa: E731
        _wait_for(
            lambda: len(tmp_dirs()) >= int(jobs) or p.poll() is not None, "compiles to start"
        )
        assert p.poll() is None
        workers = _children(p.pid)
        assert len(workers) >= (int(jobs) if jobs != "1" else 0)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    # the layer it was writing (named when the build started), then one line for the interrupt
    assert err.splitlines() == [f"write: {root} (--cache)", err.splitlines()[-1]]
    assert err.splitlines()[-1].startswith("error: interrupted: ")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    _wait_for(lambda: not any(_alive(w) for w in workers), "the workers to be gone", 30)
    # nothing half-written: every published entry is whole; the rest builds on the next run
    (store_dir,) = root.glob("v1/*")
    published = list((store_dir / "artifacts").iterdir())
    assert len(published) < 8
    r = cli("verify", "--cache", str(root), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["ok"] == len(published), r.stdout
    r = cli("build", "--cache", str(root), "--spec", str(spec), "-j", "2", "--json")
    assert r.returncode == 0 and sum(json.loads(r.stdout)["counts"].values()) == 8


def test_sigterm_stops_the_workers_too(tmp_path):
    """`kill` (SIGTERM) of a parallel build: the workers ignore SIGINT, so before the build
    handled SIGTERM they outlived their parent and kept compiling as orphans."""
    spec = write_spec(tmp_path)
    root = tmp_path / "store"
    p = popen_cli("build", "--cache", str(root), "--spec", str(spec), "-j", "2",
                  env=stub_env(FA4AOT_STUB_DELAY="4"))
    try:
        tmp_dirs = lambda: [d for d in root.glob("v1/*/tmp/*") if d.is_dir()]  # noqa: E731
        _wait_for(lambda: len(tmp_dirs()) >= 2 or p.poll() is not None, "two compiles to start")
        workers = _children(p.pid)
        assert p.poll() is None and len(workers) >= 2
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130, err
    assert err.splitlines()[-1].startswith("error: interrupted: ")
    _wait_for(lambda: not any(_alive(w) for w in workers), "the workers to be gone", 30)


# -- E. progress -----------------------------------------------------------------------------


def test_progress_off_a_terminal_is_one_line_per_variant(tmp_path):
    spec = write_spec(tmp_path)
    env = stub_env(FA4AOT_PROGRESS="1", FA4AOT_STUB_DELAY="0")
    r = cli("build", "--cache", str(tmp_path / "s"), "--spec", str(spec), "-j", "1", env=env)
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("write: ") or lines[0].startswith("8 variants")
    opening = [ln for ln in lines if ln.startswith("8 variants (8 to build, 0 cached) with 1 jobs")]
    assert len(opening) == 1 and str(tmp_path / "s") in opening[0]
    done = [ln for ln in lines if ln.startswith("[")]
    assert [ln.split("]")[0] for ln in done] == [f"[{i}/8" for i in range(1, 9)]


def test_progress_on_a_terminal_rewrites_one_line_with_an_eta(capsys):
    from types import SimpleNamespace

    from fa4aot.cli.build import Progress

    p = Progress(enabled=True, tty=True, jobs=4)
    p.start(SimpleNamespace(dir=Path("/s/v1/x")), 3, 3)
    for i in (1, 2, 3):
        p(i, 3, SimpleNamespace(status="built", description=f"v{i}", seconds=1.0))
    p.close()
    err = capsys.readouterr().err
    assert err.startswith("3 variants (3 to build, 0 cached) with 4 jobs -> /s/v1/x\n")
    rest = err.split("\n", 1)[1]
    assert rest.count("\r") == 3 and " eta " in rest and rest.endswith("\n")
    assert rest.count("\n") == 1  # one line on screen, ended once at the end


# -- F. small ----------------------------------------------------------------------------------


def test_python_dash_m_fa4aot():
    r = subprocess.run(
        [sys.executable, "-m", "fa4aot", "--version"],
        env=stub_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and "0.1.0" in r.stdout and r.stdout.startswith("fa4aot")


def test_specs_status_reflects_the_store(run, real_store, spec_file):
    root, _, dirs = real_store
    r = run("specs", "--spec", str(spec_file), "--cache", str(root), "--json")
    assert {row["status"] for row in json.loads(r.stdout)["rows"]} == {"built"}
    _flip(dirs[0])
    rows = json.loads(run("specs", "--spec", str(spec_file), "--cache", str(root), "--json").stdout)
    status = {row["id"]: row["status"] for row in rows["rows"]}
    assert status.pop(dirs[0].name) == "missing" and set(status.values()) == {"built"}


def test_build_refuses_another_spec_of_the_same_name(run, tmp_path, spec_file):
    cache = str(tmp_path / "s")
    assert run("build", "--cache", cache, "--spec", str(spec_file), "-j", "1").exit_code == 0
    other = write_spec(tmp_path, TINY.replace("head_dim = 64", "head_dim = 128"), "other.toml")
    r = run("build", "--cache", cache, "--spec", str(other), "-j", "1")
    assert r.exit_code == 1 and "already records a different spec named 'tiny'" in r.stderr
    assert "--replace-spec" in r.stderr
    r = run("build", "--cache", cache, "--spec", str(other), "-j", "1", "--replace-spec", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["counts"]["built"] == 2


def test_errors_under_json_are_json(run, tmp_path):
    r = run("verify", "--cache", str(tmp_path / "typo"), "--json")
    assert r.exit_code == 1 and r.stderr == ""
    doc = json.loads(r.stdout)
    assert doc == {"error": f"store layer {tmp_path / 'typo'}: no such directory (--cache)", "exit": 1}
    r = run("build", "--python", "three", "--dry-run", "--json")  # a usage error: exit 2
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["exit"] == 2 and "MAJOR.MINOR" in doc["error"]
    r = run("inspect", "zzzz", "--cache", str(tmp_path), "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["error"].startswith("no artifact 'zzzz'")
