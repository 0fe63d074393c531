"""The simulator on a cluster of nodes: a server is placed on one node, and stays there."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpusched.cli import main
from jupyter_gpusched.simulate import (
    POLICIES,
    ReplayOptions,
    SimulationError,
    find_capacity,
    load_trace,
    meets_target,
    parse_csv,
    simulate,
    simulate_policies,
)
from jupyter_gpusched.simulate import replay as replay_mod
from jupyter_gpusched.simulate.nodes import parse_nodes, spread

HERE = Path(__file__).resolve().parent
TRACE_NAME = "notebookos-adobe-2021-06-01-02.json"
HEADER = "session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s\n"


def nodes(per_node: int, placement: str = "hook") -> ReplayOptions:
    return ReplayOptions(gpus_per_node=per_node, placement=placement)


def busy_trace(seed: int = 1, sessions: int = 30):
    """Sessions of 1, 2 or 4 GPUs with several cells and pauses short and long (checkpoints,
    restores and culls happen), more than a small cluster serves at once."""
    rng = random.Random(seed)
    lines = [HEADER]
    for s in range(sessions):
        gpus = rng.choice((1, 1, 2, 4))
        start = rng.randrange(0, 6) * 1200
        t = start
        cells = []
        for _ in range(rng.randint(1, 4)):
            t += rng.choice((0, 60, 600, 4000))
            duration = rng.choice((120, 600, 1800))
            cells.append((t, duration))
            t += duration
        stop = t + rng.choice((0, 900, 5400))
        for at, duration in cells:
            lines.append(f"s{s},u{s % 7},{at},{duration},{gpus},{rng.choice((2, 20))},{gpus},{start},{stop}\n")
    return parse_csv("".join(lines))


def without_cluster(result):
    return replace(result, nodes=1, gpus_per_node=None, placement=None, node_gpu_hours_held=(), node_sessions=())


def test_parse_nodes():
    assert parse_nodes("8x8") == (8, 8)
    assert parse_nodes(" 4X16 ") == (4, 16)
    for bad in ("8", "8x", "x8", "0x8", "8x0", "8by8", "-1x4"):
        with pytest.raises(ValueError, match="NODESxGPUS"):
            parse_nodes(bad)


@pytest.mark.parametrize("placement", ["hook", "spread"])
def test_kernels_only_ever_get_gpus_of_the_node_their_server_runs_on(monkeypatch, placement):
    passes: list[tuple[frozenset, list]] = []
    real_plan = replay_mod.plan

    def recording_plan(devices, leases, *args, **kwargs):
        result = real_plan(devices, leases, *args, **kwargs)
        grants = [d.lease for d in result.decisions if d.kind == "grant"]
        passes.append((frozenset(d.uuid for d in devices), grants))
        return result

    monkeypatch.setattr(replay_mod, "plan", recording_plan)
    trace = busy_trace()
    for policy in POLICIES:
        passes.clear()
        result = simulate(trace, policy, 16, nodes(4, placement))
        assert result.nodes == 4 and sum(result.node_sessions) == len(trace.gpu_sessions)
        node_of: dict[str, str] = {}
        granted = 0
        for pass_devices, grants in passes:
            assert len(pass_devices) == 4  # each broker schedules its own node's GPUs
            for lease in grants:
                granted += 1
                assert set(lease.devices) <= pass_devices, policy
                node = {uuid.rsplit("-", 1)[0] for uuid in lease.devices}
                assert len(node) == 1, policy
                # Every claim of a kernel (restores and new kernels after a cull too) on one node.
                assert node_of.setdefault(lease.kernel_id, node.pop()) == node_of[lease.kernel_id], policy
        assert granted >= len(trace.gpu_sessions)
        if policy in ("dynamic", "hybrid"):
            assert result.restores > 0  # restores happened, and stayed on the node
        assert sum(result.node_gpu_hours_held) == pytest.approx(result.gpu_hours_held)


def test_one_node_is_one_pool():
    trace = busy_trace(seed=2)
    for policy in POLICIES:
        pool = simulate(trace, policy, 12)
        one = simulate(trace, policy, 12, nodes(12))
        assert (one.nodes, one.gpus_per_node, one.node_sessions) == (1, 12, (len(trace.gpu_sessions),))
        assert one.node_gpu_hours_held == pytest.approx((pool.gpu_hours_held,))
        assert without_cluster(one) == pool, policy


def test_one_node_is_one_pool_on_the_real_trace():
    path = next((f / TRACE_NAME for f in (HERE.parent / "traces", HERE.parent.parent / "shared" / "traces")
                 if (f / TRACE_NAME).exists()), None)
    if path is None:
        pytest.skip(f"{TRACE_NAME} is not beside the checkout")
    trace = load_trace(path)
    for policy in POLICIES:
        assert without_cluster(simulate(trace, policy, 64, nodes(64, "spread"))) == simulate(trace, policy, 64)


# a holds 3 of node-0's 4 GPUs for the hour; b (1 GPU) starts a minute later, c (2 GPUs) two.
PLACED = HEADER + """\
a,ann,0,600,3,10,3,0,3600
b,bob,60,60,1,10,1,60,3600
c,cat,120,60,2,10,2,120,3600
"""


def test_the_hook_places_a_server_on_the_node_with_free_gpus():
    trace = parse_csv(PLACED)
    # b: node-1 has the most free GPUs (and no server). c: node-1 still has 3 free, node-0 one.
    hook = simulate(trace, "static", 8, nodes(4, "hook"))
    assert hook.node_sessions == (1, 2)
    assert hook.delays == (0.0, 0.0, 0.0)
    # Spreading counts servers, not GPUs: one each, so c goes to node-0 in turn, and waits there
    # for a's GPUs although node-1 has 3 free.
    spreading = simulate(trace, "static", 8, nodes(4, "spread"))
    assert spreading.node_sessions == (2, 1)
    assert spreading.delays == (0.0, 0.0, 3600.0 - 120.0)


def test_spread_takes_the_fewest_servers_then_turns():
    assert spread([2, 1, 1], last=0) == 1
    assert spread([2, 1, 1], last=1) == 2
    assert spread([1, 1, 1], last=2) == 0
    assert spread([0, 3], last=0) == 0


def test_cluster_replays_are_deterministic_and_the_same_in_parallel():
    trace = busy_trace(seed=3)
    for placement in ("hook", "spread"):
        options = nodes(4, placement)
        parallel = simulate_policies(trace, POLICIES, 16, options, processes=2, progress=False)
        for policy in POLICIES:
            assert parallel[policy] == simulate(trace, policy, 16, options) == simulate(trace, policy, 16, options)


def test_a_node_too_small_for_a_session_is_refused():
    trace = parse_csv(PLACED)
    with pytest.raises(SimulationError, match="nodes of 2 GPUs cannot run this trace: a session asks for 3"):
        simulate(trace, "oracle", 8, nodes(2))
    with pytest.raises(SimulationError, match="not a whole number of nodes"):
        simulate(trace, "static", 10, nodes(4))


def test_capacity_is_found_in_whole_nodes():
    trace = busy_trace(seed=4)
    options = nodes(4, "spread")
    found = find_capacity(trace, "hybrid", options)
    assert found is not None and found % 4 == 0
    assert meets_target(trace, "hybrid", found, options)
    if found > 4:
        assert not meets_target(trace, "hybrid", found - 4, options)


def test_cli_nodes_in_json_and_table(tmp_path, capsys):
    path = tmp_path / "placed.csv"
    path.write_text(PLACED)
    assert main(["simulate", "--trace", str(path), "--nodes", "2x4", "--policy", "static", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["static"]
    assert (out["nodes"], out["gpus_per_node"], out["placement"]) == (2, 4, "hook")
    assert out["sessions_per_node"] == [1, 2]
    assert sum(out["gpu_hours_held_per_node"]) == pytest.approx(out["gpu_hours_held"], abs=0.01)
    argv = ["simulate", "--trace", str(path), "--nodes", "2x4", "--placement", "spread", "--find-capacity"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2 nodes of 4 GPUs (8 in all)" in text and "Kubernetes' default spreading" in text
    assert "GPU-h/node" in text and "sessions/node" in text
    assert "fewest nodes of 4" in text
    # Capacity in whole nodes. Spread puts c beside a (one server each), where a's 3 GPUs leave
    # it 1: c's cell waits for a's to end, unless a third node takes c.
    oracle = next(line for line in text.splitlines() if line.startswith("oracle"))
    assert oracle.rstrip().endswith("12 (3x4)")
    # The hook puts c where 2 GPUs are free: two nodes do.
    assert main(["simulate", "--trace", str(path), "--nodes", "2x4", "--policy", "oracle", "--find-capacity"]) == 0
    oracle = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("oracle"))
    assert oracle.rstrip().endswith("8 (2x4)")


def test_cli_nodes_mistakes_are_sentences(tmp_path, capsys):
    path = tmp_path / "placed.csv"
    path.write_text(PLACED)
    assert main(["simulate", "--trace", str(path), "--nodes", "2x4", "--gpus", "16"]) == 2
    assert "--gpus 16 and --nodes 2x4 (8 GPUs) disagree" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(path), "--placement", "spread"]) == 2
    assert "give --nodes too" in capsys.readouterr().err
    assert main(["simulate", "--trace", str(path), "--nodes", "4x2"]) == 2
    assert "nodes of 2 GPUs cannot run this trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(path), "--nodes", "8by8"])
    assert "NODESxGPUS" in capsys.readouterr().err


@st.composite
def small_clusters(draw):
    """Up to six sessions of up to four cells on two or three nodes, placed either way."""
    lines = [HEADER]
    for s in range(draw(st.integers(1, 6))):
        gpus = draw(st.sampled_from([1, 1, 2, 4]))
        start = t = draw(st.integers(0, 3)) * 600
        cells = []
        for _ in range(draw(st.integers(1, 4))):
            t += draw(st.sampled_from([0, 120, 900, 4000]))
            duration = draw(st.sampled_from([60, 600, 1800]))
            cells.append((t, duration, draw(st.sampled_from([0, gpus]))))
            t += duration
        stop = t + draw(st.sampled_from([0, 600, 7200]))
        lines += [f"s{s},u{s % 3},{at},{d},{g},20,{gpus},{start},{stop}\n" for at, d, g in cells]
    trace = parse_csv("".join(lines))
    per_node = trace.largest_claim() + draw(st.integers(0, 2))
    return trace, draw(st.integers(2, 3)), per_node, draw(st.sampled_from(["hook", "spread"]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=small_clusters())
def test_cluster_replay_invariants(case):
    trace, count, per_node, placement = case
    options = nodes(per_node, placement)
    cells = sum(len(s.cells) for s in trace.gpu_sessions)
    for policy in POLICIES:
        result = simulate(trace, policy, count * per_node, options)
        assert len(result.delays) == cells and min(result.delays) >= -1e-9, policy
        assert result.held[-1][1] == 0  # everything is given back in the end
        assert result.peak_gpus_held <= count * per_node
        assert sum(result.node_sessions) == len(trace.gpu_sessions)
        assert sum(result.node_gpu_hours_held) == pytest.approx(result.gpu_hours_held)
        if policy == "oracle":
            assert result.gpu_hours_held == pytest.approx(result.gpu_hours_busy)
        if policy in ("dynamic", "hybrid"):
            assert result.disruptions == 0  # the simulated driver checkpoints
