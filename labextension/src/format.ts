/**
 * Pure helpers: formatting sizes, times and percentages, and reading the status
 * (the lease of a kernel, the holders of a device, a queue position).
 *
 * Nothing here touches the DOM, the network or the clock: time is passed in (milliseconds
 * since the epoch, as `Date.now()` gives).
 */
import type {
  ICheckpointInfo,
  IDevice,
  IdleStep,
  ILease,
  IQueueEntry,
  IStatus,
  IUserUsage,
  LeaseState
} from './api';

/** What is shown where a value is unknown. */
export const UNKNOWN = 'n/a';

const BYTE_UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

function unitOf(bytes: number): number {
  let unit = 0;
  let value = Math.abs(bytes);
  while (value >= 1024 && unit < BYTE_UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return unit;
}

function inUnit(bytes: number, unit: number, digits: number): string {
  if (unit === 0) {
    return `${Math.round(bytes)}`;
  }
  return (bytes / Math.pow(1024, unit)).toFixed(digits);
}

/** `85899345920` -> `"80.0 GiB"`; `null` -> `"n/a"`. Binary units. */
export function formatBytes(
  bytes: number | null | undefined,
  digits = 1
): string {
  if (bytes === null || bytes === undefined || !Number.isFinite(bytes)) {
    return UNKNOWN;
  }
  const unit = unitOf(bytes);
  return `${inUnit(bytes, unit, digits)} ${BYTE_UNITS[unit]}`;
}

/** Used and total memory in the total's unit: `"12.3 / 80.0 GiB"`. */
export function formatMemory(
  used: number | null | undefined,
  total: number | null | undefined,
  digits = 1
): string {
  if (total === null || total === undefined || !Number.isFinite(total)) {
    return `${formatBytes(used, digits)} / ${UNKNOWN}`;
  }
  const unit = unitOf(total);
  const usedText =
    used === null || used === undefined || !Number.isFinite(used)
      ? '?'
      : inUnit(used, unit, digits);
  return `${usedText} / ${inUnit(total, unit, digits)} ${BYTE_UNITS[unit]}`;
}

/** `42.4` -> `"42%"`, clamped to 0-100; `null` -> `"n/a"`. */
export function formatPercent(
  value: number | null | undefined,
  digits = 0
): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return UNKNOWN;
  }
  return `${clampPercent(value).toFixed(digits)}%`;
}

/** Clamp a percentage to 0-100 (`null` stays `null`). */
export function clampPercent(value: number): number;
export function clampPercent(value: number | null | undefined): number | null;
export function clampPercent(value: number | null | undefined): number | null {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return null;
  }
  return Math.min(100, Math.max(0, value));
}

/** Share of `total` that `used` is, in percent (0-100), or `null` when unknown. */
export function percentOf(
  used: number | null | undefined,
  total: number | null | undefined
): number | null {
  if (
    used === null ||
    used === undefined ||
    total === null ||
    total === undefined ||
    !(total > 0)
  ) {
    return null;
  }
  return clampPercent((used / total) * 100);
}

function pad2(value: number): string {
  return value < 10 ? `0${value}` : `${value}`;
}

/**
 * A human duration: `45` -> `"45s"`, `252` -> `"4m 12s"`, `3900` -> `"1h 05m"`,
 * `183600` -> `"2d 3h"`. Negative durations read as `"0s"`.
 */
export function formatDuration(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return UNKNOWN;
  }
  const total = Math.max(0, Math.floor(seconds));
  const days = Math.floor(total / 86400);
  const hours = Math.floor((total % 86400) / 3600);
  const minutes = Math.floor((total % 3600) / 60);
  const secs = total % 60;
  if (days > 0) {
    return `${days}d ${hours}h`;
  }
  if (hours > 0) {
    return `${hours}h ${pad2(minutes)}m`;
  }
  if (minutes > 0) {
    return `${minutes}m ${pad2(secs)}s`;
  }
  return `${secs}s`;
}

/**
 * A countdown clock: `59.2` -> `"1:00"` (rounded up, so it reaches 0:00 only at the moment),
 * `3723` -> `"1:02:03"`; the past reads `"0:00"`.
 */
