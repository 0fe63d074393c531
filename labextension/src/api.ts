/**
 * The jupyter-gpusched REST and events contract (DESIGN.md section 8), mirrored as TypeScript
 * interfaces, plus a small client over `ServerConnection.makeRequest`.
 *
 * Times are ISO 8601 UTC strings; sizes are bytes.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** Root of the extension's REST API, relative to the server's base URL. */
export const API_ROOT = 'api/gpusched';

/** Health of a device. */
export type DeviceHealth = 'ok' | 'lost' | 'drained';

/** Lifecycle state of a lease (DESIGN.md section 4). */
export type LeaseState =
  'pending' | 'active' | 'idle' | 'reclaiming' | 'suspended' | 'released';

/** How a lease uses its devices. */
export type LeaseMode = 'exclusive' | 'shared';

/** Where the arbiter runs. */
export type SchedulerMode = 'standalone' | 'hub';

/** Scheduling policy. */
export type SchedulingPolicy = 'static' | 'dynamic' | 'hybrid';

/** A process that uses a device. */
export interface IDeviceProcess {
  pid: number;
  /** Bytes held on the device, `null` where the driver cannot tell. */
  memory_used: number | null;
  /** The kernel the process belongs to, `null` for a process outside any lease. */
  kernel_id: string | null;
}

/** A schedulable GPU: a physical GPU or a MIG instance, keyed by UUID. */
export interface IDevice {
  uuid: string;
  index: number;
  name: string;
  memory_total: number;
  /** Bytes in use on the device, `null` where unsupported. */
  memory_used: number | null;
  /** Utilization in percent (0-100), `null` where unsupported. */
  utilization: number | null;
  health: DeviceHealth;
  lease_ids: string[];
  processes: IDeviceProcess[];
  /** Why the device is drained, where the admin said. */
  drain_reason?: string | null;
  /** The physical GPU of a MIG instance. */
  parent_uuid?: string | null;
  mig_profile?: string | null;
}

/** The step that takes an idle lease back (the server spells the cache step `free-cache`). */
export type IdleStep =
  | 'release'
  | 'checkpoint'
  | 'free-cache'
  | 'free_cache'
  | 'restart'
  | 'shutdown';

/**
 * What idle will do to a lease: which step takes it back and when, if its kernel stays idle.
 */
export interface IIdleForecast {
  /** The step, `null` when none would (the lease stays until released). */
  step: IdleStep | null;
  /** When, if the kernel stays idle and nobody waits; `null` for never. */
  at: string | null;
  /** When, if someone waits for a GPU; `null` for never. */
  contended_at: string | null;
  /** Who makes `contended_at` apply by waiting: `anyone`, `same_user` (another kernel of the
   * lease's user), `null` for nobody. */
  contended_by?: 'anyone' | 'same_user' | null;
  /** Why, in words. */
  reason: string;
}

/** A claim on GPUs and, once granted, the lease on them. */
export interface ILease {
  id: string;
  /** `null` when the lease is held by another user whose kernels are not shown. */
  kernel_id: string | null;
  user: string;
  /** Device UUIDs. */
  devices: string[];
  device_indices: number[];
  /** Bytes per GPU, `null` for whole GPUs. */
  memory: number | null;
  mode: LeaseMode;
  state: LeaseState;
  /** Position in the queue (1 = next) while pending, else `null`. */
  position: number | null;
  granted_at: string | null;
  last_active_at: string | null;
  idle_seconds: number | null;
  reclaim_at: string | null;
  keep_until: string | null;
  /** Path of the notebook the kernel serves, where known. */
  notebook?: string | null;
  /** Who holds the lease as shown to this user: a user name or "another user". */
  holder?: string;
  /** GPUs asked for. */
  count?: number;
  /** Whether this user may act on the lease (release, keep). */
  mine?: boolean;
  priority?: number;
  created_at?: string | null;
  /** The reclaim step under way or announced (`release`, `checkpoint`, ...). */
  reclaim_step?: string | null;
  /** Bytes the kernel's processes held on the GPU when last seen. */
  memory_held?: number | null;
  /** Why the lease is in its state, in words. */
  reason?: string;
  /** What idle would do to the lease, `null` when nothing is foreseen. */
  idle_forecast?: IIdleForecast | null;
}

