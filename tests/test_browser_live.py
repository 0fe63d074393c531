"""What moves in JupyterLab: the status bar and its tooltip, and the sidebar's charts.

One ``jupyter lab`` on two simulated GPUs with the default idle timeouts (a lease stays
``active`` for minutes). A lazily bound notebook says "at first cell" only until it has held a
GPU: after ``%gpu release`` it says it holds none, and a cell then runs without a GPU as it says.
While it holds a GPU, the tooltip counts down to what idle reclaim will do, second by second,
with no news from the server. The sidebar draws each GPU's utilization and memory over the last
minutes and lists the processes on each GPU with their memory and lease, or none.

Screenshots go to ``docs/screenshots`` when ``GPUSCHED_UPDATE_SCREENSHOTS=1``.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys

import pytest

from jupyter_gpusched.devices import simulated
from browser_util import (  # noqa: F401 - fixtures shared by the browser test modules
    LabServer,
    browser_page,
    chromium,
    jp_asyncio_loop,
    jp_server_cleanup,
    new_gpu_notebook,
    open_lab,
    run_cell,
    shots,
    wait_for,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK, TRAIN = "status.ipynb", "train.ipynb"
GiB = 1024**3


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
    # The same lease, still active: the countdown moved with the clock.
    now = lab.lease_of(kernel)
    assert now["id"] == lease["id"] and now["state"] == "active", now


@contextlib.contextmanager
def _outside(lab, uuid: str):
    """A process that holds 3 GiB on GPU ``uuid`` with no lease: what a user started outside Jupyter."""
    state_file = lab.root / "gpusched-simulated.sqlite"  # beside the ledger, where the server keeps it
    assert state_file.exists(), sorted(p.name for p in lab.root.iterdir())
    env = dict(lab.env, CUDA_VISIBLE_DEVICES=uuid, **{simulated.STATE_ENV: str(state_file)})
    code = "from jupyter_gpusched.devices import simulated; import time; simulated.allocate('3GiB'); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _chart_title(panel, uuid: str) -> str:
    title = panel.locator(f'.jp-gpusched-Device[data-uuid="{uuid}"] .jp-gpusched-Chart').get_attribute("title")
    _chart_title.last = title
    return title


def _process_rows(panel, uuid: str) -> list[list[str]]:
    rows = panel.locator(f'.jp-gpusched-Device[data-uuid="{uuid}"] .jp-gpusched-Process')
    return [[c.strip() for c in row.locator("td").all_inner_texts()] for row in rows.all()]


def test_the_sidebar_charts_each_gpu_over_time_and_lists_its_processes(lab, page, kernel, shots):
    # train.ipynb computes on its GPU: 24 GiB, 85 % busy, then 30 %.
    train = new_gpu_notebook(page, lab, TRAIN)
    run_cell(page, "from jupyter_gpusched.devices import simulated\ng = simulated.allocate('24GiB')\nsimulated.set_utilization(85)\ng")
    _output(page, "'GPU-").last.wait_for(timeout=30_000)
    lease = wait_for(lambda: lab.lease_of(train), 15, "train.ipynb's lease")
    uuid = lease["devices"][0]
    other = next(d["uuid"] for d in lab.status()["devices"] if d["uuid"] != uuid)
    with _outside(lab, other) as proc:
        _charts_and_processes(lab, page, lease, uuid, other, proc, shots)


def _charts_and_processes(lab, page, lease, uuid, other, proc, shots):
    page.locator('li[data-id="jp-gpusched-panel"]').click()
    panel = page.locator("#jp-gpusched-panel")
    panel.wait_for(state="visible")
    wait_for(lambda: "Util 85% (peak 85%)" in _chart_title(panel, uuid), 20, "the chart to show 85 % now")

    run_cell(page, "simulated.set_utilization(30)")
    try:
        wait_for(lambda: "Util 30% (peak 85%)" in _chart_title(panel, uuid), 20, "the chart to show 30 % after 85 %")
    except AssertionError as err:
        raise AssertionError(f"{err}; it says {_chart_title.last!r}; the server: {lab.status()['devices']}") from None
    title = _chart_title(panel, uuid)
    assert "Mem 30% (peak 30%)" in title, title  # 24 of 80 GiB
    # Drawn: the utilization line steps from 85 % down to 30 % (y grows downwards, 40 px high).
    line = panel.locator(f'.jp-gpusched-Device[data-uuid="{uuid}"] polyline.jp-gpusched-Chart-utilization')
    heights = {float(p.split(",")[1]) for p in " ".join(line.evaluate_all("ls => ls.map(l => l.getAttribute('points'))")).split()}
    assert {6.0, 28.0} <= heights, heights

    # The processes on each GPU, with their memory and lease, as the server lists them.
    devices = {d["uuid"]: d for d in lab.status()["devices"]}
    kernel_pids = [p["pid"] for p in devices[uuid]["processes"] if p["lease_id"] == lease["id"]]
    assert kernel_pids, devices[uuid]
    wait_for(
        lambda: [str(kernel_pids[0]), "24.0 GiB", f"{TRAIN} · root"] in _process_rows(panel, uuid),
        15,
        "train.ipynb's process in the list",
    )
    wait_for(
        lambda: [str(proc.pid), "3.0 GiB", "no lease"] in _process_rows(panel, other),
        20,
        "the process outside any lease in the list",
    )
    row = panel.locator(f'.jp-gpusched-Process[data-pid="{proc.pid}"] .jp-gpusched-Process-lease')
    assert row.get_attribute("data-leased") == "false"

    # The picture: a few more readings at 30 %, then 65 % for a while.
    chart = panel.locator(f'.jp-gpusched-Device[data-uuid="{uuid}"] .jp-gpusched-Chart')

    def readings() -> int:
        return int(chart.get_attribute("data-samples"))

    def more(count: int) -> None:
        start = readings()
        wait_for(lambda: readings() >= start + count, count * 4 + 10, f"{count} more readings")

    more(5)
    run_cell(page, "simulated.set_utilization(65)")
    wait_for(lambda: "Util 65% (peak 85%)" in _chart_title(panel, uuid), 20, "the chart to show 65 %")
    more(5)
    box = panel.bounding_box()
    page.screenshot(
        path=str(shots / "sidebar-charts.png"),
        clip={"x": 0, "y": 0, "width": box["x"] + box["width"] + 4, "height": 900},
    )