export function formatCountdown(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return UNKNOWN;
  }
  const total = Math.max(0, Math.ceil(seconds));
  const hours = Math.floor(total / 3600);
  const minutes = Math.floor((total % 3600) / 60);
  const secs = total % 60;
  if (hours > 0) {
    return `${hours}:${pad2(minutes)}:${pad2(secs)}`;
  }
  return `${minutes}:${pad2(secs)}`;
}

/** How long a keep lasts, for a button: `1800` -> `"30 min"`, `3600` -> `"1 h"`. */
export function keepLabel(seconds: number): string {
  if (seconds >= 3600 && seconds % 3600 === 0) {
    return `${seconds / 3600} h`;
  }
  return `${Math.max(1, Math.round(seconds / 60))} min`;
}

/** Milliseconds since the epoch of an ISO 8601 time, or `null`. */
export function parseTime(iso: string | null | undefined): number | null {
  if (!iso) {
    return null;
  }
  const ms = Date.parse(iso);
  return Number.isNaN(ms) ? null : ms;
}

/** Seconds from `nowMs` until `iso` (negative once past), or `null`. */
export function secondsUntil(
  iso: string | null | undefined,
  nowMs: number
): number | null {
  const ms = parseTime(iso);
  return ms === null ? null : (ms - nowMs) / 1000;
}

/** Seconds from `iso` until `nowMs`, or `null`. */
export function secondsSince(
  iso: string | null | undefined,
  nowMs: number
): number | null {
  const ms = parseTime(iso);
  return ms === null ? null : (nowMs - ms) / 1000;
}

/** The last path segment: `"work/Train.ipynb"` -> `"Train.ipynb"`. */
export function baseName(path: string): string {
  const parts = path.split('/').filter(part => part.length > 0);
  return parts.length > 0 ? parts[parts.length - 1] : path;
}

/** `"NVIDIA A100-SXM4-80GB"` -> `"A100-SXM4-80GB"`. */
export function shortDeviceName(name: string): string {
  return name.replace(/^NVIDIA\s+/i, '');
}

/** States in which a lease holds devices. */
export const HOLDING_STATES: ReadonlyArray<LeaseState> = [
  'active',
  'idle',
  'reclaiming'
];

/** Whether a lease in `state` holds devices. */
export function isHolding(state: LeaseState): boolean {
  return HOLDING_STATES.indexOf(state) >= 0;
}

/** Rank of a state when several leases name one kernel: a live lease wins over an old one. */
function stateRank(state: LeaseState): number {
  switch (state) {
    case 'active':
    case 'idle':
    case 'reclaiming':
      return 3;
    case 'suspended':
      return 2;
    case 'pending':
      return 1;
    default:
      return 0;
  }
}

/**
 * The lease of a kernel: the one that holds devices, else a suspended or pending one; among
 * equals the most recently granted. Released leases do not count. `null` if none.
 */
export function leaseOfKernel(
  status: IStatus | null,
  kernelId: string | null | undefined
): ILease | null {
  if (!status || !kernelId) {
    return null;
  }
  let best: ILease | null = null;
  for (const lease of status.leases) {
    if (lease.kernel_id !== kernelId || lease.state === 'released') {
      continue;
    }
    if (best === null) {
      best = lease;
      continue;
    }
    const rank = stateRank(lease.state) - stateRank(best.state);
    const newer =
      (parseTime(lease.granted_at) ?? 0) > (parseTime(best.granted_at) ?? 0);
    if (rank > 0 || (rank === 0 && newer)) {
      best = lease;
    }
  }
  return best;
}

/** The devices a lease names, in index order (unknown UUIDs are skipped). */
export function devicesOfLease(
  status: IStatus | null,
  lease: ILease
): IDevice[] {
  if (!status) {
    return [];
  }
  return status.devices
    .filter(device => lease.devices.indexOf(device.uuid) >= 0)
    .sort((a, b) => a.index - b.index);
}

/** Device indices of a lease: from the lease, else from its devices. */
export function deviceIndicesOf(
  status: IStatus | null,
  lease: ILease
): number[] {
  if (lease.device_indices && lease.device_indices.length > 0) {
    return [...lease.device_indices].sort((a, b) => a - b);
  }
  return devicesOfLease(status, lease).map(device => device.index);
}