/**
 * An entry of the queue. The contract does not fix its shape: the client accepts lease ids
 * or objects and normalizes them to this (see `normalizeQueue`).
 */
export interface IQueueEntry {
  lease_id: string;
  /** 1-based position. */
  position: number;
  kernel_id?: string | null;
  user?: string;
  holder?: string;
  count?: number;
  notebook?: string | null;
  waiting_since?: string | null;
}

/** A queue entry as it may come over the wire. */
export interface IQueueEntryPayload {
  lease_id?: string;
  id?: string;
  position?: number | null;
  kernel_id?: string | null;
  user?: string;
  holder?: string;
  count?: number;
  notebook?: string | null;
  waiting_since?: string | null;
}

/** Whether the host can suspend a kernel's GPU state instead of restarting it. */
export interface ICheckpointInfo {
  available: boolean;
  reason: string;
}

/** The scheduling settings the server runs with (seconds). */
export interface ISchedulerConfig {
  idle_timeout?: number;
  contended_idle_timeout?: number;
  release_timeout?: number;
  grace_period?: number;
  reclaim_fallback?: string;
  /** Longest keep the server accepts. */
  max_keep?: number;
  poll_interval?: number;
}

/** `GET /api/gpusched/status` as sent by the server. */
export interface IStatusPayload {
  mode: SchedulerMode;
  /** Resolved inventory backend: `nvml`, `simulated`, or `none`. */
  backend: string;
  policy: SchedulingPolicy;
  devices: IDevice[];
  leases: ILease[];
  queue: Array<IQueueEntryPayload | string>;
  checkpoint?: ICheckpointInfo;
  /** The user this server answers for. */
  user?: string;
  is_admin?: boolean;
  /** Why the backend is what it is (for example why NVML did not load). */
  backend_note?: string | null;
  config?: ISchedulerConfig;
  /** The server's clock when the status was taken, seconds since the epoch. */
  time?: number;
}

/** The status as the client keeps it: the payload with a normalized queue. */
export interface IStatus extends Omit<IStatusPayload, 'queue'> {
  queue: IQueueEntry[];
}

/** Notice kinds the frontend knows how to present; others are shown with their message. */
export type KnownNoticeKind =
  | 'queued'
  | 'granted'
  | 'reclaim_warning'
  | 'reclaim_cancelled'
  | 'kept'
  | 'suspended'
  | 'resumed'
  | 'released'
  | 'reclaimed'
  | 'free_cache'
  | 'lost';

/** A notice kind; unknown kinds are allowed. */
export type NoticeKind = KnownNoticeKind | (string & Record<never, never>);

/** Something a user should be told about one lease. */
export interface INotice {
  kind: NoticeKind;
  lease_id: string | null;
  kernel_id: string | null;
  message: string;
  /** When the reclaim happens (for `reclaim_warning`). */
  reclaim_at?: string | null;
  /** Queue position (for `queued`), where sent. */
  position?: number | null;
  /** The user the notice is for, where sent. */
  user?: string;
  /** The lease's state after the event, where sent. */
  state?: LeaseState;
}

/** The full status; sent first on connect. */
export interface ISnapshotEvent {
  type: 'snapshot';
  status: IStatusPayload;
}

/** A lease or part of one: the fields sent replace those kept. */
export type LeaseUpdate = Partial<ILease> & { id: string };

/** A device or part of one: the fields sent replace those kept. */
export type DeviceUpdate = Partial<IDevice> & { uuid: string };

/** One lease changed (state `released` means it is gone). */
export interface ILeaseEvent {
  type: 'lease';
  lease: LeaseUpdate;
}

/** One device changed. */
export interface IDeviceEvent {
  type: 'device';
  device: DeviceUpdate;
}

/** A notice for a user. */
export interface INoticeEvent {
  type: 'notice';
  notice: INotice;
}

