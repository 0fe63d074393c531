/**
 * The client-side model of the scheduler: the latest status, kept current from the events
 * websocket, or by polling the REST API while the socket is unavailable. The status changes
 * only through the pure updates of `state.ts`; this module is the connection: websocket,
 * reconnection, REST calls and signals.
 */
import { ServerConnection } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import {
  DEFAULT_KEEP_SECONDS,
  eventsUrl,
  GPUSchedClient,
  GPUSchedError,
  GPUSchedEvent,
  IDevice,
  IGPUSchedClient,
  ILease,
  INotice,
  IStatus,
  IStatusPayload,
  LeaseUpdate,
  parseEvent
} from './api';
import { effectiveKeepSeconds, leaseOfKernel, queuePosition } from './format';
import { DeviceHistory } from './history';
import {
  applyEvent,
  isOwnLease,
  normalizeStatus,
  upsertDevice,
  upsertLease
} from './state';

// ---------------------------------------------------------------------------------------------
// Transport decisions

/** Timing of the websocket reconnection. */
export interface IRetryOptions {
  /** First retry delay, ms. */
  baseMs: number;
  /** Longest delay between retries while the socket is expected to come back, ms. */
  maxMs: number;
  /** Failures in a row, before the socket ever worked, after which retries slow down. */
  maxAttempts: number;
  /** Delay between retries once slowed down, ms. */
  slowMs: number;
}

export const DEFAULT_RETRY: IRetryOptions = {
  baseMs: 2000,
  maxMs: 60000,
  maxAttempts: 5,
  slowMs: 300000
};

/** Close codes by which a server refuses the client (policy, auth): retrying soon is useless. */
function isRefusal(code: number | undefined): boolean {
  return code === 1008 || (code !== undefined && code >= 4400 && code < 4500);
}

/**
 * When to reopen the events websocket after it failed `failures` times in a row (REST
 * polling covers the gap meanwhile). Exponential backoff; if the socket never worked or the
 * server refused it, retry only every `slowMs` once `maxAttempts` is reached.
 */
export function socketRetryDelay(
  failures: number,
  everLive: boolean,
  closeCode?: number,
  options: IRetryOptions = DEFAULT_RETRY
): number {
  if (isRefusal(closeCode)) {
    return options.slowMs;
  }
  if (!everLive && failures >= options.maxAttempts) {
    return options.slowMs;
  }
  const exponent = Math.max(0, failures - 1);
  return Math.min(options.maxMs, options.baseMs * Math.pow(2, exponent));
}

// ---------------------------------------------------------------------------------------------
// The model

/** Differences between the server's clock and this one up to this much are not skew, ms. */
export const CLOCK_SKEW_MS = 5000;

/** How many ended leases the model remembers by id (for the countdowns it replaces). */
const MAX_ENDED = 500;

/** How often the model records each GPU's utilization and memory for the charts. */
export const SAMPLE_INTERVAL_MS = 2000;

/** The part of a WebSocket the model uses (a real `WebSocket` fits). */
export interface IEventSocket {
  onopen: ((event: Event) => void) | null;
  onmessage: ((event: MessageEvent) => void) | null;
  onerror: ((event: Event) => void) | null;
  onclose: ((event: CloseEvent) => void) | null;
  close(code?: number, reason?: string): void;
}

/** How the model gets its data now. */
export type ConnectionState =
  /** Opening the events socket, no data yet. */
  | 'connecting'
  /** Events socket open: changes are pushed. */
  | 'live'
  /** Socket unavailable; the REST status is polled. */
  | 'polling'
  /** Neither the socket nor the REST API answers. */
  | 'offline';

/** The latest scheduler status, with signals on change. */
export class GPUSchedModel implements IDisposable {
  constructor(options: GPUSchedModel.IOptions = {}) {
    const settings = options.serverSettings ?? ServerConnection.makeSettings();
    this._client = options.client ?? new GPUSchedClient(settings);
    this._openSocket =
      options.openSocket ??
      ((url: string): IEventSocket =>
        new settings.WebSocket(url) as IEventSocket);
    this._socketUrl = options.socketUrl ?? eventsUrl(settings);
    this._clock = options.clock ?? Date.now;
    this._retry = options.retry ?? DEFAULT_RETRY;
    this._snapshotWaitMs = options.snapshotWaitMs ?? 3000;
    this._usageRefreshMs = options.usageRefreshMs ?? 2000;
    this._refreshInterval = Math.max(1, options.refreshInterval ?? 5);
    this._poll = new Poll({
      auto: false,
      factory: () => this._fetch(),
      frequency: this._frequency(),
      name: 'jupyter-gpusched:status',
      standby: options.standby ?? 'when-hidden'
    });
  }