/** The leases that hold a device now (by the lease's devices or the device's lease ids). */
export function holdersOfDevice(
  status: IStatus | null,
  device: IDevice
): ILease[] {
  if (!status) {
    return [];
  }
  return status.leases.filter(
    lease =>
      isHolding(lease.state) &&
      (lease.devices.indexOf(device.uuid) >= 0 ||
        device.lease_ids.indexOf(lease.id) >= 0)
  );
}

/** Processes on a device that belong to no lease. */
export function unleasedProcesses(device: IDevice): IDevice['processes'] {
  return (device.processes ?? []).filter(process => !process.kernel_id);
}

/** 1-based queue position of a pending lease, from the queue or the lease; else `null`. */
export function queuePosition(
  status: IStatus | null,
  lease: ILease
): number | null {
  if (lease.state !== 'pending') {
    return null;
  }
  const entry = status?.queue.find(item => item.lease_id === lease.id);
  if (entry) {
    return entry.position;
  }
  return lease.position ?? null;
}

/** Memory of a lease: what its kernel uses on its devices, and what it may use. */
export interface ILeaseMemory {
  /** Bytes the kernel's processes hold; the device's usage for an exclusive lease when the
   * driver does not say per process; `null` when unknown. */
  used: number | null;
  /** Bytes the lease may use: its per-GPU memory for shared leases, whole GPUs otherwise. */
  total: number | null;
}

/** Memory used and granted for a lease, summed over its devices. */
export function leaseMemory(
  status: IStatus | null,
  lease: ILease
): ILeaseMemory {
  const devices = devicesOfLease(status, lease);
  if (devices.length === 0) {
    return { used: null, total: null };
  }
  let total = 0;
  let used = 0;
  let usedKnown = true;
  for (const device of devices) {
    total += lease.memory ?? device.memory_total;
    const own = lease.kernel_id
      ? (device.processes ?? []).filter(
          process => process.kernel_id === lease.kernel_id
        )
      : [];
    const ownKnown = own.filter(process => process.memory_used !== null);
    // Where the server lists the GPU's processes, the kernel's own are what it uses: memory of
    // a process outside the lease is not the lease's.
    const listed = (device.processes ?? []).some(
      process => process.memory_used !== null
    );
    if (ownKnown.length > 0 || listed) {
      used += ownKnown.reduce(
        (sum, process) => sum + (process.memory_used ?? 0),
        0
      );
    } else if (lease.mode === 'exclusive' && device.memory_used !== null) {
      used += device.memory_used;
    } else {
      usedKnown = false;
    }
  }
  return { used: usedKnown ? used : null, total };
}

/** Seconds until a lease is reclaimed, or `null` if no reclaim is scheduled. */
export function reclaimCountdown(lease: ILease, nowMs: number): number | null {
  if (!isHolding(lease.state)) {
    return null;
  }
  return secondsUntil(lease.reclaim_at, nowMs);
}

/** Seconds a lease stays kept, or `null` if it is not kept now. */
export function keepRemaining(lease: ILease, nowMs: number): number | null {
  const seconds = secondsUntil(lease.keep_until, nowMs);
  return seconds !== null && seconds > 0 ? seconds : null;
}

/**
 * How long an idle lease has been idle: from `last_active_at` where sent, else the
 * server's `idle_seconds`. `null` unless the lease is idle or being reclaimed.
 */
export function idleSeconds(lease: ILease, nowMs: number): number | null {
  if (lease.state !== 'idle' && lease.state !== 'reclaiming') {
    return null;
  }
  const since = secondsSince(lease.last_active_at, nowMs);
  if (since !== null) {
    return Math.max(0, since);
  }
  return lease.idle_seconds ?? null;
}

/** A short name for the notebook or kernel a lease serves. */
export function leaseLabel(lease: ILease, kernelPath?: string | null): string {
  const path = lease.notebook || kernelPath;
  if (path) {
    return baseName(path);
  }
  return kernelLabel(lease.kernel_id);
}

/** `"kernel 01234567"` for a kernel id; `"a hidden kernel"` when not shown. */
export function kernelLabel(kernelId: string | null | undefined): string {
  return kernelId ? `kernel ${kernelId.slice(0, 8)}` : 'a hidden kernel';
}

