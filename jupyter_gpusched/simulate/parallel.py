"""Several policies replayed at once, one process each where the machine has the cores.

Replays of one trace under different policies share nothing, so :func:`simulate_policies` and
:func:`find_capacities` run them in a :class:`~concurrent.futures.ProcessPoolExecutor` of up to
``os.cpu_count()`` workers. The trace goes to each worker once, not with every task. Results are
the same as one after another (each replay is deterministic); with one core, or one policy, no
process is started.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Callable, Iterable, Mapping, TypeVar

from .capacity import find_capacity
from .progress import Progress, wanted
from .replay import ReplayOptions, Result, simulate
from .trace import Trace

T = TypeVar("T")

#: How often the parent redraws its progress line while workers run.
_POLL_S = 0.5

#: Rough relative cost of one replay per policy (passes and live leases per pass).
_COST = {"dynamic": 3, "hybrid": 3, "static": 2, "cull": 2, "oracle": 1}

_trace: Trace | None = None


def _adopt(trace: Trace) -> None:
    global _trace
    _trace = trace


def _replay(policy: str, gpus: int, options: ReplayOptions | None) -> Result | None:
    assert _trace is not None
    return simulate(_trace, policy, gpus, options, progress=False)


def _capacity(
    policy: str, options: ReplayOptions | None, known: dict[int, bool], every_user: bool = False
) -> int | None:
    assert _trace is not None
    return find_capacity(_trace, policy, options, known=known, progress=False, every_user=every_user)


def workers(tasks: int, processes: int | None = None) -> int:
    """Processes to use for ``tasks`` independent replays: one per core at most."""
    cores = processes if processes is not None else (os.cpu_count() or 1)
    return max(1, min(tasks, cores))


def _run(
    trace: Trace,
    tasks: Mapping[str, tuple],
    job: Callable[..., T],
    serial: Callable[[str], T],
    processes: int | None,
    label: str,
    progress: bool | None,
) -> dict[str, T]:
    count = workers(len(tasks), processes)
    if count <= 1:
        return {name: serial(name) for name in tasks}
    bar = Progress(label, enabled=wanted() if progress is None else progress)
    out: dict[str, T] = {}
    try:
        with ProcessPoolExecutor(max_workers=count, initializer=_adopt, initargs=(trace,)) as pool:
            # The dearest replays first, so that no worker is left with one long replay at the end.
            ordered = sorted(tasks, key=lambda name: -_COST.get(name, 0))
            futures = {pool.submit(job, *tasks[name]): name for name in ordered}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
                for future in done:
                    out[futures[future]] = future.result()
                running = ", ".join(sorted(futures[f] for f in pending))
                bar.update(len(out), len(tasks), f"{len(out)}/{len(tasks)} done; running: {running}" if running else "")
    finally:
        bar.close()
    return {name: out[name] for name in tasks}


def simulate_policies(
    trace: Trace,
    policies: Iterable[str],
    gpus: int,
    options: ReplayOptions | None = None,
    *,
    processes: int | None = None,
    progress: bool | None = None,
) -> dict[str, Result]:
    """``{policy: simulate(trace, policy, gpus, options)}``, the policies in parallel processes."""
    policies = tuple(policies)
    results = _run(
        trace,
        {policy: (policy, gpus, options) for policy in policies},
        _replay,
        lambda policy: simulate(trace, policy, gpus, options, progress=progress),
        processes,
        f"replaying {len(policies)} policies on {gpus} GPUs",
        progress,
    )
    return results  # type: ignore[return-value]


def find_capacities(
    trace: Trace,
    policies: Iterable[str],
    options: ReplayOptions | None = None,
    *,
    known: Mapping[str, Mapping[int, bool]] | None = None,
    processes: int | None = None,
    progress: bool | None = None,
    every_user: bool = False,
) -> dict[str, int | None]:
    """``{policy: find_capacity(trace, policy, options)}``, the policies in parallel processes.

    ``known`` gives, per policy, verdicts already at hand (host size -> good enough), such as
    those of replays just run (see :func:`verdicts`), so that the search never replays them.
    ``every_user``: the capacity at which each user's own p95 meets the target.
    """
    policies = tuple(policies)
    known = known or {}
    # Derived figures of the trace are worked out once here and travel with it to the workers.
    trace.static_peak(), trace.gpu_sessions  # noqa: B018
    what = "for every user " if every_user else ""
    return _run(
        trace,
        {policy: (policy, options, dict(known.get(policy, {})), every_user) for policy in policies},
        _capacity,
        lambda policy: find_capacity(
            trace, policy, options, known=dict(known.get(policy, {})), progress=progress, every_user=every_user
        ),
        processes,
        f"finding the capacity {what}of {len(policies)} policies",
        progress,
    )


def verdicts(results: Mapping[str, Result], every_user: bool = False) -> dict[str, dict[int, bool]]:
    """What finished replays already say about their host sizes, per policy, for ``known``
    (``every_user``: of the target for every user)."""
    from .capacity import good_enough, good_for_every_user

    good = good_for_every_user if every_user else good_enough
    return {policy: {result.gpus: good(result)} for policy, result in results.items()}


__all__ = ["find_capacities", "simulate_policies", "verdicts", "workers"]