  /** Emitted when the status, the connection state or the error changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /**
   * Emitted when a lease ends (the server says it was released, or it went from the status),
   * with the lease as it was before, its `state` now `released` and the server's `reason`.
   */
  get leaseEnded(): ISignal<this, ILease> {
    return this._leaseEnded;
  }

  /** Each GPU's utilization and memory over the last minutes. */
  get history(): DeviceHistory {
    return this._history;
  }

  /** Emitted after each reading of the GPUs into `history`. */
  get sampled(): ISignal<this, void> {
    return this._sampled;
  }

  /** Emitted for every notice event. */
  get noticeReceived(): ISignal<this, INotice> {
    return this._noticeReceived;
  }

  /** The latest status, `null` until the first one arrives. */
  get status(): IStatus | null {
    return this._status;
  }

  /** How the model gets its data now. */
  get connection(): ConnectionState {
    return this._connection;
  }

  /** The last error talking to the server, `null` once it answers again. */
  get error(): string | null {
    return this._error;
  }

  /** Whether the model is disposed. */
  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Seconds between status requests while polling (at least 1). */
  get refreshInterval(): number {
    return this._refreshInterval;
  }
  set refreshInterval(seconds: number) {
    const value = Number.isFinite(seconds) ? Math.max(1, seconds) : 5;
    if (value === this._refreshInterval) {
      return;
    }
    this._refreshInterval = value;
    this._poll.frequency = this._frequency();
  }

  /** The kernels of this server, by id, with the path of their session. */
  get localKernels(): ReadonlyMap<string, string> {
    return this._localKernels;
  }
  set localKernels(kernels: ReadonlyMap<string, string>) {
    if (sameMap(kernels, this._localKernels)) {
      return;
    }
    this._localKernels = new Map(kernels);
    this._changed.emit();
  }

  /** Milliseconds since the epoch on the server's clock, as far as the model knows it. */
  now(): number {
    return this._clock() + this._clockOffsetMs;
  }

  /** Connect: open the events socket (falling back to polling when it fails). */
  start(): void {
    if (this._started || this._isDisposed) {
      return;
    }
    this._started = true;
    this._changed.connect(this._sample, this);
    this._sampleTimer = setInterval(() => this._sample(), SAMPLE_INTERVAL_MS);
    this._connect();
  }

  /** Fetch the status over REST now. Never rejects: a failure is kept in `error`. */
  async refresh(): Promise<void> {
    try {
      await this._fetch();
    } catch {
      // Recorded in `error` by _fetch.
    }
  }

  /** Apply one event (a parsed websocket message). */
  handleEvent(event: GPUSchedEvent): void {
    if (this._isDisposed) {
      return;
    }
    if (event.type === 'notice') {
      this._noticeReceived.emit(event.notice);
      return;
    }
    if (event.type === 'snapshot') {
      this._syncClock(event.status.time);
    }
    const previous = this._status;
    const next = applyEvent(previous, event);
    if (event.type === 'lease' && event.lease.state === 'released') {
      const before =
        previous?.leases.find(lease => lease.id === event.lease.id) ?? null;
      this._recordEnded(before, event.lease);
    } else if (event.type === 'snapshot') {
      this._noticeGone(previous, next);
    }
    if (next !== previous) {
      this._status = next;
      this._changed.emit();
      if (event.type === 'lease' && previous !== null && next !== null) {
        this._refreshUsageAfter(previous, event.lease);
      }
    }
  }

  /**
   * The last lease of a kernel that ended while this page watched, with the server's reason,
   * `null` if none (or the kernel holds or waits for one again).
   */
  endedLeaseOfKernel(kernelId: string | null | undefined): ILease | null {
    if (!kernelId || this.leaseOfKernel(kernelId) !== null) {
      return null;
    }
    return this._ended.get(kernelId) ?? null;
  }

  /** A lease that ended while this page watched, by id, as the server said it ended. */
  endedLease(leaseId: string | null | undefined): ILease | null {
    return (leaseId && this._endedById.get(leaseId)) || null;
  }

  /** The lease of a kernel, `null` if it has none. */
  leaseOfKernel(kernelId: string | null | undefined): ILease | null {
    return leaseOfKernel(this._status, kernelId);
  }

