"""JupyterLab with the extension, driven in headless Chromium as a user would drive it.

One ``jupyter lab`` on two simulated GPUs serves every test of this module; they run in order:
two notebooks take a GPU each with ``%gpu acquire``, the sidebar and the status bar show them,
``%gpu panel`` shows what the REST API says, and an idle notebook gets a reclaim warning that
"Keep" stops.

Screenshots are taken in every run; they go to ``docs/screenshots`` (the ones the README shows)
when ``GPUSCHED_UPDATE_SCREENSHOTS=1``, else to a temporary directory.
"""

from __future__ import annotations

import contextlib
import re
import time
from datetime import datetime

import pytest

from browser_util import (  # noqa: F401 - fixtures shared by the browser test modules
    KERNEL_NAME,
    chromium,
    jp_asyncio_loop,
    jp_server_cleanup,
    shots,
    LabServer,
    activate,
    browser_page,
    new_gpu_notebook,
    open_lab,
    run_cell,
    wait_for,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

GiB = 1024**3
GRACE = 15
TRAIN, EVAL = "train.ipynb", "eval.ipynb"
# Reclaims come quickly: a lease is idle after 3 s, yields 2 s after someone starts waiting, and
# a kernel that holds GPU memory (no checkpoint here) is restarted after a 15 s warning.
LAB_OPTIONS = (
    "--GPUSchedApp.idle_timeout=3",
    "--GPUSchedApp.contended_idle_timeout=2",
    f"--GPUSchedApp.grace_period={GRACE}",
    "--GPUSchedApp.checkpoint=off",
    "--GPUSchedApp.reclaim_fallback=restart",
)


def _fmt_bytes(size: float) -> str:
    """Sizes as people read them on the panel: ``12.0 GiB``, ``0 B``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def lab(chromium, tmp_path_factory):
    server = LabServer(tmp_path_factory.mktemp("lab"), extra=LAB_OPTIONS, devices=2)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(chromium, lab):
    with browser_page(chromium) as page:
        open_lab(page, lab, "gpusched-browser-test")
        yield page


@pytest.fixture(scope="module")
def notebooks(lab, page):
    """Two notebooks made from the launcher, each of which ran ``%gpu acquire``."""
    kernels = {}
    for name in (TRAIN, EVAL):
        kernels[name] = new_gpu_notebook(page, lab, name)
        run_cell(page, "%gpu acquire")
        page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output", has_text="holds GPU").wait_for()
    return kernels


def _show_sidebar(page, visible: bool) -> None:
    panel = page.locator("#jp-gpusched-panel")
    if panel.is_visible() != visible:
        page.locator('li[data-id="jp-gpusched-panel"]').click()
    panel.wait_for(state="visible" if visible else "hidden")


@pytest.fixture(scope="module")
def train_memory(lab, page, notebooks):
    """train.ipynb holds 12 GiB of (simulated) GPU memory and a variable ``x = 41``."""
    activate(page, TRAIN)
    run_cell(page, "from jupyter_gpusched.devices import simulated\nx = 41\nsimulated.allocate('12GiB')")
    _output(page, "'GPU-").last.wait_for()
    uuid = lab.lease_of(notebooks[TRAIN])["devices"][0]
    wait_for(
        lambda: next(d for d in lab.status()["devices"] if d["uuid"] == uuid)["memory_used"] == 12 * GiB,
        20,
        "the server to see the 12 GiB of train.ipynb",
    )
    return uuid


@contextlib.contextmanager
def _window_height(page, height: int):
    """Make the browser window ``height`` pixels tall (for a picture), then as it was."""
    page.set_viewport_size({"width": 1400, "height": height})
    try:
        wait_for(
            lambda: page.locator("#jp-main-statusbar").bounding_box()["y"] < height,
            10,
            "JupyterLab to fit the window",
        )
        yield
    finally:
        page.set_viewport_size({"width": 1400, "height": 900})


def _output(page, has_text: str):
    return page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output", has_text=has_text)


def _leases(lab, kernels) -> dict[str, dict]:
    return {name: lab.lease_of(kid) for name, kid in kernels.items()}


# -- two notebooks, two GPUs --------------------------------------------------------------------
def test_each_notebook_gets_its_own_gpu_through_the_magic(lab, page, notebooks):
    def both() -> dict | None:
        # A lease names its notebook from the server's sessions, which the scheduler reads again
        # at each tick: a notebook renamed just before its first claim is named by the next tick.
        leases = _leases(lab, notebooks)
        if not all(leases.values()) or any(lease["notebook"] != name for name, lease in leases.items()):
            return None
        return leases

    leases = wait_for(both, 30, "both leases")
    assert {lease["state"] for lease in leases.values()} <= {"active", "idle"}
    devices = {name: lease["devices"] for name, lease in leases.items()}
    assert len(devices[TRAIN]) == len(devices[EVAL]) == 1
    assert devices[TRAIN] != devices[EVAL], f"both notebooks were given {devices[TRAIN]}"
    for name, lease in leases.items():
        assert lease["notebook"] == name
        activate(page, name)
        # The magic's own output names the device the server granted.
        out = _output(page, "holds GPU").first.inner_text()
        assert f"GPU {lease['device_indices'][0]}" in out and lease["devices"][0] in out, out
    kernels = {k["id"]: k for k in lab.kernels()}
    assert all(kernels[kid]["name"] == KERNEL_NAME for kid in notebooks.values())


def test_sidebar_shows_both_leases_on_their_devices(lab, page, notebooks, shots):
    _show_sidebar(page, True)
    panel = page.locator("#jp-gpusched-panel")
    leases = _leases(lab, notebooks)
    for name, lease in leases.items():
        uuid, index = lease["devices"][0], lease["device_indices"][0]
        device = panel.locator(f'.jp-gpusched-Device[data-uuid="{uuid}"]')
        assert device.get_attribute("data-index") == str(index)
        holder = device.locator(f'.jp-gpusched-Holder[data-lease-id="{lease["id"]}"]')
        holder.wait_for()
        assert name in holder.inner_text()
        row = panel.locator(f'.jp-gpusched-Lease[data-lease-id="{lease["id"]}"]')
        assert row.get_attribute("data-kernel-id") == notebooks[name]
        assert row.locator(".jp-gpusched-Lease-label").inner_text() == name
        assert row.locator(".jp-gpusched-Lease-devices").inner_text() == f"GPU {index}"
    # Nobody else holds a GPU, and the panel says which GPUs are taken by whom, nothing more.
    assert panel.locator(".jp-gpusched-Lease").count() == 2
    assert panel.locator(".jp-gpusched-Holder").count() == 2

    # Recent usage: one row, this server's user, marked as the viewer, holding both GPUs now,
    # with the quota and GPU-hours the server reports.
    usage = panel.locator(".jp-gpusched-Usage")
    heading = usage.locator(".jp-gpusched-SectionTitle").text_content()
    assert heading.startswith("Recent usage (half-life 1 day)"), heading
    status = lab.status()
    assert status["config"]["usage_half_life"] == 86400
    user = status["user"]
    row = usage.locator(".jp-gpusched-UsageRow")
    wait_for(lambda: row.count() == 1 and _usage_cells(row.first)[3] == "2", 10, "the usage row to hold 2 GPUs")
    (entry,) = [u for u in lab.status()["usage"] if u["user"] == user]
    cells = _usage_cells(row.first)
    assert cells[0] == f"{user} (you)" and row.first.get_attribute("data-own") == "true", cells
    assert cells[2] == _amount(entry["quota"]) and cells[3] == _amount(entry["held"]) == "2", (cells, entry)
    assert re.fullmatch(r"<0\.1|\d+(\.\d)?", cells[1]), cells
    box = panel.bounding_box()
    page.screenshot(
        path=str(shots / "sidebar.png"),
        clip={"x": 0, "y": 0, "width": min(1400, box["x"] + box["width"] + 620), "height": 900},
    )


def _usage_cells(row) -> list[str]:
    """The cells of a row of the sidebar's Recent usage table: user, GPU-hours, quota, held now."""
    return [text.strip() for text in row.locator("th, td").all_text_contents()]


def _amount(value: float) -> str:
    """GPUs as the usage table shows them: at most two decimals, no trailing zeros."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


def test_status_bar_names_each_notebooks_own_device(lab, page, notebooks, shots):
    leases = _leases(lab, notebooks)
    item = page.locator(".jp-gpusched-StatusItem-button")
    for name in (TRAIN, EVAL):
        activate(page, name)
        lease = leases[name]
        kernel_id = notebooks[name]
        wait_for(
            lambda: item.get_attribute("data-kernel-id") == kernel_id,  # noqa: B023 - used at once
            15,
            f"the status bar to follow {name}",
        )
        assert item.get_attribute("data-lease-id") == lease["id"]
        assert item.get_attribute("data-state") in ("active", "idle")
        text = item.inner_text()
        assert text.startswith(f"GPU {lease['device_indices'][0]}: "), text
        assert "80.0 GiB" in text, text
    # The picture: the notebook in front (eval.ipynb) with its cell and its status bar, in a
    # window just tall enough for both.
    _show_sidebar(page, False)
    with _window_height(page, 300):
        page.screenshot(path=str(shots / "statusbar.png"), clip={"x": 0, "y": 0, "width": 760, "height": 300})


def _panel_rows(page) -> list[list[str]]:
    panel = page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output .widget-vbox").first
    rows = []
    # Each GPU is an HBox under the device VBox: name, bar, utilization, bar, memory, holder.
    for box in panel.locator(":scope > .widget-vbox > .widget-hbox").all():
        texts = box.locator(":scope > .widget-html, :scope > .widget-label").all_inner_texts()
        rows.append([" ".join(t.split()) for t in texts])
    return rows


def _expected_rows(status: dict, kernel_id: str) -> list[list[str]]:
    """What the panel must show for each GPU, computed from ``GET /api/gpusched/status``."""
    leases = {lease["id"]: lease for lease in status["leases"]}
    rows = []
    for device in sorted(status["devices"], key=lambda d: d["index"]):
        holders = []
        for lease_id in device["lease_ids"]:
            lease = leases[lease_id]
            if lease["kernel_id"] == kernel_id:
                holders.append("this kernel")
            else:
                holders.append(f"{lease['holder']} ({lease['notebook']})")
        rows.append(
            [
                f"GPU {device['index']} · {device['name']}",
                f"{device['utilization']:.0f}%",
                f"{_fmt_bytes(device['memory_used'])} / {_fmt_bytes(device['memory_total'])}",
                ", ".join(holders) or "free",
            ]
        )
    return rows


def test_panel_shows_what_the_rest_api_says(lab, page, notebooks, train_memory, shots):
    activate(page, EVAL)
    run_cell(page, "%gpu panel")
    page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output .widget-vbox").first.wait_for()

    def same() -> bool:
        expected = _expected_rows(lab.status(), notebooks[EVAL])
        same.last = (_panel_rows(page), expected)
        return same.last[0] == expected

    same.last = None
    try:
        wait_for(same, 30, "the panel to show the numbers of GET /api/gpusched/status")
    except AssertionError:
        shown, expected = same.last
        raise AssertionError(f"panel shows {shown}, the REST API says {expected}") from None
    shown = _panel_rows(page)
    assert any("12.0 GiB / 80.0 GiB" in row for row in shown)
    assert any(f"root ({TRAIN})" in row for row in shown)
    panel = page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output .widget-vbox").first
    assert "This kernel holds GPU" in panel.inner_text()
    panel.screenshot(path=str(shots / "panel.png"))


def test_reclaim_warning_counts_down_and_keep_stops_it(lab, page, notebooks, train_memory, shots):
    # eval.ipynb is kept, so the GPU to take back is the one of train.ipynb.
    activate(page, EVAL)
    run_cell(page, "%gpu keep 30m")
    _output(page, "is kept for").last.wait_for()
    wait_for(lambda: lab.lease_of(notebooks[EVAL])["keep_until"], 15, "eval.ipynb to be kept")
    activate(page, TRAIN)

    # Someone else wants a GPU: a third kernel asks and waits; train.ipynb is idle with 12 GiB.
    waiting = lab.call("POST", "api/kernels", {"name": KERNEL_NAME})["id"]
    claim = lab.call("POST", "api/gpusched/leases", {"kernel_id": waiting, "count": 1, "wait": 0})
    assert claim["state"] == "pending", claim

    warning = re.compile(rf"GPU (\d) of {re.escape(TRAIN)} will be reclaimed in (\d+):(\d\d)")
    toast = page.locator(".jp-toastContainer .Toastify__toast").filter(has_text=warning)
    toast.wait_for(timeout=45_000)
    lease = lab.lease_of(notebooks[TRAIN])
    assert lease["state"] == "reclaiming" and lease["reclaim_step"] == "restart", lease

    def left() -> int:
        m = warning.search(toast.inner_text())
        assert m, toast.inner_text()
        assert m.group(1) == str(lease["device_indices"][0])
        return int(m.group(2)) * 60 + int(m.group(3))

    first = left()
    assert 0 < first <= GRACE
    wait_for(lambda: left() < first, 5, "the reclaim countdown to move")
    # The status bar of the notebook counts down too.
    item = page.locator(".jp-gpusched-StatusItem-button")
    wait_for(lambda: "reclaim in" in item.inner_text(), 5, "the status bar countdown")
    assert item.get_attribute("data-state") == "reclaiming"
    # The picture: the notebook, the warning with its Keep button and the status bar counting
    # down, in a window just tall enough for them.
    with _window_height(page, 440):
        toast.wait_for()
        page.screenshot(path=str(shots / "reclaim-warning.png"))

    deadline = lease["reclaim_at"]
    toast.get_by_role("button", name="Keep 30 min").click()
    name = re.escape(TRAIN)
    page.locator(".jp-toastContainer .Toastify__toast").filter(
        has_text=re.compile(rf"GPU of {name} kept|Reclaim of GPU \d of {name} cancelled")
    ).first.wait_for(timeout=15_000)

    def called_off() -> dict | None:
        now = lab.lease_of(notebooks[TRAIN])
        return now if now and now["state"] != "reclaiming" else None

    kept = wait_for(called_off, 15, "the reclaim to be called off")
    assert kept["id"] == lease["id"] and kept["keep_until"] and kept["reclaim_at"] is None, kept

    # Past the old deadline the kernel still holds its GPU and its variables.
    end = datetime.fromisoformat(deadline.replace("Z", "+00:00")).timestamp() + 2
    wait_for(lambda: time.time() > end, GRACE + 10, "the old reclaim deadline to pass", interval=0.5)
    after = lab.lease_of(notebooks[TRAIN])
    assert after and after["id"] == lease["id"] and after["devices"] == lease["devices"], after
    assert after["state"] in ("active", "idle"), after
    queue = lab.status()["queue"]
    assert [q["kernel_id"] for q in queue] == [waiting], queue
    run_cell(page, "print(x + 1)")
    _output(page, "42").last.wait_for()
    lab.call("DELETE", f"api/kernels/{waiting}")


def test_a_restart_says_so_in_one_line_and_leaves_no_countdown(lab, page, notebooks, train_memory, shots):
    # train.ipynb is kept (the test before): unpin it, and let someone wait for its GPU again.
    activate(page, TRAIN)
    run_cell(page, "%gpu keep 0")
    wait_for(lambda: not lab.lease_of(notebooks[TRAIN])["keep_until"], 15, "train.ipynb to be unpinned")
    lease = lab.lease_of(notebooks[TRAIN])
    waiting = lab.call("POST", "api/kernels", {"name": KERNEL_NAME})["id"]
    claim = lab.call("POST", "api/gpusched/leases", {"kernel_id": waiting, "count": 1, "wait": 0})
    assert claim["state"] == "pending", claim

    # The countdown shows in train.ipynb's last cell, then the kernel is restarted.
    countdown = re.compile(r"will be (taken back|reclaimed) in")
    _output(page, countdown).first.wait_for(timeout=45_000)
    granted = wait_for(
        lambda: (lambda le: le if le and le["devices"] else None)(lab.lease_of(waiting)),
        GRACE + 30,
        "the waiting kernel to be granted train.ipynb's GPU",
    )
    assert granted["devices"] == lease["devices"], (granted, lease)

    # One line says the kernel was restarted; no countdown is left, on screen or as saved.
    restarted = _output(page, re.compile(r"restarted"))
    restarted.first.wait_for(timeout=20_000)
    outputs = page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output")
    texts = outputs.all_inner_texts()
    assert not [t for t in texts if countdown.search(t)], texts
    assert len([t for t in texts if "restarted" in t]) == 1, texts
    # The new kernel comes up (a restart takes its time on a loaded machine).
    wait_for(
        lambda: lab.call("GET", f"api/kernels/{notebooks[TRAIN]}")["execution_state"] == "idle",
        90, "the server to have the restarted kernel idle",
    )
    page.screenshot(path=str(shots / "restarted.png"))
    page.keyboard.press("ControlOrMeta+s")
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current:not(.jp-mod-dirty)").wait_for(timeout=15_000)
    saved = (lab.notebooks / TRAIN).read_text()
    assert not countdown.search(saved) and "restarted" in saved, saved[-2000:]
    # Its variables are gone, as the line says: the kernel is a new one.
    run_cell(page, "print('x' in dir())")
    _output(page, "False").last.wait_for(timeout=30_000)
    lab.call("DELETE", f"api/kernels/{waiting}")