/**
 * How long a "Keep" keeps: what is wanted, within the server's `max_keep` when it says.
 */
export function effectiveKeepSeconds(
  status: IStatus | null,
  wanted: number
): number {
  const max = status?.config?.max_keep;
  return typeof max === 'number' && max > 0 ? Math.min(wanted, max) : wanted;
}

/** Who holds a lease as this user may see it. */
export function holderOf(lease: ILease): string {
  return lease.holder || lease.user || 'unknown user';
}

/** `[0]` -> `"GPU 0"`, `[0, 1]` -> `"GPUs 0, 1"`, `[]` -> `"GPU"`. */
export function formatDeviceIndices(indices: number[]): string {
  if (indices.length === 0) {
    return 'GPU';
  }
  return `${indices.length > 1 ? 'GPUs' : 'GPU'} ${indices.join(', ')}`;
}

/** Human words for a lease state. */
export function stateLabel(state: LeaseState): string {
  switch (state) {
    case 'pending':
      return 'queued';
    case 'reclaiming':
      return 'being reclaimed';
    default:
      return state;
  }
}

/** What a reclaim step does, as a verb for "... in 5m": `checkpoint` -> `"suspend"`. */
export function idleStepVerb(step: IdleStep | null): string {
  switch (step) {
    case 'release':
      return 'release';
    case 'checkpoint':
      return 'suspend';
    case 'free-cache':
    case 'free_cache':
      return 'free cache';
    case 'restart':
      return 'restart';
    case 'shutdown':
      return 'shut down';
    default:
      return 'reclaim';
  }
}

/** What a reclaim step does to the kernel, in a few words for a sentence. */
function idleStepEffect(step: IdleStep | null): string {
  switch (step) {
    case 'release':
      return 'its GPU is released (it holds no GPU memory)';
    case 'checkpoint':
      return 'its GPU state is suspended to host memory (variables kept)';
    case 'free-cache':
    case 'free_cache':
      return 'its cached GPU memory is freed';
    case 'restart':
      return 'the kernel is restarted (variables lost)';
    case 'shutdown':
      return 'the kernel is shut down (variables lost)';
    default:
      return 'its GPU is taken back';
  }
}

/** What idle will do to a lease, for the status bar and the sidebar. */
export interface IIdleOutlook {
  /** A few words: `"suspend in 55m 48s"`; `null` when idle takes nothing back. */
  short: string | null;
  /** For the sidebar: `"If idle: suspend in 55m 48s, in 1m 00s if someone waits"`. */
  brief: string;
  /** One sentence: when, by which step, and what happens sooner if someone waits. */
  sentence: string;
  /** Seconds until the step that applies now (contended when someone waits), or `null`. */
  seconds: number | null;
}

/**
 * What idle will do to a holding lease, from the server's `idle_forecast`: the step and when
 * (if the kernel stays idle; sooner when someone waits). `null` when the server foresees
 * nothing, when the lease does not hold GPUs, or when a reclaim is already announced.
 */