  /** A lease by id. */
  lease(leaseId: string | null | undefined): ILease | null {
    if (!leaseId || !this._status) {
      return null;
    }
    return this._status.leases.find(lease => lease.id === leaseId) ?? null;
  }

  /** Queue position of a pending lease (1 = next). */
  queuePosition(lease: ILease): number | null {
    return queuePosition(this._status, lease);
  }

  /** Whether a lease belongs to the user of this page. */
  isOwn(lease: ILease): boolean {
    return isOwnLease(this._status, lease, this._localKernels);
  }

  /** How long a keep of `wanted` seconds lasts, within the server's `max_keep`. */
  keepSeconds(wanted: number = DEFAULT_KEEP_SECONDS): number {
    return effectiveKeepSeconds(this._status, wanted);
  }

  /** Whether the server says this user is an admin. */
  get isAdmin(): boolean {
    return this._status?.is_admin === true;
  }

  /** The notebook path of a kernel: from its lease, else from this server's sessions. */
  pathOfKernel(kernelId: string | null | undefined): string | null {
    if (!kernelId) {
      return null;
    }
    const lease = this.leaseOfKernel(kernelId);
    return lease?.notebook || this._localKernels.get(kernelId) || null;
  }

  /** The notebook path of a lease's kernel, where known. */
  pathOfLease(lease: ILease): string | null {
    return (
      lease.notebook ||
      (lease.kernel_id ? this._localKernels.get(lease.kernel_id) : null) ||
      null
    );
  }

  /** Release a lease (`DELETE /api/gpusched/leases/{id}`). */
  async release(leaseId: string): Promise<void> {
    await this._client.releaseLease(leaseId);
    if (this._status) {
      this._status = upsertLease(this._status, {
        id: leaseId,
        state: 'released'
      });
      this._changed.emit();
    }
    this._refreshUnlessLive();
  }

  /**
   * Keep a lease from idle reclaim (`POST /api/gpusched/leases/{id}/keep`), for `seconds`
   * within the server's `max_keep`.
   */
  async keep(
    leaseId: string,
    seconds: number = DEFAULT_KEEP_SECONDS
  ): Promise<void> {
    const lease = await this._client.keepLease(
      leaseId,
      this.keepSeconds(seconds)
    );
    if (lease && this._status) {
      this._status = upsertLease(this._status, lease);
      this._changed.emit();
    }
    this._refreshUnlessLive();
  }

  /** Drain a device (admin). */
  async drain(uuid: string): Promise<void> {
    await this._client.drainDevice(uuid);
    this._setHealth(uuid, 'drained');
    this._refreshUnlessLive();
  }

  /** Undrain a device (admin). */
  async undrain(uuid: string): Promise<void> {
    await this._client.undrainDevice(uuid);
    this._setHealth(uuid, 'ok');
    this._refreshUnlessLive();
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._clearTimers();
    if (this._sampleTimer !== null) {
      clearInterval(this._sampleTimer);
      this._sampleTimer = null;
    }
    const socket = this._socket;
    this._socket = null;
    if (socket) {
      socket.onopen = socket.onmessage = socket.onerror = null;
      socket.onclose = null;
      socket.close(1000, 'disposed');
    }
    this._poll.dispose();
    Signal.clearData(this);
  }

  // -------------------------------------------------------------------------------------------

  private _connect(): void {
    if (this._isDisposed) {
      return;
    }
    this._retryTimer = null;
    let socket: IEventSocket;
    try {
      socket = this._openSocket(this._socketUrl);
    } catch {
      this._onSocketFailure(undefined);
      return;
    }
    this._socket = socket;
    this._snapshotSeen = false;

    socket.onopen = () => {
      if (this._socket !== socket) {
        return;
      }
      // A server that does not start with a snapshot still gets a full picture.
      this._snapshotTimer = setTimeout(() => {
        this._snapshotTimer = null;
        if (this._socket === socket && !this._snapshotSeen) {
          void this._fetch()
            .then(() => {
              if (this._socket === socket) {
                this._goLive();
              }
            })
            .catch(() => undefined);
        }
      }, this._snapshotWaitMs);
    };
    socket.onmessage = (message: MessageEvent) => {
      if (this._socket !== socket) {
        return;
      }
      const event = parseEvent(message.data);
      if (!event) {
        return;
      }
      if (event.type === 'snapshot') {
        this._snapshotSeen = true;
        this.handleEvent(event);
        this._goLive();
        return;
      }
      this.handleEvent(event);
    };
    socket.onerror = () => {
      // A close event always follows; it decides.
    };
    socket.onclose = (event: CloseEvent) => {
      if (this._socket !== socket) {
        return;
      }
      this._socket = null;
      this._onSocketFailure(event.code);
    };
  }