/** A message of `GET /api/gpusched/events`, normalized by `parseEvent`. */
export type GPUSchedEvent =
  ISnapshotEvent | ILeaseEvent | IDeviceEvent | INoticeEvent;

/** Body of an error response. */
export interface IErrorPayload {
  message: string;
  reason: string;
}

/** A failed request to the scheduler, with what the server said. */
export class GPUSchedError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly reason: string = ''
  ) {
    super(message);
    this.name = 'GPUSchedError';
  }
}

/** Default time a "Keep" action pins a lease for, in seconds. */
export const DEFAULT_KEEP_SECONDS = 1800;

// ---------------------------------------------------------------------------------------------
// Parsing: the wire is `unknown` until checked.

type JSONObject = { [key: string]: unknown };

function isObject(value: unknown): value is JSONObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function isStatusPayload(value: unknown): value is IStatusPayload {
  return (
    isObject(value) &&
    Array.isArray(value.devices) &&
    Array.isArray(value.leases)
  );
}

function withoutType(value: JSONObject): JSONObject {
  const copy: JSONObject = { ...value };
  delete copy.type;
  return copy;
}

/**
 * The object an event carries: nested under `key` (`{"type": "lease", "lease": {...}}`) or
 * inline (`{"type": "lease", "id": ...}`). Both are accepted.
 */
function payloadOf(event: JSONObject, key: string): JSONObject {
  const nested = event[key];
  return isObject(nested) ? nested : withoutType(event);
}

/** Whether a value looks like a lease (has a string `id`). */
export function isLeasePayload(value: unknown): value is LeaseUpdate {
  return isObject(value) && typeof value.id === 'string';
}

/** Whether a value looks like a device (has a string `uuid`). */
export function isDevicePayload(value: unknown): value is DeviceUpdate {
  return isObject(value) && typeof value.uuid === 'string';
}

const LEASE_STATES: ReadonlyArray<string> = [
  'pending',
  'active',
  'idle',
  'reclaiming',
  'suspended',
  'released'
];

function isLeaseState(value: string): value is LeaseState {
  return LEASE_STATES.indexOf(value) >= 0;
}

function stringOrNull(value: unknown): string | null {
  return typeof value === 'string' ? value : null;
}

/**
 * Parse one events-websocket message. Returns `null` for anything that is not a known event
 * (unknown types are ignored, so the server may add some).
 */
export function parseEvent(data: unknown): GPUSchedEvent | null {
  let value: unknown = data;
  if (typeof data === 'string') {
    try {
      value = JSON.parse(data) as unknown;
    } catch {
      return null;
    }
  }
  if (!isObject(value) || typeof value.type !== 'string') {
    return null;
  }
  switch (value.type) {
    case 'snapshot': {
      const status = payloadOf(value, 'status');
      return isStatusPayload(status) ? { type: 'snapshot', status } : null;
    }
    case 'lease': {
      const lease = payloadOf(value, 'lease');
      return isLeasePayload(lease) ? { type: 'lease', lease } : null;
    }
    case 'device': {
      const device = payloadOf(value, 'device');
      return isDevicePayload(device) ? { type: 'device', device } : null;
    }
    case 'notice': {
      const raw = payloadOf(value, 'notice');
      if (typeof raw.kind !== 'string') {
        return null;
      }
      const notice: INotice = {
        kind: raw.kind,
        lease_id: stringOrNull(raw.lease_id),
        kernel_id: stringOrNull(raw.kernel_id),
        message: typeof raw.message === 'string' ? raw.message : ''
      };
      if (raw.reclaim_at !== undefined) {
        notice.reclaim_at = stringOrNull(raw.reclaim_at);
      }
      if (typeof raw.position === 'number') {
        notice.position = raw.position;
      }
      if (typeof raw.user === 'string') {
        notice.user = raw.user;
      }
      if (typeof raw.state === 'string' && isLeaseState(raw.state)) {
        notice.state = raw.state;
      }
      return { type: 'notice', notice };
    }
    default:
      return null;
  }
}

/** Parse a status payload (from REST), or throw if it is not one. */
export function parseStatus(value: unknown): IStatusPayload {
  if (!isStatusPayload(value)) {
    throw new GPUSchedError(
      'The server sent a malformed GPU status.',
      0,
      'malformed'
    );
  }
  return value;
}

