/**
 * The jupyter-gpusched REST and events client: event parsing, `requestAPI()` over
 * `ServerConnection.makeRequest` and the REST calls. The contract's objects are in `types.ts`
 * (re-exported here).
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import type {
  DeviceUpdate,
  GPUSchedEvent,
  INotice,
  IStatusPayload,
  LeaseState,
  LeaseUpdate
} from './types';

export * from './types';

/** Root of the extension's REST API, relative to the server's base URL. */
export const API_ROOT = 'api/gpusched';

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
  /** One lease, also one that has ended (`null` when the server does not say). */
  getLease(leaseId: string): Promise<LeaseUpdate | null>;
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

  async getLease(leaseId: string): Promise<LeaseUpdate | null> {
    const body = await requestAPI<unknown>(
      `leases/${encodeURIComponent(leaseId)}`,
      { method: 'GET' },
      this.serverSettings
    );
    return isLeasePayload(body) ? body : null;
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
