"""The JupyterLab extension's own checks, run as part of the suite: jest units, eslint and prettier."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def _jlpm() -> str:
    beside = Path(sys.executable).parent / "jlpm"
    found = str(beside) if beside.exists() else shutil.which("jlpm")
    if not found:
        pytest.fail("jlpm (from jupyterlab) is needed to run the frontend tests; pip install jupyterlab")
    return found


LAB = ROOT / "labextension"


def _ready_jlpm() -> tuple[str, dict[str, str]]:
    """jlpm and its environment, with the extension's node_modules installed."""
    jlpm = _jlpm()
    # The package scripts call `jlpm` by name: it must be on PATH also where the venv is not active.
    path = os.pathsep.join([str(Path(jlpm).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "CI": "true", "PATH": path, "FORCE_COLOR": "0"}
    tools = LAB / "node_modules" / ".bin"
    if not all((tools / tool).exists() for tool in ("jest", "eslint", "prettier")):
        install = subprocess.run([jlpm, "install"], cwd=LAB, capture_output=True, text=True, timeout=600, env=env)
        assert install.returncode == 0, install.stdout + install.stderr
    return jlpm, env


def test_jest_suite_passes():
    jlpm, env = _ready_jlpm()
    done = subprocess.run([jlpm, "test", "--ci"], cwd=LAB, capture_output=True, text=True, timeout=600, env=env)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "Tests:" in report and "failed" not in report.split("Tests:")[1].splitlines()[0], report


def test_sources_pass_prettier_and_eslint():
    """`jlpm run lint:check`: prettier's formatting, then eslint (the template's rules, `--fix` fixes most)."""
    jlpm, env = _ready_jlpm()
    done = subprocess.run(
        [jlpm, "run", "lint:check"], cwd=LAB, capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, (
        "the lab extension's sources fail the lint (run `jlpm run lint` in labextension/ to fix "
        "the formatting):\n" + done.stdout + done.stderr
    )