export function idleOutlook(
  lease: ILease,
  nowMs: number,
  someoneWaits = false
): IIdleOutlook | null {
  const forecast = lease.idle_forecast;
  if (!forecast || !isHolding(lease.state) || lease.reclaim_at) {
    return null;
  }
  const kept = keepRemaining(lease, nowMs);
  const alone = secondsUntil(forecast.at, nowMs);
  const contended = secondsUntil(forecast.contended_at, nowMs);
  const verb = idleStepVerb(forecast.step);
  const when = (seconds: number): string =>
    seconds <= 0 ? 'now' : `in ${formatDuration(seconds)}`;
  if (forecast.step === null || (alone === null && contended === null)) {
    return {
      short: null,
      brief: 'If idle: kept until released',
      sentence:
        kept !== null
          ? `Kept: not taken back while idle for ${formatDuration(kept)}.`
          : 'Not taken back while idle; it stays until released.',
      seconds: null
    };
  }
  const effect = idleStepEffect(forecast.step);
  const waiter =
    forecast.contended_by === 'same_user'
      ? 'another kernel of yours waits for a GPU'
      : 'someone waits for a GPU';
  const parts: string[] = [];
  if (alone !== null) {
    parts.push(`If this kernel stays idle, ${effect} ${when(alone)}`);
    if (contended !== null && contended < alone) {
      parts.push(`, or ${when(contended)} if ${waiter}`);
    }
  } else if (contended !== null) {
    parts.push(
      `If this kernel stays idle while ${waiter}, ${effect} ${when(contended)}`
    );
  }
  const sentence = `${parts.join('')}.`;
  const someone =
    forecast.contended_by === 'same_user'
      ? 'another kernel of yours'
      : 'someone';
  let brief: string;
  if (
    someoneWaits &&
    contended !== null &&
    (alone === null || contended < alone)
  ) {
    // Someone waits now: the sooner time is the one that applies.
    brief = `If idle: ${verb} ${when(contended)} (${someone} waits)`;
  } else if (alone !== null) {
    brief = `If idle: ${verb} ${when(alone)}`;
    if (contended !== null && contended < alone) {
      brief += `, ${when(contended)} if ${someone} waits`;
    }
  } else {
    brief = `If idle while ${someone} waits: ${verb} ${when(contended ?? 0)}`;
  }
  const candidates = [alone, someoneWaits ? contended : null].filter(
    (value): value is number => value !== null
  );
  const seconds = candidates.length > 0 ? Math.min(...candidates) : null;
  return {
    short:
      seconds === null
        ? null
        : seconds <= 0
          ? `${verb} now`
          : `${verb} in ${formatDuration(seconds)}`,
    brief,
    sentence,
    seconds
  };
}

/**
 * Whether a kernelspec's metadata selects `gpusched-provisioner` with lazy binding (its
 * default): the kernel asks for its GPU when its first cell runs.
 */
