"""The JupyterLab extension's own unit tests (jest), run as part of the suite."""

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


def test_jest_suite_passes():
    lab = ROOT / "labextension"
    jlpm = _jlpm()
    env = {**os.environ, "CI": "true"}
    if not (lab / "node_modules").exists():
        install = subprocess.run([jlpm, "install"], cwd=lab, capture_output=True, text=True, timeout=600, env=env)
        assert install.returncode == 0, install.stdout + install.stderr
    done = subprocess.run([jlpm, "test", "--ci"], cwd=lab, capture_output=True, text=True, timeout=600, env=env)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "Tests:" in report and "failed" not in report.split("Tests:")[1].splitlines()[0], report