// ---------------------------------------------------------------------------------------------
// Requests

/**
 * Call the scheduler's REST API.
 *
 * @param endPoint path below `/api/gpusched/`
 * @param init fetch options; `body` is sent as given
 * @param settings server connection settings
 * @returns the parsed JSON body, or `null` for an empty body (204)
 * @throws GPUSchedError with the server's `{message, reason}` on a non-2xx answer
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {},
  settings: ServerConnection.ISettings = ServerConnection.makeSettings()
): Promise<T | null> {
  const url = URLExt.join(settings.baseUrl, API_ROOT, endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    const detail = error instanceof Error ? error.message : String(error);
    throw new GPUSchedError(
      `Cannot reach the Jupyter server: ${detail}`,
      0,
      'network'
    );
  }

  const text = await response.text();
  let body: unknown = null;
  if (text.length > 0) {
    try {
      body = JSON.parse(text) as unknown;
    } catch {
      body = null;
    }
  }

  if (!response.ok) {
    throw errorFromResponse(response.status, response.statusText, body);
  }
  return body as T | null;
}

/** Build the error a failed response stands for. */
export function errorFromResponse(
  status: number,
  statusText: string,
  body: unknown
): GPUSchedError {
  if (isObject(body) && typeof body.message === 'string' && body.message) {
    const reason = typeof body.reason === 'string' ? body.reason : statusText;
    return new GPUSchedError(body.message, status, reason);
  }
  if (status === 404) {
    return new GPUSchedError(
      'The GPU scheduler is not available on this server (is the jupyter_gpusched server extension enabled?).',
      status,
      statusText || 'Not Found'
    );
  }
  return new GPUSchedError(
    `GPU scheduler request failed: ${status} ${statusText}`.trim(),
    status,
    statusText
  );
}

/** The events websocket URL, with the token appended where the settings ask for it. */
export function eventsUrl(settings: ServerConnection.ISettings): string {
  let url = URLExt.join(settings.wsUrl, API_ROOT, 'events');
  if (settings.appendToken && settings.token) {
    url += `?token=${encodeURIComponent(settings.token)}`;
  }
  return url;
}

/** The REST calls the frontend makes. */
export interface IGPUSchedClient {
  getStatus(): Promise<IStatusPayload>;
  releaseLease(leaseId: string): Promise<void>;
  keepLease(leaseId: string, seconds: number): Promise<LeaseUpdate | null>;
  drainDevice(uuid: string): Promise<void>;
  undrainDevice(uuid: string): Promise<void>;
}

/** `IGPUSchedClient` over the Jupyter server's REST API. */
export class GPUSchedClient implements IGPUSchedClient {
  constructor(
    readonly serverSettings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {}

  async getStatus(): Promise<IStatusPayload> {
    const body = await requestAPI<unknown>(
      'status',
      { method: 'GET' },
      this.serverSettings
    );
    return parseStatus(body);
  }

  async releaseLease(leaseId: string): Promise<void> {
    await requestAPI<unknown>(
      `leases/${encodeURIComponent(leaseId)}`,
      { method: 'DELETE' },
      this.serverSettings
    );
  }

  async keepLease(
    leaseId: string,
    seconds: number
  ): Promise<LeaseUpdate | null> {
    const body = await requestAPI<unknown>(
      `leases/${encodeURIComponent(leaseId)}/keep`,
      { method: 'POST', body: JSON.stringify({ seconds }) },
      this.serverSettings
    );
    return isLeasePayload(body) ? body : null;
  }

  async drainDevice(uuid: string): Promise<void> {
    await requestAPI<unknown>(
      `devices/${encodeURIComponent(uuid)}/drain`,
      { method: 'POST', body: '{}' },
      this.serverSettings
    );
  }

  async undrainDevice(uuid: string): Promise<void> {
    await requestAPI<unknown>(
      `devices/${encodeURIComponent(uuid)}/undrain`,
      { method: 'POST', body: '{}' },
      this.serverSettings
    );
  }
}