export function bindsLazily(metadata: unknown): boolean {
  const provisioner = isRecord(metadata)
    ? metadata.kernel_provisioner
    : undefined;
  if (
    !isRecord(provisioner) ||
    provisioner.provisioner_name !== 'gpusched-provisioner'
  ) {
    return false;
  }
  const bind = isRecord(provisioner.config)
    ? provisioner.config.bind
    : undefined;
  return bind === undefined || bind === 'lazy';
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** How the kernel of a status bar item gets its GPUs. */
export interface IKernelBinding {
  /** The kernel binds lazily: its first cell asks for a GPU. */
  lazy?: boolean;
  /** The kernel's last lease that ended, as the server said it ended (its `reason`). */
  ended?: ILease | null;
}

/**
 * How a kernel's lease ended, from the reason the server gave: the kernel gave it back itself
 * (`%gpu release`, `gpu.release()`: it asks for none again by itself), the kernel was restarted
 * or shut down to free its GPU (a new kernel process, or none), or the GPU was taken back
 * another way (released while idle, by someone else, lost: the kernel asks again before its
 * next cell).
 */
export type LeaseEnd = 'self' | 'restart' | 'shutdown' | 'taken';

/** How `lease` (released) ended: see `LeaseEnd`. */
export function leaseEnd(lease: Pick<ILease, 'reason'>): LeaseEnd {
  const reason = lease.reason ?? '';
  if (/^released by kernel\b/.test(reason)) {
    return 'self';
  }
  if (/the kernel was restarted/.test(reason)) {
    return 'restart';
  }
  if (/the kernel was shut down/.test(reason)) {
    return 'shutdown';
  }
  return 'taken';
}

/** What the server said after "reclaimed: the kernel was restarted to free its GPU: ". */
export function endReason(lease: Pick<ILease, 'reason'>): string {
  const reason = lease.reason ?? '';
  const match =
    /^reclaimed: the kernel was (?:restarted|shut down) to free its GPU(?:: )?(.*)$/s.exec(
      reason
    );
  return (match ? match[1] : reason).trim();
}

/** What the status bar shows for one kernel. */
export interface IKernelSummary {
  /** The one-line text. */
  text: string;
  /** A longer description, for the tooltip and the accessible name. */
  description: string;
  /** `none`, `lazy` (a GPU comes at the first cell), `unavailable`, `loading` or the lease state. */
  state: LeaseState | 'none' | 'lazy' | 'unavailable' | 'loading';
}

/**
 * The status bar summary of a kernel's GPU lease: `"GPU: none"`, `"GPU: queued #2"`,
 * `"GPU 0: A100 · 12.0 / 80.0 GiB"`, `"GPU 0: A100 · 1.0 / 80.0 GiB · idle 4m 12s"`,
 * `"GPU 0: A100 · reclaim in 0:42"`, `"GPU: suspended"`.
 */
export function summarizeKernel(
  status: IStatus | null,
  lease: ILease | null,
  nowMs: number,
  error: string | null = null,
  binding: IKernelBinding = {}
): IKernelSummary {
  if (!status) {
    if (error) {
      return {
        text: 'GPU: unavailable',
        description: `GPU scheduler unavailable: ${error}`,
        state: 'unavailable'
      };
    }
    return {
      text: 'GPU: …',
      description: 'Loading GPU status',
      state: 'loading'
    };
  }
  if (!lease) {
    const free = status.devices.filter(
      device =>
        device.health === 'ok' && holdersOfDevice(status, device).length === 0
    ).length;
    const host = `${free} of ${status.devices.length} free on this host`;
    const ended = binding.ended ?? null;
    const end = ended ? leaseEnd(ended) : null;
    const gpu =
      ended && (ended.device_indices ?? []).length > 0
        ? formatDeviceIndices(ended.device_indices)
        : null;
    if (end === 'self') {
      return {
        text: 'GPU: none',
        description:
          `This kernel gave its ${gpu || 'GPU'} back and asks for none by itself: ` +
          `run %gpu acquire to get one (${host}).`,
        state: 'none'
      };
    }
    if (end === 'taken') {
      return {
        text: 'GPU: at next cell',
        description:
          `${gpu || 'The GPU'} was taken back${ended?.reason ? ` (${ended.reason})` : ''}; ` +
          `this kernel asks for a GPU again when its next cell runs (${host}).`,
        state: 'lazy'
      };
    }
    if (end === 'restart' && binding.lazy) {
      return {
        text: 'GPU: at first cell',
        description:
          `This kernel was restarted to free ${gpu || 'its GPU'} (its variables were lost); ` +
          `it gets a GPU when its first cell runs (${host}).`,
        state: 'lazy'
      };
    }
    if (binding.lazy) {
      return {
        text: 'GPU: at first cell',
        description: `This kernel gets its GPU when its first cell runs (${host}).`,
        state: 'lazy'
      };
    }
    return {
      text: 'GPU: none',
      description: `This kernel holds no GPU (${host}).`,
      state: 'none'
    };
  }
  if (lease.state === 'pending') {
    const position = queuePosition(status, lease);
    const text = position !== null ? `GPU: queued #${position}` : 'GPU: queued';
    return {
      text,
      description:
        position !== null
          ? `This kernel is waiting for a GPU: position ${position} in the queue.`
          : 'This kernel is waiting for a GPU.',
      state: 'pending'
    };
  }
  if (lease.state === 'suspended') {
    return {
      text: 'GPU: suspended',
      description:
        "This kernel's GPU state is suspended to host memory; it is restored when the next cell runs.",
      state: 'suspended'
    };
  }
  if (lease.state === 'released') {
    return {
      text: 'GPU: none',
      description: 'This kernel holds no GPU.',
      state: 'none'
    };
  }

  const devices = devicesOfLease(status, lease);
  const indices = deviceIndicesOf(status, lease);
  const names = Array.from(
    new Set(devices.map(device => shortDeviceName(device.name)))
  );
  const head = `${formatDeviceIndices(indices)}${names.length > 0 ? `: ${names.join(', ')}` : ''}`;
  const parts = [head];
  const details = [`${head}, lease ${stateLabel(lease.state)}`];

  const reclaimIn = reclaimCountdown(lease, nowMs);
  const kept = keepRemaining(lease, nowMs);
  const idle = idleSeconds(lease, nowMs);
  const memory = leaseMemory(status, lease);
  const outlook = idleOutlook(lease, nowMs, status.queue.length > 0);

  if (reclaimIn !== null) {
    parts.push(`reclaim in ${formatCountdown(reclaimIn)}`);
    details.push(
      `reclaimed in ${formatCountdown(reclaimIn)} unless kept or used`
    );
  } else {
    parts.push(formatMemory(memory.used, memory.total));
    if (idle !== null) {
      parts.push(`idle ${formatDuration(idle)}`);
      if (outlook?.short) {
        parts.push(outlook.short);
      }
    }
  }
  details.push(`memory ${formatMemory(memory.used, memory.total)}`);
  if (idle !== null) {
    details.push(`idle for ${formatDuration(idle)}`);
  }
  if (kept !== null) {
    details.push(`kept for ${formatDuration(kept)} more`);
  }
  const description = `${details.join('; ')}.${outlook ? ` ${outlook.sentence}` : ''}`;
  return { text: parts.join(' · '), description, state: lease.state };
}

// ---------------------------------------------------------------------------------------------
// Fair share: recent usage, queue reasons, memory shares, checkpoint memory

/**
 * `usage_half_life` as the server words it in queue reasons: `86400` -> `"1 day"`,
 * `259200` -> `"3 days"`, else a duration (`43200` -> `"12h 00m"`).
 */
export function formatHalfLife(seconds: number | null | undefined): string {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) {
    return UNKNOWN;
  }
  const days = seconds / 86400;
  if (days >= 1 && Number.isInteger(days)) {
    return `${days} day${days > 1 ? 's' : ''}`;
  }
  return formatDuration(seconds);
}

