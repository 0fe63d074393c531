"""One simulated GPU, driven in headless Chromium: a claim that must queue, and Notebook 7.

The server is ``jupyter notebook`` (Notebook 7), which serves JupyterLab at ``/lab`` too. In
JupyterLab, notebook A holds the only GPU and notebook B's ``%gpu acquire --wait 3m`` queues:
the sidebar's queue and B's status bar show it within a few seconds, with one "queued"
notification. Then a Notebook 7 page shows its kernel's GPU in its menu bar (Notebook 7 has no
status bar), its notifications and the sidebar panel.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from browser_util import (  # noqa: F401 - fixtures shared by the browser test modules
    KERNEL_DISPLAY_NAME,
    KERNEL_NAME,
    LabServer,
    activate,
    browser_page,
    chromium,
    jp_asyncio_loop,
    jp_server_cleanup,
    new_gpu_notebook,
    open_lab,
    run_cell,
    shots,
    toasts,
    wait_for,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

HOLDER, WAITER, NB7 = "holder.ipynb", "waiter.ipynb", "classic-look.ipynb"
# A queued claim must show this soon after the magic says so.
SHOWN_WITHIN_MS = 5_000


@pytest.fixture(scope="module")
def server(chromium, tmp_path_factory):
    # Default timeouts: nothing is reclaimed while the test looks at the queue.
    server = LabServer(tmp_path_factory.mktemp("one-gpu"), devices=1, app="notebook")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def page(chromium, server):
    with browser_page(chromium) as page:
        yield page


def _output(page, has_text: str):
    return page.locator(".jp-NotebookPanel:visible .jp-OutputArea-output", has_text=has_text)


def _status_item(page):
    return page.locator(".jp-gpusched-StatusItem-button")


def test_a_claim_that_must_queue_shows_in_the_sidebar_and_status_bar(server, page, shots):
    open_lab(page, server, "gpusched-one-gpu")
    holder = new_gpu_notebook(page, server, HOLDER)
    run_cell(page, "%gpu acquire")
    _output(page, "holds GPU").wait_for()

    waiter = new_gpu_notebook(page, server, WAITER)
    item = _status_item(page)
    wait_for(lambda: item.get_attribute("data-kernel-id") == waiter, 15, "the status bar to follow B")
    # A lazily bound kernel that has not run a cell gets its GPU then, and says so.
    wait_for(lambda: item.inner_text() == "GPU: at first cell", 10, "B's status bar to say 'at first cell'")
    assert item.get_attribute("data-state") == "lazy"

    page.locator('li[data-id="jp-gpusched-panel"]').click()
    panel = page.locator("#jp-gpusched-panel")
    panel.wait_for(state="visible")
    assert panel.locator(".jp-gpusched-QueueEntry").count() == 0

    run_cell(page, "%gpu acquire --wait 3m")
    _output(page, "position 1").wait_for(timeout=30_000)
    said = time.monotonic()

    entry = panel.locator(".jp-gpusched-QueueEntry")
    entry.first.wait_for(timeout=SHOWN_WITHIN_MS)
    item_text = wait_for(
        lambda: item.inner_text() if item.inner_text() == "GPU: queued #1" else None,
        SHOWN_WITHIN_MS / 1000,
        "B's status bar to say 'GPU: queued #1'",
    )
    assert time.monotonic() - said < SHOWN_WITHIN_MS / 1000 + 1
    assert item_text == "GPU: queued #1" and item.get_attribute("data-state") == "pending"
    assert entry.count() == 1
    assert entry.get_attribute("data-position") == "1"
    # The entry names the notebook by its kernel's session, renamed from Untitled.ipynb just
    # before: the server may still have the old name for a moment.
    wait_for(lambda: WAITER in entry.inner_text(), 15, f"the queue entry to name {WAITER}")
    assert "(1)" in panel.locator(".jp-gpusched-Queue .jp-gpusched-Count").inner_text()
    queued = server.status()["queue"]
    assert [q["kernel_id"] for q in queued] == [waiter], queued
    assert entry.get_attribute("data-lease-id") == queued[0]["lease_id"]

    # Under the entry, why B waits and stands where it does, as the server says it.
    shown = entry.locator(".jp-gpusched-QueueReason")

    seen: dict[str, str | None] = {}

    def same_reason() -> str | None:
        seen["said"] = server.status()["queue"][0]["reason"]
        seen["shown"] = shown.text_content() if shown.count() == 1 else None
        return seen["said"] if seen["said"] and seen["shown"] == seen["said"] else None

    try:
        reason = wait_for(same_reason, 10, "the queue entry to show the server's reason")
    except AssertionError as err:
        said, entry_says = seen.get("said"), seen.get("shown")
        raise AssertionError(f"{err}: the server says {said!r}, the entry {entry_says!r}") from None
    assert "1st in line" in reason and " recently (half-life 1 day)" in reason, reason
    assert shown.get_attribute("title") == reason

    # Recent usage: the one user of this server, marked as the viewer, holds the only GPU.
    usage = panel.locator(".jp-gpusched-Usage")
    assert usage.locator(".jp-gpusched-SectionTitle").text_content().startswith("Recent usage (half-life 1 day)")
    rows = usage.locator(".jp-gpusched-UsageRow")
    user = server.status()["user"]
    assert [u["user"] for u in server.status()["usage"]] == [user]
    wait_for(lambda: rows.count() == 1, 10, "one row of recent usage")
    cells = [text.strip() for text in rows.first.locator("th, td").all_text_contents()]
    assert cells[0] == f"{user} (you)" and cells[3] == "1", cells
    assert rows.first.get_attribute("data-own") == "true"

    # One notification, in one sentence, that says where B stands.
    toast = toasts(page, re.compile(rf"GPU request for {re.escape(WAITER)} queued"))
    toast.first.wait_for(timeout=SHOWN_WITHIN_MS)
    assert toast.count() == 1
    assert toast.first.inner_text().strip() == f"GPU request for {WAITER} queued at position 1"
    page.screenshot(path=str(shots / "queue.png"), clip={"x": 0, "y": 0, "width": 1100, "height": 900})

    # A gives its GPU back: B gets it, and the queue empties.
    activate(page, HOLDER)
    run_cell(page, "%gpu release")
    activate(page, WAITER)
    toasts(page, re.compile(rf"GPU 0 \(.+\) granted to {re.escape(WAITER)}")).first.wait_for(timeout=30_000)
    panel.locator(".jp-gpusched-Queue .jp-gpusched-Empty").wait_for(timeout=10_000)
    wait_for(lambda: item.inner_text().startswith("GPU 0: "), 10, "B's status bar to show its GPU")
    for kernel_id in (holder, waiter):
        server.call("DELETE", f"api/kernels/{kernel_id}")
    wait_for(lambda: not server.status()["leases"], 20, "the leases of the closed notebooks to go")


def _write_notebook(server: LabServer, name: str) -> None:
    """A notebook whose kernelspec is the GPU one, as Notebook 7's "New" menu would make it."""
    notebook = {
        "cells": [{"cell_type": "code", "metadata": {}, "source": "", "outputs": [], "execution_count": None}],
        "metadata": {
            "kernelspec": {"name": KERNEL_NAME, "display_name": KERNEL_DISPLAY_NAME, "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (server.notebooks / name).write_text(json.dumps(notebook))


def test_notebook_7_shows_the_gpu_of_its_kernel_and_its_notifications(server, page, shots):
    _write_notebook(server, NB7)
    page.goto(f"{server.url}notebooks/{NB7}?token={server.token}")
    page.locator(".jp-Notebook").wait_for(timeout=60_000)
    kernel_id = wait_for(lambda: server.kernel_of(NB7), 60, "the notebook's kernel")
    wait_for(
        lambda: any(
            k["id"] == kernel_id and k["execution_state"] == "idle" and k.get("connections", 0) >= 1
            for k in server.kernels()
        ),
        90,
        "the kernel to be idle and connected",
    )
    # Notebook 7 has no status bar: the GPU item is in the page's menu bar.
    item = page.locator("#menu-panel .jp-gpusched-StatusItem-button, .jp-gpusched-StatusItem-menu button")
    item.first.wait_for(timeout=15_000)
    item = item.first
    assert item.is_visible()
    wait_for(lambda: item.inner_text() == "GPU: at first cell", 15, "the menu bar item to say 'at first cell'")

    page.locator(".jp-Cell .cm-content").last.click()
    page.keyboard.type("%gpu acquire")
    page.keyboard.press("Shift+Enter")
    page.locator(".jp-OutputArea-output", has_text="holds GPU").wait_for(timeout=30_000)
    lease = wait_for(lambda: server.lease_of(kernel_id), 15, "the lease of the notebook")

    wait_for(lambda: item.get_attribute("data-lease-id") == lease["id"], 10, "the item to show the lease")
    assert item.inner_text().startswith(f"GPU {lease['device_indices'][0]}: "), item.inner_text()
    toast = toasts(page, re.compile(rf"GPU {lease['device_indices'][0]} \(.+\) granted to {re.escape(NB7)}"))
    toast.first.wait_for(timeout=15_000)
    page.screenshot(path=str(shots / "notebook7.png"), clip={"x": 0, "y": 0, "width": 1400, "height": 420})

    # The item opens the sidebar panel, which shows the lease.
    item.click()
    panel = page.locator("#jp-gpusched-panel")
    panel.wait_for(state="visible", timeout=15_000)
    panel.locator(f'.jp-gpusched-Lease[data-lease-id="{lease["id"]}"]').wait_for(timeout=10_000)
