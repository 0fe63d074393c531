"""Trace replay: small traces whose numbers can be worked out by hand, and the real trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpusched.cli import main
from jupyter_gpusched.core import SchedConfig
from jupyter_gpusched.simulate import (
    METRICS,
    POLICIES,
    ReplayOptions,
    SimulationError,
    TraceError,
    find_capacity,
    load_trace,
    parse_csv,
    parse_notebookos,
    percentile,
    simulate,
)

HERE = Path(__file__).resolve().parent
TRACE_NAME = "notebookos-adobe-2021-06-01-02.json"


def real_trace_path() -> Path:
    for folder in (HERE.parent / "traces", HERE.parent.parent / "shared" / "traces"):
        if (folder / TRACE_NAME).exists():
            return folder / TRACE_NAME
    pytest.skip(f"{TRACE_NAME} is not beside the checkout")


# Two one-GPU users on a one-GPU host: alice computes for 10 minutes, bob's cell arrives 30 s
# after alice's ends. Both kernels live for the hour.
TWO_USERS = """\
session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s
a,alice,0,600,1,10,1,0,3600
b,bob,630,600,1,10,1,630,3600
"""


# -- loading -------------------------------------------------------------------------------------
def test_csv_defaults_and_explicit_session_columns():
    trace = parse_csv(
        "# comment line\n"
        "session,user,start_s,duration_s,gpus,vram_gb\n"
        "s1,ann,100,50,0,0\n"
        "s1,ann,10,20,2,4.5\n"
        "\n"
        "s2,,0,10,1,1,4,0,500\n"
    )
    s1, s2 = trace.sessions
    assert (s1.user, s1.gpus, s1.start, s1.stop) == ("ann", 2, 10.0, 150.0)
    assert [c.start for c in s1.cells] == [10.0, 100.0]  # sorted by start
    assert s1.cells[0].vram_gb == 4.5
    assert (s2.user, s2.gpus, s2.start, s2.stop) == ("s2", 4, 0.0, 500.0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("a,u,0,10,1\n", "expected 6 or 9 columns"),
        ("a,u,0,-5,1,0\n", "duration_s must be 0 or more"),
        ("a,u,0,10,1.5,0\n", "whole number"),
        ("a,u,0,10,2,0,1,,\n", "asks for only 1"),
        ("a,u,0,10,1,0\na,v,20,10,1,0\n", "two users"),
        ("a,u,0,10,1,0,1,0,100\na,u,20,10,1,0,1,0,200\n", "two values of session_stop_s"),
    ],
)
def test_csv_mistakes_are_explained(text, message):
    with pytest.raises(TraceError, match=message):
        parse_csv(text, source="t.csv")


def test_notebookos_json_ticks_are_minutes(tmp_path):
    doc = {
        "workload_title": "tiny",
        "sessions": [
            {
                "id": "gpu-session",
                "start_tick": 1,
                "stop_tick": 30,
                "max_resource_request": {"gpus": 4, "vram": 8},
                "trainings": [
                    {"start_tick": 2, "duration_in_ticks": 3, "end_tick": 5, "gpus": 4, "vram": 8.0,
                     "gpu_utilizations": [{"utilization": 50.0}, {"utilization": 30.0}]},
                    {"start_tick": 6, "duration_in_ticks": 1, "end_tick": 7, "gpus": 0, "vram": 0.0,
                     "gpu_utilizations": []},
                ],
            },
            {"id": "cpu-session", "start_tick": 0, "stop_tick": 9, "max_resource_request": {"gpus": 0},
             "trainings": [{"start_tick": 1, "duration_in_ticks": 2, "gpus": 0, "vram": 0}]},
        ],
    }
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    gpu = trace.sessions[0]
    assert (gpu.start, gpu.stop, gpu.gpus) == (60.0, 1800.0, 4)
    assert [(c.start, c.duration, c.gpus) for c in gpu.cells] == [(120.0, 180.0, 4), (360.0, 60.0, 0)]
    assert gpu.cells[0].utilization == 40.0
    assert [s.id for s in trace.gpu_sessions] == ["gpu-session"]  # the CPU-only kernel needs no GPU
    assert trace.busy_gpu_seconds() == 4 * 180

    # Every cell of the GPU session needs its lease, the CPU-only one too: the oracle holds
    # 4 GPUs for 3 minutes, dynamic holds them from the first cell until the kernel stops.
    oracle = simulate(trace, "oracle", 4)
    assert oracle.gpu_hours_held == pytest.approx(4 * 180 / 3600)
    assert len(oracle.delays) == 2  # the cells of the GPU session; the CPU session's do not count
    static = simulate(trace, "static", 4)
    assert static.gpu_hours_held == pytest.approx(4 * (1800 - 60) / 3600)


def test_missing_and_malformed_traces(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"sessions": [{"id": "x"}]}')
    with pytest.raises(TraceError, match="session #0"):
        load_trace(bad)
    with pytest.raises(TraceError, match="sessions"):
        parse_notebookos({"traces": []})


# -- hand-computed replays -----------------------------------------------------------------------
def test_oracle_holds_exactly_the_gpu_cells():
    trace = parse_csv(
        "a,,0,3600,2,10,2,0,20000\n"
        "a,,7200,1800,0,0,2,0,20000\n"  # CPU-only: the oracle holds nothing
        "b,,1800,3600,1,5,1,0,20000\n"
    )
    result = simulate(trace, "oracle", 3)
    assert result.gpu_hours_busy == pytest.approx(2 * 1 + 1 * 1)
    assert result.gpu_hours_held == pytest.approx(result.gpu_hours_busy)
    assert result.efficiency == pytest.approx(1.0)
    assert result.peak_gpus_held == 3
    assert result.delays == (0.0, 0.0, 0.0)
    # On 2 GPUs bob's cell waits for alice's to finish at 3600 s.
    queued = simulate(trace, "oracle", 2)
    assert sorted(queued.delays) == [0.0, 0.0, 1800.0]
    assert queued.gpu_hours_held == pytest.approx(3.0)


def test_static_holds_from_start_to_stop_and_queues():
    trace = parse_csv(TWO_USERS)
    result = simulate(trace, "static", 1)
    # Alice holds the GPU for her whole hour; bob's cell waits from 630 s until 3600 s, and his
    # kernel stops when that cell ends, at 4200 s.
    assert result.delays == (0.0, 2970.0)
    assert result.gpu_hours_held == pytest.approx(4200 / 3600)
    assert result.peak_gpus_held == 1
    assert result.cell_delay_p95_s == pytest.approx(0.95 * 2970)
    roomy = simulate(trace, "static", 2)
    assert roomy.delays == (0.0, 0.0)
    assert roomy.gpu_hours_held == pytest.approx((3600 + 2970) / 3600)


def test_hybrid_takes_a_borrowed_idle_gpu_after_contended_idle_timeout():
    trace = parse_csv(TWO_USERS)
    result = simulate(trace, "hybrid", 1)
    # Fair share is half a GPU each, so alice's lease is borrowed: idle since 600 s, it is
    # checkpointed at 600 + 60 s; 10 GB at 2 GB/s plus 2.7 s later bob gets the GPU.
    assert result.delays[0] == 0.0
    assert result.delays[1] == pytest.approx(660 + 7.7 - 630)
    assert (result.suspends, result.restores, result.disruptions) == (1, 0, 0)
    assert result.held == ((0.0, 1), (667.7, 1), (3600.0, 0))


# alice computes for two hours on the one GPU; then a second kernel of hers and one of bob's ask for
# it, hers first. When her first kernel's lease is taken back, who gets the GPU?
HEAVY_AND_LIGHT = """\
session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s
a1,alice,0,7200,1,10,1,0,20000
a2,alice,7100,60,1,10,1,7000,20000
b1,bob,7150,60,1,10,1,7150,20000
"""


def test_recent_usage_puts_the_lighter_user_first_as_on_the_server():
    trace = parse_csv(HEAVY_AND_LIGHT)
    fair = simulate(trace, "hybrid", 1)
    _, alice_waited, bob_waited = fair.delays
    # alice's lease is borrowed (a fair share is half a GPU): checkpointed 60 s after her cell
    # ends, 10 GB at 2 GB/s + 2.7 s; bob, who used nothing, goes first although he asked later.
    assert bob_waited == pytest.approx(7200 + 60 + 7.7 - 7150)
    assert alice_waited > bob_waited
    # Without usage (half-life 0) the older claim goes first, as before.
    plain = simulate(trace, "hybrid", 1, ReplayOptions(config=SchedConfig(usage_half_life=0)))
    _, alice_waited, bob_waited = plain.delays
    assert alice_waited == pytest.approx(7200 + 60 + 7.7 - 7100)
    assert bob_waited > alice_waited


def test_dynamic_reclaims_after_idle_timeout():
    result = simulate(parse_csv(TWO_USERS), "dynamic", 1)
    assert result.delays[1] == pytest.approx(600 + 300 + 7.7 - 630)


def test_without_checkpoint_a_reclaim_restarts_the_kernel():
    options = ReplayOptions(config=SchedConfig(checkpoint="off"))
    result = simulate(parse_csv(TWO_USERS), "dynamic", 1, options)
    # Notice at 900 s, restart after the 60 s grace period: alice loses her kernel's state.
    assert result.disruptions == 1
    assert result.suspends == 0
    assert result.delays[1] == pytest.approx(960 - 630)


def test_suspend_and_restore_cost_memory_over_bandwidth():
    trace = parse_csv(
        "session,user,start_s,duration_s,gpus,vram_gb\n"
        "a,alice,0,600,1,20\n"
        "a,alice,14400,600,1,20\n"
    )
    result = simulate(trace, "hybrid", 1)
    # Too few idle spells to learn from: the lease is kept for release_timeout (3600 s) after
    # the cell, then checkpointed (20 GB / 2 GB/s + 2.7 s by default), and restored (as long)
    # for the next cell.
    assert (result.suspends, result.restores, result.disruptions) == (1, 1, 0)
    assert result.delays[1] == pytest.approx(12.7)
    assert result.held == ((0.0, 1), (4212.7, 0), (14400.0, 1), (15012.7, 0))
    assert result.peak_checkpoint_host_gb == pytest.approx(20.0)
    slower = simulate(trace, "hybrid", 1, ReplayOptions(restore_gbps=5, restore_fixed_s=1.0))
    assert slower.delays[1] == pytest.approx(20 / 5 + 1.0)
    assert slower.held[1] == (4212.7, 0)  # the checkpoint's own cost is unchanged
    faster_out = simulate(trace, "hybrid", 1, ReplayOptions(checkpoint_gbps=10, checkpoint_fixed_s=0.5))
    assert faster_out.held[1] == (4202.5, 0)


def test_a_kernel_holding_no_gpu_memory_is_released_not_suspended():
    trace = parse_csv("a,,0,600,1,0,1,0,20000\na,,14400,600,1,0,1,0,20000\n")
    result = simulate(trace, "hybrid", 1)
    assert (result.suspends, result.restores) == (0, 0)
    assert result.delays == (0.0, 0.0)
    assert result.held == ((0.0, 1), (4200.0, 0), (14400.0, 1), (15000.0 + 3600, 0))


def test_cull_frees_the_gpu_and_the_next_cell_finds_the_kernel_gone():
    trace = parse_csv("a,,0,600,1,10,1,0,20000\na,,7800,600,1,10,1,0,20000\nb,,12000,60,1,1,1,0,20000\n")
    result = simulate(trace, "cull", 2, ReplayOptions(cull_timeout=3600))
    # Alice: idle from 600 s, culled at 4200 s; back at 7800 s she finds her kernel gone (a
    # disruption), holds a GPU again and is culled at 8400 + 3600 s, for good this time.
    # Bob: launched at 0 s and idle, culled at 3600 s; back at 12000 s (a disruption), culled
    # again 3600 s after his cell.
    assert result.disruptions == 2
    alice = 4200 + (12000 - 7800)
    bob = 3600 + (12060 + 3600 - 12000)
    assert result.gpu_hours_held == pytest.approx((alice + bob) / 3600)
    assert result.delays == (0.0, 0.0, 0.0)
    never = simulate(trace, "cull", 2, ReplayOptions(cull_timeout=0))
    assert never.disruptions == 0
    assert never.gpu_hours_held == simulate(trace, "static", 2).gpu_hours_held


def test_same_input_same_output():
    text = TWO_USERS + "c,carol,100,900,1,30,1,50,9000\nc,carol,2000,100,0,0,1,50,9000\n"
    for policy in POLICIES:
        first = simulate(parse_csv(text), policy, 2)
        second = simulate(parse_csv(text), policy, 2)
        assert first == second


def test_a_host_too_small_for_a_claim_is_refused():
    with pytest.raises(SimulationError, match="asks for 2 GPUs"):
        simulate(parse_csv("a,,0,10,2,0\n"), "hybrid", 1)


def test_find_capacity_on_two_concurrent_users():
    trace = parse_csv("a,,0,3600,1,1\nb,,0,3600,1,1\n")
    for policy in POLICIES:
        assert find_capacity(trace, policy) == 2
    # Nobody ever loses state under cull here, but a cull that hits a returning user fails it.
    culled = parse_csv("a,,0,60,1,1,1,0,9000\na,,7200,60,1,1,1,0,9000\n")
    assert find_capacity(culled, "cull") is None
    assert find_capacity(culled, "hybrid") == 1


def test_percentile_interpolates_like_numpy():
    assert percentile([], 95) == 0.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0


# -- the command line ----------------------------------------------------------------------------
def test_cli_json_is_one_object_keyed_by_policy(tmp_path, capsys):
    path = tmp_path / "two.csv"
    path.write_text(TWO_USERS)
    assert main(["simulate", "--trace", str(path), "--gpus", "1", "--json", "--find-capacity"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(POLICIES)
    for metrics in out.values():
        assert list(metrics) == [*METRICS, "users", "worst_user", "capacity", "capacity_every_user"]
    assert out["hybrid"]["cell_delay_p99_s"] == pytest.approx(37.7 * 0.99, abs=0.01)
    assert out["oracle"]["capacity"] == 1


def test_cli_table_plot_and_knobs(tmp_path, capsys):
    path = tmp_path / "two.csv"
    path.write_text(TWO_USERS)
    png = tmp_path / "held.png"
    code = main(
        ["simulate", "--trace", str(path), "--gpus", "1", "--policy", "dynamic", "--plot", str(png),
         "--idle-timeout", "2m", "--bandwidth", "10", "--checkpoint-fixed", "0"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "dynamic" in out and "hybrid" not in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # idle_timeout 2 minutes: checkpointed at 720 s, 10 GB at 10 GB/s: bob waits 91 s.
    assert main(["simulate", "--trace", str(path), "--gpus", "1", "--policy", "dynamic", "--json",
                 "--idle-timeout", "120", "--bandwidth", "10", "--checkpoint-fixed", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["dynamic"]["cell_delay_p99_s"] == pytest.approx(91 * 0.99, abs=0.01)


def test_cli_plot_without_matplotlib_still_prints_the_results(tmp_path):
    path = tmp_path / "two.csv"
    path.write_text(TWO_USERS)
    png = tmp_path / "held.png"
    wrapper = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if matplotlib were not installed
        "from jupyter_gpusched.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrapper, "simulate", "--trace", str(path), "--gpus", "1", "--plot", str(png)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    assert "policy" in done.stdout and all(policy in done.stdout for policy in POLICIES)
    assert "pip install 'jupyter-gpusched[plot]'" in done.stderr and "Traceback" not in done.stderr
    assert not png.exists()


def test_cli_errors_are_sentences(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    path = tmp_path / "big.csv"
    path.write_text("a,,0,10,8,0\n")
    assert main(["simulate", "--trace", str(path), "--gpus", "4"]) == 2
    assert "cannot run this trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(path), "--policy", "greedy"])


# -- the real trace ------------------------------------------------------------------------------
def test_real_trace_on_64_gpus():
    trace = load_trace(real_trace_path())
    results = {policy: simulate(trace, policy, 64) for policy in POLICIES}
    for result in results.values():
        metrics = result.metrics()
        assert set(metrics) == set(METRICS)
        assert 0 < metrics["efficiency"] <= 1
        assert result.gpu_hours_busy == results["oracle"].gpu_hours_busy
        assert result.peak_gpus_held <= 64
        assert result.cell_delay_p50_s <= result.cell_delay_p95_s <= result.cell_delay_p99_s
        assert len(result.delays) == 749
    oracle = results["oracle"]
    assert oracle.gpu_hours_held == pytest.approx(oracle.gpu_hours_busy)
    assert oracle.gpu_hours_busy == pytest.approx(78255 / 60)
    held = {policy: r.gpu_hours_held for policy, r in results.items()}
    assert max(held, key=held.get) == "static"
    assert held["hybrid"] < held["static"]
    assert held["hybrid"] < held["cull"]
    assert results["hybrid"].disruptions == 0
    assert results["cull"].disruptions > 0
    assert trace.static_peak() == 142
    assert trace.busy_peak() == 64
    assert trace.busy_peak(session_level=True) == 68


# -- invariants on random small traces -----------------------------------------------------------


@st.composite
def small_traces(draw):
    """Up to five sessions of up to five cells, with gaps short and long, on 1 to 4 GPUs."""
    lines = []
    for s in range(draw(st.integers(1, 5))):
        gpus = draw(st.sampled_from([1, 1, 2, 4]))
        start = draw(st.integers(0, 3)) * 600
        t = start
        cells = []
        for _ in range(draw(st.integers(1, 5))):
            t += draw(st.sampled_from([0, 30, 120, 900, 4000]))
            duration = draw(st.sampled_from([60, 300, 1200]))
            cells.append((t, duration, draw(st.sampled_from([0, gpus])), draw(st.sampled_from([0, 2.5, 20]))))
            t += duration
        stop = t + draw(st.sampled_from([0, 600, 7200]))
        for at, duration, cell_gpus, vram in cells:
            lines.append(f"s{s},u{s},{at},{duration},{cell_gpus},{vram},{gpus},{start},{stop}\n")
    return parse_csv("".join(lines))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trace=small_traces(), spare=st.integers(0, 4))
def test_replay_invariants(trace, spare):
    gpus = trace.largest_claim() + spare
    results = {policy: simulate(trace, policy, gpus) for policy in POLICIES}
    cells = sum(len(s.cells) for s in trace.gpu_sessions)
    for policy, result in results.items():
        assert len(result.delays) == cells, policy
        assert min(result.delays) >= -1e-9, policy
        assert result.peak_gpus_held <= gpus
        assert result.held[-1][1] == 0  # everything is given back in the end
        assert result.gpu_hours_held >= result.gpu_hours_busy - 1e-9, policy
        assert result.restores <= result.suspends
    assert results["oracle"].gpu_hours_held == pytest.approx(results["oracle"].gpu_hours_busy)
    for policy in ("dynamic", "hybrid"):
        assert results[policy].disruptions == 0  # the simulated driver checkpoints
    assert simulate(trace, "hybrid", gpus) == results["hybrid"]