/** A count of GPUs or GPU-hours, to at most `digits` decimals: `1` -> `"1"`, `0.25` -> `"0.3"`. */
export function formatAmount(
  value: number | null | undefined,
  digits = 1
): string {
  if (value === null || value === undefined || !Number.isFinite(value)) {
    return UNKNOWN;
  }
  const fixed = Math.max(0, value).toFixed(digits);
  return fixed.includes('.') ? fixed.replace(/\.?0+$/, '') : fixed;
}

/** GPU-hours for the usage table: `0.73` -> `"0.7"`, a little above 0 -> `"<0.1"`. */
export function formatGpuHours(hours: number | null | undefined): string {
  if (typeof hours === 'number' && hours > 0 && hours < 0.05) {
    return '<0.1';
  }
  return formatAmount(hours, 1);
}

/** Whether the server tracks recent usage (`usage_half_life` > 0) and sent it. */
export function usageTracked(status: IStatus): boolean {
  const halfLife = status.config?.usage_half_life;
  if (typeof halfLife === 'number' && halfLife <= 0) {
    return false;
  }
  return Array.isArray(status.usage);
}

/** The heading of the recent usage table: `"Recent usage (half-life 1 day)"`. */
export function usageHeading(status: IStatus): string {
  const halfLife = status.config?.usage_half_life;
  return typeof halfLife === 'number' && halfLife > 0
    ? `Recent usage (half-life ${formatHalfLife(halfLife)})`
    : 'Recent usage';
}

/** One row of the recent usage table, as shown. */
export interface IUsageRow {
  user: string;
  /** GPU-hours held recently, decayed. */
  gpuHours: string;
  /** GPUs guaranteed. */
  quota: string;
  /** GPUs' worth held now. */
  held: string;
  /** The viewer's own row. */
  own: boolean;
  /** Whether the user holds more GPUs now than their quota. */
  overQuota: boolean;
  /** The row in words, for a tooltip. */
  title: string;
}

/** The rows of the recent usage table, in the server's order (most GPU-hours first). */
export function usageRows(status: IStatus): IUsageRow[] {
  return (status.usage ?? []).map((entry: IUserUsage) => {
    const own = Boolean(status.user) && entry.user === status.user;
    const gpuHours = formatGpuHours(entry.gpu_hours);
    const quota = formatAmount(entry.quota, 2);
    const held = formatAmount(entry.held, 2);
    return {
      user: entry.user,
      gpuHours,
      quota,
      held,
      own,
      overQuota: entry.held > entry.quota + 1e-9,
      title:
        `${own ? 'You' : entry.user}: ${gpuHours} GPU-hours recently; ` +
        `${quota} GPU${entry.quota === 1 ? '' : 's'} guaranteed; ` +
        `${held === '0' ? 'no GPU' : `${held} GPU${entry.held === 1 ? '' : 's'}`} held now`
    };
  });
}