  private _goLive(): void {
    this._socketFailures = 0;
    this._everLive = true;
    this._error = null;
    void this._poll.stop();
    this._setConnection('live', true);
  }

  private _onSocketFailure(code: number | undefined): void {
    if (this._isDisposed) {
      return;
    }
    this._clearTimers();
    this._socketFailures += 1;
    this._setConnection(
      this._status && !this._error ? 'polling' : this._connection,
      false
    );
    // Poll now and then at the refresh rate, until the socket is back.
    void this._poll.start().then(() => this._poll.refresh());
    const delay = socketRetryDelay(
      this._socketFailures,
      this._everLive,
      code,
      this._retry
    );
    this._retryTimer = setTimeout(() => this._connect(), delay);
  }

  private async _fetch(): Promise<void> {
    let payload: IStatusPayload;
    try {
      payload = await this._client.getStatus();
    } catch (error) {
      if (this._isDisposed) {
        throw error;
      }
      const message =
        error instanceof GPUSchedError || error instanceof Error
          ? error.message
          : String(error);
      const changed = this._error !== message;
      this._error = message;
      if (this._connection !== 'live') {
        this._setConnection('offline', changed);
      } else if (changed) {
        this._changed.emit();
      }
      throw error;
    }
    if (this._isDisposed) {
      return;
    }
    this._syncClock(payload.time);
    const previous = this._status;
    this._status = normalizeStatus(payload);
    this._noticeGone(previous, this._status);
    this._error = null;
    if (this._connection !== 'live') {
      this._connection =
        this._socket && this._snapshotSeen ? 'live' : 'polling';
    }
    this._changed.emit();
  }

  /**
   * The events carry leases and devices, not the recent usage per user nor the queue's
   * reasons: when a lease event changes who holds or waits for a GPU (a lease appears, changes
   * state or goes), fetch the status again shortly after, once for a burst of events.
   */
  private _refreshUsageAfter(previous: IStatus, update: LeaseUpdate): void {
    if (
      this._connection !== 'live' ||
      previous.usage === undefined ||
      this._usageTimer !== null
    ) {
      return;
    }
    const before = previous.leases.find(lease => lease.id === update.id);
    if (
      before !== undefined &&
      (update.state ?? before.state) === before.state
    ) {
      return;
    }
    this._usageTimer = setTimeout(() => {
      this._usageTimer = null;
      if (this._connection === 'live') {
        void this.refresh();
      }
    }, this._usageRefreshMs);
  }

  /**
   * Remember how a lease ended: the server's final word (`update`, state `released`) over what
   * it was (`before`), keeping the GPUs it held (a released lease names none).
   */
  private _recordEnded(before: ILease | null, update: LeaseUpdate): void {
    const merged = { ...(before ?? {}), ...update } as ILease;
    if (!merged.kernel_id) {
      return;
    }
    if (before && (merged.devices ?? []).length === 0) {
      merged.devices = before.devices;
      merged.device_indices = before.device_indices;
    }
    this._ended.set(merged.kernel_id, merged);
    this._endedById.set(merged.id, merged);
    if (this._endedById.size > MAX_ENDED) {
      const oldest = this._endedById.keys().next().value;
      if (oldest !== undefined) {
        this._endedById.delete(oldest);
      }
    }
    this._leaseEnded.emit(merged);
  }

  /**
   * Leases of this user that went from the status without an event saying why (a snapshot
   * or a poll after they ended): ask the server how each ended.
   */
  private _noticeGone(previous: IStatus | null, next: IStatus | null): void {
    if (!previous || !next) {
      return;
    }
    const now = new Set(next.leases.map(lease => lease.id));
    for (const lease of previous.leases) {
      if (now.has(lease.id) || !lease.kernel_id || !this.isOwn(lease)) {
        continue;
      }
      const known = this._ended.get(lease.kernel_id);
      if (known?.id === lease.id) {
        continue;
      }
      void this._client
        .getLease(lease.id)
        .then(final => {
          if (final && final.state === 'released' && !this._isDisposed) {
            this._recordEnded(lease, final);
            this._changed.emit();
          }
        })
        .catch(() => undefined);
    }
  }

  private _sample(): void {
    if (this._isDisposed || this._status === null) {
      return;
    }
    this._history.record(this._status, this.now());
    this._sampled.emit();
  }

