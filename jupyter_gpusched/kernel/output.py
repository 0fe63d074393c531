"""Showing lines in cells: from the running cell, or from the watcher thread into the last cell."""

from __future__ import annotations

import contextlib
import html
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import render

log = logging.getLogger("jupyter_gpusched.kernel")

#: ``display(text, html, display_id, update)``
DisplayFn = Callable[[str, "str | None", "str | None", bool], None]
#: ``say(text, html=None, display_id=None, update=False)``: a line in the cell (see :func:`say`).
SayFn = Callable[..., None]


def ipython_display(
    text: str, html_text: str | None = None, display_id: str | None = None, update: bool = False
) -> None:
    from IPython.display import display

    bundle = {"text/plain": text}
    if html_text:
        bundle["text/html"] = html_text
    if display_id:
        display(bundle, raw=True, display_id=display_id, update=update)
    else:
        display(bundle, raw=True)


def say(
    display: DisplayFn,
    shell: Any,
    parent: Any,
    text: str,
    html_text: str | None = None,
    display_id: str | None = None,
    update: bool = False,
) -> None:
    """Show a line in the cell that is running (or, from the watcher, the last one that ran).

    Code in backticks is marked up as code in HTML and shown without the backticks as text.
    """
    if html_text:
        html_text = render.code_html(html_text)
    elif "`" in text:
        html_text = render.code_html(html.escape(text))
    text = render.plain(text)
    with cell_context(shell, parent):
        try:
            display(text, html_text, display_id, update)
        except Exception:
            log.exception("could not show a notice: %s", text)


@contextlib.contextmanager
def cell_context(shell: Any, parent: Any) -> Iterator[None]:
    """From a background thread, attach output to the last executed cell (``parent``).

    Without this, ipykernel would attach it to whatever message it handled last (a completion
    or a widget message), and the frontend would drop it.
    """
    pub = getattr(shell, "display_pub", None)
    token = None
    if parent and threading.current_thread() is not threading.main_thread() and hasattr(pub, "set_thread_parent"):
        try:
            token = pub.set_thread_parent(parent)
        except Exception:  # noqa: BLE001 - an older ipykernel: the default parent will do
            token = None
    try:
        yield
    finally:
        if token is not None:
            with contextlib.suppress(Exception):
                pub.reset_thread_parent(token)


class Output:
    """Where the kernel side's lines go: the display function and the cell they belong to.

    Args:
        shell: the IPython shell (its ``parent_header`` names the running cell).
        display: ``display(text, html, display_id, update)``; IPython's by default.
    """

    def __init__(self, shell: Any, display: DisplayFn | None = None):
        self.shell = shell
        #: Everything shown goes through this (tests put a recorder here).
        self.display: DisplayFn = display or ipython_display
        self._parent: Any = None

    def note_cell(self) -> None:
        """A cell starts: lines from the watcher thread go to it from now on."""
        self._parent = getattr(self.shell, "parent_header", None) or self._parent

    def say(
        self, text: str, html_text: str | None = None, display_id: str | None = None, update: bool = False
    ) -> None:
        """Show a line in the cell that is running (or, from the watcher, the last one that ran)."""
        say(self.display, self.shell, self._parent, text, html_text, display_id, update)

    def show(self, text: str, html_text: str | None, display_id: str | None, update: bool) -> None:
        """Display ``text`` as it is (a line updated in place, such as the wait line)."""
        self.display(text, html_text, display_id, update)
