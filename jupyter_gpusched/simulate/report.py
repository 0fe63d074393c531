"""Showing replay results: a table for people, JSON for programs, a plot of GPUs held."""

from __future__ import annotations

from typing import Mapping

from .results import Result
from .users import worst

_COLUMNS = (
    ("policy", "policy", "<"),
    ("gpu_hours_held", "GPU-h held", ">"),
    ("gpu_hours_busy", "GPU-h busy", ">"),
    ("efficiency", "efficiency", ">"),
    ("cell_delay_p50_s", "delay p50", ">"),
    ("cell_delay_p95_s", "p95", ">"),
    ("cell_delay_p99_s", "p99", ">"),
    ("user_delay_p95_max_s", "worst user p95", ">"),
    ("disruptions", "disruptions", ">"),
    ("suspends", "suspends", ">"),
    ("restores", "restores", ">"),
    ("peak_gpus_held", "peak held", ">"),
    ("peak_checkpoint_host_gb", "checkpoints GB", ">"),
)


#: How each placement rule places a server, for a sentence.
PLACEMENT_WORDS = {
    "hook": "by the spawn hook's rule (the most free, then reclaimable GPUs)",
    "spread": "by Kubernetes' default spreading (the fewest servers)",
}


def as_json(
    results: Mapping[str, Result],
    capacities: Mapping[str, int | None] | None = None,
    every_user: Mapping[str, int | None] | None = None,
) -> dict:
    """One object keyed by policy name, each with the fields of ``results.METRICS`` (and ``capacity``),
    ``users`` (per user: ``cells``, ``p95_s``, ``gpus_at_once``, ``queue_s`` and ``restore_s`` of
    their late cells, ``why``: queue, restores, both or none) and ``worst_user`` (the same, with
    ``user``, for the highest p95).

    On a cluster of nodes each also has ``nodes``, ``gpus_per_node``, ``placement``,
    ``gpu_hours_held_per_node`` and ``sessions_per_node`` (in node order), and ``capacity_nodes``.
    """
    out = {}
    for policy, result in results.items():
        metrics = result.metrics()
        users = {u.user: u for u in result.users}
        metrics["users"] = {name: u.as_json() for name, u in users.items()}
        slowest = worst(users)
        metrics["worst_user"] = None if slowest is None else {"user": slowest.user, **slowest.as_json()}
        if result.gpus_per_node is not None:
            metrics["nodes"] = result.nodes
            metrics["gpus_per_node"] = result.gpus_per_node
            metrics["placement"] = result.placement
            metrics["gpu_hours_held_per_node"] = [round(h, 3) for h in result.node_gpu_hours_held]
            metrics["sessions_per_node"] = list(result.node_sessions)
        if capacities is not None:
            capacity = capacities.get(policy)
            metrics["capacity"] = capacity
            if result.gpus_per_node is not None:
                metrics["capacity_nodes"] = None if capacity is None else capacity // result.gpus_per_node
        if every_user is not None:
            metrics["capacity_every_user"] = every_user.get(policy)
        out[policy] = metrics
    return out


def _cell(name: str, value: object) -> str:
    if value is None:
        return "-"
    if name == "efficiency":
        return f"{value:.1%}"
    if name.endswith("_s"):
        return seconds(float(value))  # type: ignore[arg-type]
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def _span(ordered: list[str]) -> str:
    """The least and the most of values already sorted, as ``least-most`` (one value alone)."""
    if not ordered:
        return "-"
    return ordered[0] if ordered[0] == ordered[-1] else f"{ordered[0]}-{ordered[-1]}"


def seconds(value: float, sep: str = "") -> str:
    """A delay for people: ``3.8s``, ``2.7m``, ``24.0h`` (``sep`` between number and unit)."""
    if value < 100:
        return f"{value:.1f}{sep}s"
    if value < 3600:
        return f"{value / 60:.1f}{sep}m"
    return f"{value / 3600:.1f}{sep}h"


def table(
    results: Mapping[str, Result],
    capacities: Mapping[str, int | None] | None = None,
    every_user: Mapping[str, int | None] | None = None,
) -> str:
    """A fixed-width table, one row per policy."""
    columns = list(_COLUMNS)
    cluster = any(result.gpus_per_node is not None for result in results.values())
    if cluster:
        columns += [("held_per_node", "GPU-h/node", ">"), ("sessions_per_node", "sessions/node", ">")]
    if capacities is not None:
        columns.append(("capacity", "capacity", ">"))
    if every_user is not None:
        columns.append(("capacity_every_user", "every user", ">"))
    rows = [[title for _, title, _ in columns]]
    for policy, result in results.items():
        metrics = result.metrics()
        row = []
        for name, _, _ in columns:
            if name == "policy":
                row.append(policy)
            elif name in ("capacity", "capacity_every_user"):
                found = capacities if name == "capacity" else every_user
                cap = found.get(policy) if found else None
                text = "none" if cap is None else str(cap)
                if cap is not None and result.gpus_per_node:
                    text += f" ({cap // result.gpus_per_node}x{result.gpus_per_node})"
                row.append(text)
            elif name == "held_per_node":
                held = sorted(result.node_gpu_hours_held)
                row.append(_span([f"{h:,.0f}" if held[-1] >= 100 else f"{h:.1f}" for h in held]))
            elif name == "sessions_per_node":
                row.append(_span([str(n) for n in sorted(result.node_sessions)]))
            else:
                row.append(_cell(name, metrics[name]))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for row in rows:
        parts = [
            text.ljust(width) if align == "<" else text.rjust(width)
            for text, width, (_, _, align) in zip(row, widths, columns)
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def worst_users(results: Mapping[str, Result]) -> str:
    """Per policy, the user with the highest p95 and why their late cells waited."""
    lines = []
    for policy, result in results.items():
        slowest = worst({u.user: u for u in result.users})
        if slowest is not None:
            lines.append(f"worst user under {policy}: {slowest.describe()}")
    return "\n".join(lines)


class PlotUnavailable(RuntimeError):
    """The plot cannot be drawn here (matplotlib is not installed); the message says what to do."""


def plot(results: Mapping[str, Result], path: str, title: str = "") -> None:
    """Write a PNG: per policy, GPUs held over time against GPUs busy in that replay."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'jupyter-gpusched[plot]'"
        ) from None

    policies = list(results)
    fig, axes = plt.subplots(
        len(policies), 1, figsize=(11, 1.9 * len(policies) + 0.8), sharex=True, sharey=True, squeeze=False
    )
    for ax, policy in zip(axes[:, 0], policies):
        result = results[policy]
        hx, hy = _steps(result.held)
        bx, by = _steps(result.busy)
        ax.fill_between(bx, by, step="post", color="tab:green", alpha=0.35, linewidth=0, label="GPUs busy")
        ax.step(hx, hy, where="post", color="tab:blue", linewidth=1.0, label="GPUs held")
        ax.axhline(result.gpus, color="grey", linestyle=":", linewidth=0.8)
        eff = result.efficiency
        ax.set_title(
            f"{policy}: {result.gpu_hours_held:,.0f} GPU-h held, "
            f"efficiency {eff:.0%}" if eff is not None else policy,
            fontsize=9,
            loc="left",
        )
        ax.set_ylabel("GPUs")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("hours")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _steps(line: tuple[tuple[float, int], ...]) -> tuple[list[float], list[int]]:
    xs = [t / 3600.0 for t, _ in line]
    ys = [level for _, level in line]
    return xs, ys
