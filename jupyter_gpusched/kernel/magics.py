"""``%gpu``: status, acquire, release, keep and the live panel, from any cell.

Every failure is one line: a usage mistake is a ``UsageError``; a refusal from the server is a
``GPUSchedError``, which IPython shows as its message alone.
"""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING, Any, NoReturn

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from . import render

if TYPE_CHECKING:  # pragma: no cover
    from .agent import Agent

USAGE = """\
%gpu                      this kernel's lease, the host's GPUs and the queue
%gpu status [--all]       the same; --all adds every lease, the queue and stray GPU processes
%gpu acquire [N] [--memory 16GiB] [--shared | --exclusive] [--wait 10m | --no-wait]
                          ask for N GPUs (default: the kernelspec's); waits with a live queue position
%gpu release [--free]     give this kernel's GPUs back now (or withdraw a waiting request); --free
                          empties PyTorch's and CuPy's memory caches first. Memory it still holds
                          stays counted as taken on that GPU, and the output says so
%gpu keep 30m             no idle reclaim for 30 minutes (0 to stop keeping)
%gpu panel                the live status panel (ipywidgets)"""


_NOTHING = {
    "status": "it has no GPU",
    "release": "there is no GPU to release",
    "keep": "there is no GPU to keep",
    "panel": "there is no GPU panel",
}


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}\n{self.format_usage().strip()}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise UsageError(message or USAGE)


def _parsers() -> dict[str, _Parser]:
    status = _Parser(prog="%gpu status", add_help=False)
    status.add_argument("--all", action="store_true")

    acquire = _Parser(prog="%gpu acquire", add_help=False)
    acquire.add_argument("count", nargs="?", type=int)
    acquire.add_argument("--memory", "-m")
    modes = acquire.add_mutually_exclusive_group()
    modes.add_argument("--shared", dest="mode", action="store_const", const="shared")
    modes.add_argument("--exclusive", dest="mode", action="store_const", const="exclusive")
    waits = acquire.add_mutually_exclusive_group()
    waits.add_argument("--wait", "-w", metavar="DURATION")
    waits.add_argument("--no-wait", dest="no_wait", action="store_true")
    acquire.add_argument("--priority", type=int)

    release = _Parser(prog="%gpu release", add_help=False)
    release.add_argument("--free", action="store_true")

    keep = _Parser(prog="%gpu keep", add_help=False)
    keep.add_argument("duration", nargs="?", default="30m")

    panel = _Parser(prog="%gpu panel", add_help=False)
    panel.add_argument("--interval", type=float, default=2.0)
    return {"status": status, "acquire": acquire, "release": release, "keep": keep, "panel": panel}


def _with_unit(text: str, option: str, kind: str, aside: str = "") -> None:
    """Refuse a size or a duration typed without its unit (``--memory 16``, ``%gpu keep 30``),
    showing the fix as the user would type it; anything else wrong is left to the parser."""
    from ..core.units import DURATION_FORMS, SIZE_FORMS, MissingUnit, parse_duration, parse_memory, unit_fixes

    try:
        if kind == "size":
            parse_memory(text, option)
        else:
            parse_duration(text, option)
    except MissingUnit as err:
        n = err.number
        if len(n) > 24:
            raise UsageError(str(err)) from None
        fixes = unit_fixes(n, kind)
        said, forms = (f"{n} bytes", SIZE_FORMS) if kind == "size" else (f"{n} seconds", DURATION_FORMS)
        forms = forms.replace("'", "")
        raise UsageError(
            f"`{option} {n}` needs a unit: a number alone would be {said}. Write `{option} {fixes[0]}` "
            f"or `{option} {fixes[1]}` ({kind}s look like {forms}{'; ' + aside if aside else ''})."
        ) from None
    except ValueError:
        pass  # said by the call that uses it, as before


@magics_class
class GPUMagics(Magics):
    """The ``%gpu`` line magic; the work is done by the kernel agent."""

    def __init__(self, shell: Any, agent: Agent):
        super().__init__(shell)
        self.agent = agent
        self._parsers = _parsers()

    @line_magic
    def gpu(self, line: str = "") -> Any:
        """GPU scheduling for this kernel. Run ``%gpu help`` for the sub-commands."""
        try:
            words = shlex.split(line)
        except ValueError as err:
            raise UsageError(f"%gpu: {err}") from None
        command = words[0] if words else "status"
        if command in ("help", "-h", "--help"):
            print(USAGE)
            return None
        parser = self._parsers.get(command)
        if parser is None:
            raise UsageError(
                f"%gpu has no sub-command {command!r}: use status, acquire, release, keep or panel "
                "(`%gpu help` explains them)."
            )
        args = parser.parse_args(words[1:])
        if command != "acquire" and not self.agent.has_scheduler:
            # Said plainly instead of failing: there is nothing to show, keep or release.
            self.agent.say_no_scheduler(_NOTHING[command])
            return None
        try:
            return getattr(self, f"_{command}")(args)
        except ValueError as err:
            raise UsageError(str(err)) from None

    def _status(self, args: argparse.Namespace) -> None:
        status = self.agent.status()
        text, html_text = render.status_report(
            status,
            status.get("kernel_id"),
            status.get("lease"),
            self.agent.clock(),
            show_all=args.all,
            first_cell=status.get("first_cell"),
        )
        self.agent.say(text, html_text)

    def _acquire(self, args: argparse.Namespace) -> None:
        wait: object = None
        if args.no_wait:
            wait = 0
        elif args.wait is not None:
            wait = args.wait
            _with_unit(wait, "--wait", "duration", "--no-wait does not wait")
        if args.memory is not None:
            _with_unit(args.memory, "--memory", "size")
        from .claims import ClaimCancelled

        try:
            self.agent.acquire(args.count, memory=args.memory, mode=args.mode, wait=wait, priority=args.priority)
        except ClaimCancelled:
            pass  # the wait line says it was cancelled, and how to ask again: not an error here

    def _release(self, args: argparse.Namespace) -> None:
        self.agent.release(free=args.free)

    def _keep(self, args: argparse.Namespace) -> None:
        duration = "0" if args.duration in ("off", "none", "no") else args.duration
        _with_unit(duration, "%gpu keep", "duration", "0 or off stops keeping")
        self.agent.keep(duration)

    def _panel(self, args: argparse.Namespace) -> None:
        from IPython.display import display

        display(self.agent.panel(interval=args.interval))
