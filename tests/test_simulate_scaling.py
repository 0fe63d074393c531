"""The simulator at scale: policies in parallel processes, the progress line, synthetic traces."""

from __future__ import annotations

import io
import random
import time

import pytest

from jupyter_gpusched.core.idle import HostPrior
from jupyter_gpusched.simulate import (
    POLICIES,
    find_capacities,
    find_capacity,
    parse_notebookos,
    simulate,
    simulate_policies,
    verdicts,
)
from jupyter_gpusched.simulate import progress as progress_mod
from jupyter_gpusched.simulate.synthetic import one_cell_trace


@pytest.fixture(scope="module")
def small_trace():
    return parse_notebookos(one_cell_trace(120, days=0.5, seed=3), source="synthetic")


def test_synthetic_trace_is_reproducible_and_the_oracle_holds_exactly_the_busy_hours(small_trace):
    assert one_cell_trace(50, seed=1) == one_cell_trace(50, seed=1)
    assert len(small_trace.gpu_sessions) == 120
    assert all(len(s.cells) == 1 for s in small_trace.sessions)
    result = simulate(small_trace, "oracle", 64)
    assert result.gpu_hours_held == pytest.approx(small_trace.busy_gpu_seconds() / 3600.0, abs=1e-9)


def test_replay_cost_grows_linearly_with_the_sessions():
    """Ten times the sessions at the same density: about ten times the passes and the CPU time.

    Each pass works on the leases under way, not on every session of the trace; a replay whose
    cost grew with the sessions seen so far would take about a hundred times as long here.
    """

    def replay(sessions: int, tries: int) -> tuple[float, int]:
        trace = parse_notebookos(one_cell_trace(sessions, seed=2), source="synthetic")
        best, passes = float("inf"), 0
        for _ in range(tries):  # the fastest: a busy machine only ever adds time
            started = time.process_time()
            passes = simulate(trace, "hybrid", 512, progress=False).passes
            best = min(best, time.process_time() - started)
        return best, passes

    small_cpu, small_passes = replay(300, tries=3)
    large_cpu, large_passes = replay(3000, tries=1)
    assert 8 <= large_passes / small_passes <= 12
    assert large_cpu / small_cpu < 20


def test_policies_in_parallel_processes_give_what_one_after_another_gives(small_trace):
    gpus = small_trace.static_peak()
    parallel = simulate_policies(small_trace, POLICIES, gpus, processes=2, progress=False)
    for policy in POLICIES:
        assert parallel[policy] == simulate(small_trace, policy, gpus, progress=False)
    known = verdicts(parallel)
    capacities = find_capacities(small_trace, ("hybrid", "oracle"), known=known, processes=2, progress=False)
    for policy in ("hybrid", "oracle"):
        assert capacities[policy] == find_capacity(small_trace, policy, progress=False)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_only_on_a_terminal_and_cleared_at_the_end(monkeypatch):
    monkeypatch.setattr(progress_mod, "SHOW_AFTER_S", 0.0)
    monkeypatch.setattr(progress_mod, "REDRAW_S", 0.0)
    assert not progress_mod.wanted(io.StringIO())
    assert progress_mod.wanted(_Terminal())
    out = _Terminal()
    bar = progress_mod.Progress("hybrid on 8 GPUs", stream=out)
    bar.update(1, 4)
    bar.close()
    text = out.getvalue()
    assert "\rhybrid on 8 GPUs [" in text and "25%" in text
    assert text.endswith("\r\x1b[K")
    quiet = io.StringIO()
    bar = progress_mod.Progress("x", enabled=progress_mod.wanted(quiet), stream=quiet)
    bar.update(1, 2)
    bar.close()
    assert quiet.getvalue() == ""


def test_host_prior_excluding_a_lease_is_the_walk_over_its_segments():
    rng = random.Random(7)
    for _ in range(3000):
        owners = [rng.choice("abcdefg") for _ in range(rng.randint(0, 12))]
        segments = tuple((o, tuple(float(rng.randint(1, 99)) for _ in range(rng.randint(0, 8)))) for o in owners)
        prior = HostPrior(segments, rng.randint(0, 30))
        for lease_id in ("a", "b", "z", None):
            expected: list[float] = []
            room = prior.limit
            for owner, spells in reversed(segments):
                if owner == lease_id:
                    continue
                if len(spells) >= room:
                    expected[:0] = spells[len(spells) - room :]
                    break
                expected[:0] = spells
                room -= len(spells)
            assert prior.excluding(lease_id) == tuple(expected)