  private _refreshUnlessLive(): void {
    if (this._connection !== 'live') {
      void this.refresh();
    }
  }

  private _setHealth(uuid: string, health: IDevice['health']): void {
    if (this._status) {
      this._status = upsertDevice(this._status, { uuid, health });
      this._changed.emit();
    }
  }

  private _setConnection(
    connection: ConnectionState,
    forceEmit: boolean
  ): void {
    if (connection !== this._connection) {
      this._connection = connection;
      this._changed.emit();
    } else if (forceEmit) {
      this._changed.emit();
    }
  }

  /**
   * Count down on the server's clock where it differs much from this one. `time` is the
   * server's epoch seconds at its last reconcile tick, so it may lag by a poll interval:
   * only an offset beyond that is taken as clock skew.
   */
  private _syncClock(time: number | undefined): void {
    if (typeof time !== 'number' || !Number.isFinite(time)) {
      return;
    }
    const offset = time * 1000 - this._clock();
    this._clockOffsetMs = Math.abs(offset) > CLOCK_SKEW_MS ? offset : 0;
  }

  private _frequency(): { interval: number; backoff: boolean; max: number } {
    const interval = this._refreshInterval * 1000;
    return { interval, backoff: true, max: Math.max(interval, 5 * 60 * 1000) };
  }

  private _clearTimers(): void {
    if (this._retryTimer !== null) {
      clearTimeout(this._retryTimer);
      this._retryTimer = null;
    }
    if (this._snapshotTimer !== null) {
      clearTimeout(this._snapshotTimer);
      this._snapshotTimer = null;
    }
    if (this._usageTimer !== null) {
      clearTimeout(this._usageTimer);
      this._usageTimer = null;
    }
  }

  private _changed = new Signal<this, void>(this);
  private _noticeReceived = new Signal<this, INotice>(this);
  private _leaseEnded = new Signal<this, ILease>(this);
  private _sampled = new Signal<this, void>(this);
  private _history = new DeviceHistory();
  private _sampleTimer: ReturnType<typeof setInterval> | null = null;
  private _ended = new Map<string, ILease>();
  private _endedById = new Map<string, ILease>();
  private _client: IGPUSchedClient;
  private _openSocket: (url: string) => IEventSocket;
  private _socketUrl: string;
  private _clock: () => number;
  private _clockOffsetMs = 0;
  private _retry: IRetryOptions;
  private _snapshotWaitMs: number;
  private _refreshInterval: number;
  private _poll: Poll;
  private _status: IStatus | null = null;
  private _connection: ConnectionState = 'connecting';
  private _error: string | null = null;
  private _localKernels: Map<string, string> = new Map();
  private _socket: IEventSocket | null = null;
  private _socketFailures = 0;
  private _everLive = false;
  private _snapshotSeen = false;
  private _started = false;
  private _retryTimer: ReturnType<typeof setTimeout> | null = null;
  private _snapshotTimer: ReturnType<typeof setTimeout> | null = null;
  private _usageRefreshMs: number;
  private _usageTimer: ReturnType<typeof setTimeout> | null = null;
  private _isDisposed = false;
}

function sameMap(
  a: ReadonlyMap<string, string>,
  b: ReadonlyMap<string, string>
): boolean {
  if (a.size !== b.size) {
    return false;
  }
  for (const [key, value] of a) {
    if (b.get(key) !== value) {
      return false;
    }
  }
  return true;
}

export namespace GPUSchedModel {
  /** Options of the model; all have defaults for use in JupyterLab. */
  export interface IOptions {
    /** Server connection settings. */
    serverSettings?: ServerConnection.ISettings;
    /** The REST client (replaceable for tests). */
    client?: IGPUSchedClient;
    /** Opens the events websocket (replaceable for tests). */
    openSocket?: (url: string) => IEventSocket;
    /** The events websocket URL. */
    socketUrl?: string;
    /** Seconds between status requests while polling. */
    refreshInterval?: number;
    /** The clock, ms since the epoch. */
    clock?: () => number;
    /** Websocket reconnection timing. */
    retry?: IRetryOptions;
    /** How long to wait for the first snapshot after the socket opens before asking REST, ms. */
    snapshotWaitMs?: number;
    /** When polling stands by. */
    standby?: Poll.Standby;
    /**
     * While live, how long after a lease event that changes who holds or waits the status is
     * fetched again for the recent usage and the queue's reasons, ms.
     */
    usageRefreshMs?: number;
  }
}
