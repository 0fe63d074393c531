"""Synthetic workload traces in the NotebookOS format, for benchmarks and scaling tests.

:func:`one_cell_trace` makes ``sessions`` one-cell notebook sessions spread evenly (at random)
over ``days``: each kernel starts, runs one cell a few minutes later, and stays open, idle, for a
while after it (the idle tail a dynamic arbiter wins back). The document has the fields that
:func:`~jupyter_gpusched.simulate.trace.parse_notebookos` reads (``sessions[]`` with ``id``,
``start_tick``, ``stop_tick``, ``max_resource_request`` and ``trainings[]``), in ticks of 60 s.
The same arguments give the same trace.
"""

from __future__ import annotations

import random

#: Sessions per day in the default density (a 30-day trace of 30,000 sessions).
SESSIONS_PER_DAY = 1000
TICKS_PER_DAY = 24 * 60

# Lease sizes and how often sessions ask for them.
_GPU_SIZES = (1, 2, 4, 8)
_GPU_WEIGHTS = (70, 18, 9, 3)


def one_cell_trace(sessions: int, days: float | None = None, seed: int = 0) -> dict:
    """A NotebookOS workload document of ``sessions`` one-cell GPU sessions over ``days`` days
    (default: ``sessions / 1000``, so that the load on the host stays the same at every size)."""
    if days is None:
        days = max(sessions / SESSIONS_PER_DAY, 1 / TICKS_PER_DAY)
    rng = random.Random(seed)
    span = max(int(days * TICKS_PER_DAY), 1)
    out = []
    for i in range(sessions):
        gpus = rng.choices(_GPU_SIZES, _GPU_WEIGHTS)[0]
        start = rng.randrange(span)
        cell_start = start + rng.randint(0, 10)
        duration = max(1, int(rng.lognormvariate(3.0, 1.0)))  # median about 20 minutes
        idle_tail = int(rng.expovariate(1 / 60.0))  # the kernel stays open about an hour after
        stop = cell_start + duration + idle_tail
        vram = round(rng.uniform(2.0, 40.0), 2)
        utilization = round(rng.uniform(20.0, 100.0), 2)
        out.append(
            {
                "id": f"synthetic-{seed}-{i:06d}",
                "start_tick": start,
                "stop_tick": stop,
                "num_training_events": 1,
                "max_resource_request": {"cpus": 4, "memory": 16, "gpus": gpus, "vram": vram},
                "trainings": [
                    {
                        "start_tick": cell_start,
                        "duration_in_ticks": duration,
                        "end_tick": cell_start + duration,
                        "cpus": 4,
                        "memory": 16,
                        "vram": vram,
                        "gpus": gpus,
                        "gpu_utilizations": [{"utilization": utilization}] * gpus,
                    }
                ],
            }
        )
    return {
        "workload_title": f"synthetic: {sessions} one-cell sessions over {days:g} days (seed {seed})",
        "workload_seed": seed,
        "sessions": out,
    }
