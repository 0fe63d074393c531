"""Release builds: a wheel always carries a production build of the JupyterLab extension.

A checkout that ran the demo (``pip install -e .``) holds a development build of the lab
extension in ``jupyter_gpusched/labextension`` (unminified, with source maps and a build log).
A wheel built from that checkout must not ship it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow

LABEXT = "share/jupyter/labextensions/jupyter-gpusched/"


def _tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} (from jupyterlab) is needed to build the lab extension; pip install jupyterlab")
    return found


def _copy_checkout(dest: Path) -> None:
    """The files git knows of (tracked, and new ones not ignored), as a fresh clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def _env() -> dict[str, str]:
    # jlpm and jupyter-builder come from this environment, as they do for `pip install`.
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "CI": "true"}


def _run(cmd: list[str], cwd: Path, timeout: int) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env())
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def test_wheel_from_a_checkout_with_a_dev_build_ships_a_production_build(tmp_path):
    src = tmp_path / "checkout"
    _copy_checkout(src)
    lab = src / "labextension"
    modules = ROOT / "labextension" / "node_modules"
    if modules.is_dir():
        (lab / "node_modules").symlink_to(modules, target_is_directory=True)
    else:
        _run([_tool("jlpm"), "install"], lab, 600)

    # What the demo leaves behind: the development build of `pip install -e .`.
    _run([_tool("jlpm"), "build"], lab, 600)
    built = src / "jupyter_gpusched" / "labextension"
    assert (built / "build_log.json").exists(), "the development build writes a build log"
    assert list(built.glob("static/*.js.map")), "the development build writes source maps"

    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(src)], src, 900)
    wheel = next((tmp_path / "dist").glob("jupyter_gpusched-*.whl"))

    with zipfile.ZipFile(wheel) as zf:
        names = [name for name in zf.namelist() if LABEXT in name]
        static = {name: zf.read(name) for name in names if "/static/" in name and name.endswith(".js")}
    shipped = [name.split(LABEXT, 1)[1] for name in names]
    assert "package.json" in shipped and "static/style.js" in shipped, shipped
    assert not [n for n in shipped if n.endswith(".map")], f"source maps in the wheel: {shipped}"
    assert "build_log.json" not in shipped, f"the development build log is in the wheel: {shipped}"

    assert static, f"no JavaScript in the wheel: {shipped}"
    for name, data in static.items():
        text = data.decode("utf-8", errors="replace")
        assert not re.search(r"^//# sourceMappingURL=", text, re.M), f"{name} points at a source map"
        # A development build names its modules by path ("./lib/index.js"); production by number.
        assert '"./lib/' not in text, f"{name} is a development build"
    # Minified: the biggest bundle is a few very long lines, not thousands of short ones.
    name, data = max(static.items(), key=lambda kv: len(kv[1]))
    lines = data.count(b"\n") + 1
    assert len(data) / lines > 500, f"{name} is not minified ({lines} lines for {len(data)} bytes)"
