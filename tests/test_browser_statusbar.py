"""The status bar says what the server says of the notebook's lease, and its times move.

One ``jupyter lab`` on two simulated GPUs with the default idle timeouts (a lease stays
``active`` for minutes). A lazily bound notebook says "at first cell" only until it has held a
GPU: after ``%gpu release`` it says it holds none, and a cell then runs without a GPU as it says.
While it holds a GPU, the tooltip counts down to what idle reclaim will do, second by second,
with no news from the server.
"""

from __future__ import annotations

import re

import pytest

from browser_util import (  # noqa: F401 - fixtures shared by the browser test modules
    LabServer,
    browser_page,
    chromium,
    jp_asyncio_loop,
    jp_server_cleanup,
    new_gpu_notebook,
    open_lab,
    run_cell,
    wait_for,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = "status.ipynb"


@pytest.fixture(scope="module")
def lab(chromium, tmp_path_factory):
    server = LabServer(tmp_path_factory.mktemp("statusbar"), devices=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(chromium, lab):
    with browser_page(chromium) as page:
        open_lab(page, lab, "gpusched-statusbar")
        yield page


@pytest.fixture(scope="module")
def kernel(lab, page):
    return new_gpu_notebook(page, lab, NOTEBOOK)


def _item(page):
    return page.locator(".jp-gpusched-StatusItem-button")


def _output(page, has_text):
    return page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output", has_text=has_text)


def _acquire(page, lab, kernel) -> dict:
    run_cell(page, "%gpu acquire")
    _output(page, "This kernel holds GPU").last.wait_for(timeout=30_000)
    lease = wait_for(lambda: lab.lease_of(kernel), 15, "the notebook's lease")
    item = _item(page)
    wait_for(lambda: item.get_attribute("data-lease-id") == lease["id"], 15, "the status bar to show the lease")
    return lease


def test_after_release_the_status_bar_says_no_gpu_and_a_cell_runs_without_one(lab, page, kernel):
    item = _item(page)
    wait_for(lambda: item.get_attribute("data-kernel-id") == kernel, 15, "the status bar to follow the notebook")
    wait_for(lambda: item.inner_text() == "GPU: at first cell", 15, "'GPU: at first cell' before any cell")

    lease = _acquire(page, lab, kernel)
    index = lease["device_indices"][0]
    assert item.inner_text().startswith(f"GPU {index}: "), item.inner_text()

    run_cell(page, "%gpu release")
    _output(page, f"Released GPU {index}").last.wait_for(timeout=30_000)
    wait_for(lambda: lab.lease_of(kernel) is None, 15, "the server to drop the lease")
    # The kernel asks for no GPU by itself after a release: the status bar says so, not that
    # a GPU comes at the first cell.
    wait_for(lambda: item.inner_text() == "GPU: none", 15, "the status bar to say 'GPU: none'")
    assert item.get_attribute("data-state") == "none"
    title = item.get_attribute("title")
    assert f"gave its GPU {index} back" in title and "%gpu acquire" in title, title

    # And a cell runs with no GPU, as the status bar says.
    run_cell(page, "import os; print('visible:', repr(os.environ.get('CUDA_VISIBLE_DEVICES')))")
    _output(page, "visible:").last.wait_for(timeout=30_000)
    assert "visible: ''" in _output(page, "visible:").last.inner_text()
    assert lab.lease_of(kernel) is None
    assert item.inner_text() == "GPU: none"


def _tooltip_seconds(text: str) -> int:
    """Seconds of the idle forecast in the tooltip: ``... released in 59m 58s ...``."""
    m = re.search(r"If this kernel stays idle, .*? in (?:(\d+)h )?(\d+)m (\d\d)s", text)
    assert m, text
    hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return hours * 3600 + minutes * 60 + seconds


def test_the_tooltip_counts_down_while_the_server_says_nothing_new(lab, page, kernel):
    lease = _acquire(page, lab, kernel)
    item = _item(page)
    wait_for(lambda: "If this kernel stays idle" in item.get_attribute("title"), 15, "the tooltip's forecast")
    assert lab.lease_of(kernel)["state"] == "active"
    first = _tooltip_seconds(item.get_attribute("title"))
    # The server's forecast: the same time, within the few seconds this took.
    forecast = lab.lease_of(kernel)["idle_forecast"]
    assert forecast and forecast["at"], forecast
    assert 3000 < first <= 3600, first

    seen = [first]

    def moved() -> bool:
        seen.append(_tooltip_seconds(item.get_attribute("title")))
        return seen[-1] <= first - 3

    wait_for(moved, 15, "the tooltip's countdown to move on by 3 s")
    assert all(b <= a for a, b in zip(seen, seen[1:])), seen
    # Nothing changed on the server meanwhile: the same lease, still active.
    now = lab.lease_of(kernel)
    assert now["id"] == lease["id"] and now["state"] == "active" and now["idle_forecast"] == forecast, now
