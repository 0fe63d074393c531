"""The evidence rule: when the broker counts a server's word that its kernel is busy.

A single-user server may be hostile. Its word that a kernel runs a cell would, believed alone,
keep that kernel's GPU for ever. So the word counts only while the broker has seen the kernel's
processes use CPU or a GPU within :data:`EVIDENCE_WINDOW` seconds, only while the server is
connected, and, while the GPU is not used, for at most ``max_busy_without_gpu`` seconds of claimed
activity. The times the server reports are capped by what was seen: a server cannot make a kernel
look active later than its processes were.

:func:`weigh` is the whole rule, pure: the word, what was seen, and the clock in; the verdict out.
:class:`~jupyter_gpusched.hub.remote.RemoteKernels` gathers the observations (process samples,
NVML's utilization) and keeps the verdict's ``gpu_seen_at`` and ``claimed_since`` for the next look.
"""

from __future__ import annotations

from dataclasses import dataclass

#: How long one piece of evidence (CPU or GPU use) backs a server's word that a kernel is busy.
EVIDENCE_WINDOW = 30.0


@dataclass(frozen=True)
class Word:
    """What the kernel's server says (seconds since the epoch)."""

    busy: bool = False
    last_busy_at: float | None = None
    started_at: float | None = None
    #: When the server last asked for a GPU for the kernel (a claim is a word of activity too).
    last_claim_at: float | None = None


@dataclass(frozen=True)
class Seen:
    """What the broker saw of the kernel's processes (seconds since the epoch)."""

    cpu_seen_at: float | None = None
    gpu_seen_at: float | None = None
    #: Whether one of its processes uses a GPU above the utilization threshold now.
    gpu_now: bool = False
    #: Since when the server has claimed activity without GPU use (None: it does not now).
    claimed_since: float | None = None


@dataclass(frozen=True)
class Verdict:
    busy: bool
    #: The server's last_busy_at, capped by the evidence (None: nothing backs it).
    last_busy_at: float | None
    #: When the running cell started, for a kernel counted busy only.
    started_at: float | None
    #: What to remember for the next look.
    gpu_seen_at: float | None
    claimed_since: float | None
    #: Why the server's "busy" was not believed (None: it was, or it did not say busy).
    doubt: str | None = None


def weigh(
    word: Word,
    seen: Seen,
    *,
    connected: bool,
    now: float,
    heartbeat_timeout: float,
    max_busy_without_gpu: float,
    window: float = EVIDENCE_WINDOW,
) -> Verdict:
    """Whether the kernel counts as busy, and the activity times the scheduler may use."""
    gpu_seen_at, claimed_since = seen.gpu_seen_at, seen.claimed_since
    if seen.gpu_now:
        gpu_seen_at, claimed_since = now, None
    evidence = max(seen.cpu_seen_at or 0.0, gpu_seen_at or 0.0) or None
    claiming = word.last_claim_at is not None and now - word.last_claim_at <= heartbeat_timeout
    if not claiming:
        claimed_since = None
    elif claimed_since is None and (gpu_seen_at is None or now - gpu_seen_at > window):
        claimed_since = now
    over = claimed_since is not None and now - claimed_since > max_busy_without_gpu
    busy = word.busy and connected and evidence is not None and now - evidence <= window and not over
    last = word.last_busy_at
    if last is not None:
        last = min(last, evidence) if evidence is not None else None
    if last is not None and over:
        last = min(last, claimed_since + max_busy_without_gpu)
    doubt = None
    if word.busy and connected and not busy:
        doubt = "without GPU use for longer than max_busy_without_gpu" if over else "but its processes are not running"
    return Verdict(
        busy=busy,
        last_busy_at=last,
        started_at=word.started_at if busy else None,
        gpu_seen_at=gpu_seen_at,
        claimed_since=claimed_since,
        doubt=doubt,
    )
