import type { IDevice, ILease, IStatus, IStatusPayload } from '../api';

export const GiB = 1024 ** 3;

export function device(
  index: number,
  overrides: Partial<IDevice> = {}
): IDevice {
  return {
    uuid: `GPU-${index}`,
    index,
    name: 'NVIDIA A100-SXM4-80GB',
    memory_total: 80 * GiB,
    memory_used: 0,
    utilization: 0,
    health: 'ok',
    lease_ids: [],
    processes: [],
    ...overrides
  };
}

export function lease(id: string, overrides: Partial<ILease> = {}): ILease {
  return {
    id,
    kernel_id: `kernel-${id}`,
    user: 'alice',
    devices: [],
    device_indices: [],
    memory: null,
    mode: 'exclusive',
    state: 'active',
    position: null,
    granted_at: '2024-05-01T10:00:00Z',
    last_active_at: '2024-05-01T10:00:00Z',
    idle_seconds: 0,
    reclaim_at: null,
    keep_until: null,
    ...overrides
  };
}

export function payload(
  overrides: Partial<IStatusPayload> = {}
): IStatusPayload {
  return {
    mode: 'standalone',
    backend: 'simulated',
    policy: 'hybrid',
    devices: [device(0), device(1)],
    leases: [],
    queue: [],
    ...overrides
  };
}

export function status(overrides: Partial<IStatus> = {}): IStatus {
  return {
    mode: 'standalone',
    backend: 'simulated',
    policy: 'hybrid',
    devices: [device(0), device(1)],
    leases: [],
    queue: [],
    ...overrides
  };
}

/** 2024-05-01T10:00:00Z in ms. */
export const T0 = Date.parse('2024-05-01T10:00:00Z');

export function iso(ms: number): string {
  return new Date(ms).toISOString();
}
