"""The e2e harness itself: which llama-server each test runs against, and a plain install.

The reference build (the pinned llama.cpp the simulator and the fixtures follow) must be the
one that simulator comparisons use on every CPU; another build that runs on the machine (the
prebuilt skulk binary where the CPU has AVX-512) runs the relay's own promises as a second
parameter. The candidate order is forced here with made-up machines, so both CPU kinds are
shown whatever this one is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.llama_server import plan_builds

ROOT = Path(__file__).resolve().parents[2]  # the repository
PINNED = Path("/cache/llama-server/bin/llama-server")
SKULK = Path("/site/skulk/bin/llama-server")
AVX512 = {"sse4_2", "avx2", "avx512f", "avx512bw"}
AVX2 = {"sse4_2", "avx2"}


def names(builds) -> list[tuple[str, Path | None]]:
    return [(b.name, b.binary) for b in builds]


def test_avx512_machine_reference_is_the_pinned_build_and_skulk_runs_second():
    got = plan_builds(None, PINNED, SKULK, AVX512, None)
    assert names(got) == [("pinned", PINNED), ("skulk", SKULK)]


def test_avx2_machine_runs_the_pinned_build_only():
    assert names(plan_builds(None, PINNED, SKULK, AVX2, None)) == [("pinned", PINNED)]


def test_reference_missing_is_not_replaced_by_another_version():
    # with no pinned build, the skulk binary must not become the reference
    got = plan_builds(None, None, SKULK, AVX512, None)
    assert names(got) == [("pinned", None), ("skulk", SKULK)]


def test_explicit_binary_is_the_reference_and_extras_follow_without_duplicates():
    extra = os.pathsep.join([str(SKULK), "/opt/other/llama-server", str(PINNED)])
    got = plan_builds("/opt/mine/llama-server", PINNED, SKULK, AVX512, extra)
    assert names(got) == [
        ("pinned", Path("/opt/mine/llama-server")),
        ("skulk", SKULK),
        ("extra2", Path("/opt/other/llama-server")),
        ("extra3", PINNED),
    ]


def _pytest_e2e_without_numpy(ci: str | None) -> subprocess.CompletedProcess:
    """pytest on tests/e2e in a process where numpy and gguf cannot be imported."""
    code = (
        "import sys; sys.modules['numpy'] = None; sys.modules['gguf'] = None\n"
        "import pytest\n"
        "sys.exit(pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', 'tests/e2e',\n"
        "                      '-k', 'test_health_keeps_connection_open or "
        "test_sim_matches_real_structurally']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_plain_install_skips_e2e_with_the_extra_named():
    run = _pytest_e2e_without_numpy(None)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "error" not in out.lower().split("short test summary")[0][-200:], out[-3000:]
    assert " skipped" in out and "passed" not in out, out[-3000:]
    assert "pip install -e '.[test,e2e]'" in out and "missing numpy, gguf" in out, out[-3000:]


def test_ci_fails_instead_of_skipping_when_the_e2e_extra_is_missing():
    run = _pytest_e2e_without_numpy("true")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert "CI=true and the real llama-server could not start" in out, out[-3000:]
    assert "skipped" not in out, out[-3000:]