/**
 * Why a queued claim stands where it does: the queue entry's reason, or the pending lease's
 * (lease events keep that one current); empty where the server does not say.
 */
export function queueReason(
  entry: IQueueEntry,
  lease: ILease | null | undefined
): string {
  if (lease && lease.state === 'pending' && lease.reason) {
    return lease.reason;
  }
  return entry.reason ?? '';
}

/**
 * How much host memory checkpoints hold against `checkpoint_host_memory`:
 * `"Checkpoints hold 12.0 GiB of 64.0 GiB host memory"`, or `null` where checkpoints are not
 * available or the server does not say.
 */
export function checkpointMemoryLine(
  checkpoint: ICheckpointInfo | null | undefined
): string | null {
  if (!checkpoint || !checkpoint.available) {
    return null;
  }
  const held = checkpoint.host_memory_held;
  const budget = checkpoint.host_memory_budget;
  if (typeof held !== 'number' && budget === undefined) {
    return null;
  }
  const heldText = formatBytes(held ?? 0);
  if (typeof budget === 'number') {
    return `Checkpoints hold ${heldText} of ${formatBytes(budget)} host memory`;
  }
  return `Checkpoints hold ${heldText} host memory (no limit)`;
}

/** Whether checkpoints hold their whole host memory budget (`held >= budget`). */
export function checkpointMemoryFull(
  checkpoint: ICheckpointInfo | null | undefined
): boolean {
  const budget = checkpoint?.host_memory_budget;
  return (
    typeof budget === 'number' &&
    typeof checkpoint?.host_memory_held === 'number' &&
    checkpoint.host_memory_held >= budget
  );
}

/**
 * A shared lease over its memory share: `"over its memory share for 2m 05s"`; `null` within it.
 */
export function overShareLabel(lease: ILease, nowMs: number): string | null {
  const since = parseTime(lease.over_share_since);
  if (since === null) {
    return null;
  }
  const seconds = Math.max(0, (nowMs - since) / 1000);
  return `over its memory share for ${formatDuration(seconds)}`;
}

// ---------------------------------------------------------------------------------------------
// GPU processes

/** One process on a GPU, as the sidebar lists it. */
export interface IProcessRow {
  pid: number;
  /** `"8.0 GiB"`, or `"n/a"` where the driver does not say. */
  memory: string;
  /** The lease on this GPU the process counts toward, `null`: outside every lease. */
  lease: ILease | null;
  /** Whose it is: `"b.ipynb · alice"`, `"no lease · kernel 0123abcd"`, `"no lease"`. */
  label: string;
}

/**
 * The processes on a GPU, most memory first, each with the lease it counts toward (or none):
 * from the server's `lease_id` where it sends one, else from the lease of the process's kernel
 * that holds this GPU.
 */
export function processRows(
  status: IStatus | null,
  device: IDevice,
  pathOf: (lease: ILease) => string | null = () => null
): IProcessRow[] {
  const leases = status?.leases ?? [];
  const rows = (device.processes ?? []).map(process => {
    let lease: ILease | null = null;
    if (process.lease_id !== undefined) {
      lease = leases.find(item => item.id === process.lease_id) ?? null;
    } else if (process.kernel_id) {
      lease =
        leases.find(
          item =>
            item.kernel_id === process.kernel_id &&
            isHolding(item.state) &&
            (item.devices.indexOf(device.uuid) >= 0 ||
              device.lease_ids.indexOf(item.id) >= 0)
        ) ?? null;
    }
    let label: string;
    if (lease) {
      label = `${leaseLabel(lease, pathOf(lease))} · ${holderOf(lease)}`;
    } else {
      const whose = [
        process.kernel_id ? kernelLabel(process.kernel_id) : null,
        process.user ? `user ${process.user}` : null
      ].filter((part): part is string => part !== null);
      label = ['no lease', ...whose].join(' · ');
    }
    return {
      pid: process.pid,
      memory: formatBytes(process.memory_used),
      lease,
      label,
      bytes: process.memory_used ?? -1
    };
  });
  rows.sort((a, b) => b.bytes - a.bytes || a.pid - b.pid);
  return rows.map(({ bytes: _bytes, ...row }) => row);
}
