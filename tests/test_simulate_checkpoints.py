"""The simulator's checkpoints: what they cost in time and in host memory, and the budget."""

from __future__ import annotations

import json

import pytest

from jupyter_gpusched.cli import main
from jupyter_gpusched.core import SchedConfig
from jupyter_gpusched.simulate import ReplayOptions, load_trace, parse_csv, simulate
from test_simulate import TWO_USERS, real_trace_path

# Alice holds the GPU with 20 GB on it and goes idle; bob's cell comes 30 s after hers ends.
BIG = TWO_USERS.replace("a,alice,0,600,1,10", "a,alice,0,600,1,20")


def test_a_checkpoint_over_the_budget_is_not_taken_and_the_ladder_goes_on():
    roomy = simulate(parse_csv(BIG), "hybrid", 1)
    assert (roomy.suspends, roomy.disruptions) == (1, 0)
    assert roomy.peak_checkpoint_host_gb == pytest.approx(20.0)

    tight = simulate(parse_csv(BIG), "hybrid", 1, ReplayOptions(config=SchedConfig(checkpoint_host_memory=10 * 10**9)))
    # 20 GB do not fit in 10: the next step, a restart after the 60 s notice, frees the GPU.
    assert (tight.suspends, tight.disruptions) == (0, 1)
    assert tight.peak_checkpoint_host_gb == 0.0
    assert tight.delays[1] == pytest.approx(660 + 60 - 630)


def test_a_multi_gpu_checkpoint_moves_each_gpus_share_at_once():
    trace = parse_csv(
        "session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s\n"
        "a,alice,0,600,4,40,4,0,3600\n"
        "b,bob,630,600,4,10,4,630,3600\n"
    )
    result = simulate(trace, "hybrid", 4)
    # 40 GB over 4 GPUs: 10 GB per GPU at 2 GB/s, plus 2.7 s.
    assert result.delays[1] == pytest.approx(660 + 5 + 2.7 - 630)


def test_the_worst_users_p95_is_reported_beside_everyones():
    trace = parse_csv(
        "session,user,start_s,duration_s,gpus,vram_gb,session_gpus,session_start_s,session_stop_s\n"
        "a,alice,0,600,1,0,1,0,1300\n"
        "b,bob,60,600,1,0,1,60,1300\n"
        "c,carol,5000,60,1,0,1,5000,5200\n"
        "c,carol,5100,60,1,0,1,5000,5200\n"
    )
    result = simulate(trace, "static", 1)
    # Static: bob waits for alice's kernel to end at 1300 s; carol never waits.
    assert result.delays == (0.0, 1240.0, 0.0, 0.0)
    assert result.user_delay_p95_max_s == pytest.approx(1240.0)
    assert result.cell_delay_p95_s < result.user_delay_p95_max_s


def test_on_the_notebookos_trace_checkpoints_never_hold_more_than_the_budget():
    trace = load_trace(str(real_trace_path()))
    budget_gb = 40
    options = ReplayOptions(config=SchedConfig(checkpoint_host_memory=budget_gb * 10**9))
    tight = simulate(trace, "hybrid", 68, options)
    free = simulate(trace, "hybrid", 68)
    assert free.peak_checkpoint_host_gb > budget_gb, "the trace must need more than the budget"
    assert 0 < tight.peak_checkpoint_host_gb <= budget_gb
    assert tight.suspends < free.suspends


def test_cli_budget_and_costs_reach_the_json(tmp_path, capsys):
    path = tmp_path / "big.csv"
    path.write_text(BIG)
    assert main(["simulate", "--trace", str(path), "--gpus", "1", "--policy", "hybrid", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["hybrid"]
    assert out["peak_checkpoint_host_gb"] == 20.0
    assert out["user_delay_p95_max_s"] == pytest.approx(660 + 20 / 2 + 2.7 - 630)
    assert main(["simulate", "--trace", str(path), "--gpus", "1", "--policy", "hybrid", "--json",
                 "--checkpoint-host-memory", "10"]) == 0
    out = json.loads(capsys.readouterr().out)["hybrid"]
    assert out["peak_checkpoint_host_gb"] == 0.0 and out["disruptions"] == 1
    assert main(["simulate", "--trace", str(path), "--gpus", "1", "--policy", "hybrid", "--json",
                 "--checkpoint-bandwidth", "20", "--checkpoint-fixed", "0"]) == 0
    out = json.loads(capsys.readouterr().out)["hybrid"]
    assert out["user_delay_p95_max_s"] == pytest.approx(660 + 1 - 630)


@pytest.mark.parametrize("bad", [["--bandwidth", "0"], ["--restore-bandwidth", "-1"], ["--checkpoint-host-memory", "x"]])
def test_cli_refuses_bad_costs(tmp_path, capsys, bad):
    path = tmp_path / "big.csv"
    path.write_text(BIG)
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--trace", str(path), "--gpus", "1", *bad])
    assert exc.value.code == 2
    assert "expected" in capsys.readouterr().err
