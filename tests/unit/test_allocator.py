"""The daemon's allocator choice (``edge_rtgi.server.memory``): ``edge-rtgi serve`` re-executes
itself with jemalloc preloaded where it is installed, once, and says so; ``system`` keeps glibc."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from edge_rtgi.server.memory import (
    ALLOCATOR_ENV,
    JEMALLOC_CONF,
    choose_allocator,
    find_jemalloc,
    jemalloc_loaded,
)

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def test_auto_preloads_jemalloc_once():
    choice = choose_allocator({"PATH": "/bin"}, loaded=False, jemalloc=LIB)
    assert choice.reexec_env is not None
    assert choice.reexec_env["LD_PRELOAD"] == LIB
    assert choice.reexec_env["MALLOC_CONF"] == JEMALLOC_CONF
    assert choice.reexec_env["PATH"] == "/bin"
    # the re-executed process does not go round again, whether the preload took or not
    assert choose_allocator(choice.reexec_env, loaded=True, jemalloc=LIB).reexec_env is None
    failed = choose_allocator(choice.reexec_env, loaded=False, jemalloc=LIB)
    assert failed.reexec_env is None and "did not load" in failed.reason


def test_existing_preloads_and_malloc_conf_are_kept():
    env = {"LD_PRELOAD": "/opt/libfoo.so", "MALLOC_CONF": "narenas:2"}
    choice = choose_allocator(env, loaded=False, jemalloc=LIB)
    assert choice.reexec_env is not None
    assert choice.reexec_env["LD_PRELOAD"] == f"{LIB}:/opt/libfoo.so"
    assert choice.reexec_env["MALLOC_CONF"] == "narenas:2"


def test_system_and_missing_library_run_on_glibc():
    assert choose_allocator({ALLOCATOR_ENV: "system"}, loaded=False, jemalloc=LIB).reexec_env is None
    missing = choose_allocator({}, loaded=False, jemalloc=None)
    assert missing.reexec_env is None and "libjemalloc2" in missing.reason


@pytest.mark.parametrize(
    ("setting", "jemalloc", "message"),
    [("tcmalloc", LIB, "auto, jemalloc or system"), ("jemalloc", None, "libjemalloc2")],
)
def test_bad_settings_are_refused(setting, jemalloc, message):
    with pytest.raises(ValueError, match=message):
        choose_allocator({ALLOCATOR_ENV: setting}, loaded=False, jemalloc=jemalloc)


def test_jemalloc_loaded_reads_the_maps():
    assert jemalloc_loaded(f"7f00-7f01 r-xp 0 fe:00 1 {LIB}\n")
    assert not jemalloc_loaded("7f00-7f01 r-xp 0 fe:00 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")


@pytest.mark.skipif(find_jemalloc() is None, reason="no jemalloc (apt-get install libjemalloc2)")
@pytest.mark.parametrize("setting", ["auto", "system"])
def test_reexec_runs_the_module_again_on_jemalloc(tmp_path, setting):
    # A module that does what `edge-rtgi serve` does first: re-exec, then report.
    (tmp_path / "reexec_probe.py").write_text(
        textwrap.dedent(
            """
            import os
            from edge_rtgi.server.memory import jemalloc_loaded, reexec_with_jemalloc
            print("before", os.getpid(), flush=True)
            reason = reexec_with_jemalloc(["reexec_probe"])
            print("after", os.getpid(), jemalloc_loaded(), reason, flush=True)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()]), ALLOCATOR_ENV: setting}
    env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, "-m", "reexec_probe"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=True)
    out = run.stdout.split("\n")
    befores = [line for line in out if line.startswith("before")]
    afters = [line.split() for line in out if line.startswith("after")]
    assert len(afters) == 1
    if setting == "auto":
        pids = {line.split()[1] for line in befores} | {afters[0][1]}
        assert len(befores) == 2 and len(pids) == 1  # execve: the same process, run again
        assert afters[0][2] == "True" and afters[0][3] == "jemalloc"
    else:
        assert len(befores) == 1 and afters[0][2] == "False" and "system" in " ".join(afters[0])
