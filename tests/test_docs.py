"""The README shows what the tests run."""

from __future__ import annotations

from conftest import ROOT


def test_readme_hub_config_is_the_tested_file():
    readme = (ROOT / "README.md").read_text()
    config = (ROOT / "examples" / "jupyterhub_config.py").read_text().rstrip()
    assert f"```python\n{config}\n```" in readme


def test_readme_names_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    assert "scripts/demo.sh" in readme and "scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for shot in ("sidebar", "statusbar", "panel", "reclaim-warning"):
        assert f"docs/screenshots/{shot}.png" in readme
        assert (ROOT / "docs" / "screenshots" / f"{shot}.png").stat().st_size > 10_000
