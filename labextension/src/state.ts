/**
 * Pure state updates of the client-side model: apply a snapshot, a lease, a device or a notice
 * event to a status and return the new status. Nothing here talks to the server or emits
 * anything, and the inputs are never modified. An event that changes nothing (a notice, an
 * event before the first snapshot, a part of a lease or device never seen) returns the same
 * object: the model emits `changed` only for a new one.
 */
import type {
  DeviceUpdate,
  GPUSchedEvent,
  IDevice,
  ILease,
  IQueueEntry,
  IQueueEntryPayload,
  IStatus,
  IStatusPayload,
  LeaseUpdate
} from './types';

/**
 * Normalize the queue: lease ids or objects become `IQueueEntry`s sorted by position.
 * Entries without a position take the lease's position, else their place in the list.
 */
export function normalizeQueue(
  raw: ReadonlyArray<IQueueEntryPayload | string>,
  leases: ReadonlyArray<ILease>
): IQueueEntry[] {
  const entries: IQueueEntry[] = [];
  raw.forEach((item, index) => {
    const payload: IQueueEntryPayload =
      typeof item === 'string' ? { lease_id: item } : item;
    const leaseId = payload.lease_id ?? payload.id;
    if (!leaseId) {
      return;
    }
    const lease = leases.find(candidate => candidate.id === leaseId);
    const position = payload.position ?? lease?.position ?? index + 1;
    const entry: IQueueEntry = { lease_id: leaseId, position };
    const kernelId = payload.kernel_id ?? lease?.kernel_id;
    const user = payload.user ?? lease?.user;
    const holder = payload.holder ?? lease?.holder;
    const notebook = payload.notebook ?? lease?.notebook;
    if (kernelId !== undefined) {
      entry.kernel_id = kernelId;
    }
    if (user !== undefined) {
      entry.user = user;
    }
    if (holder !== undefined) {
      entry.holder = holder;
    }
    if (payload.count !== undefined) {
      entry.count = payload.count;
    }
    if (notebook !== undefined) {
      entry.notebook = notebook;
    }
    if (payload.waiting_since !== undefined) {
      entry.waiting_since = payload.waiting_since;
    }
    if (payload.reason) {
      entry.reason = payload.reason;
    }
    entries.push(entry);
  });
  return sortQueue(entries);
}

function sortQueue(entries: IQueueEntry[]): IQueueEntry[] {
  return entries
    .map((entry, order) => ({ entry, order }))
    .sort((a, b) => a.entry.position - b.entry.position || a.order - b.order)
    .map(({ entry }) => entry);
}

function byIndex(a: IDevice, b: IDevice): number {
  return a.index - b.index;
}

/** The status as the model keeps it: devices in index order, released leases dropped. */
export function normalizeStatus(payload: IStatusPayload): IStatus {
  const leases = (payload.leases ?? []).filter(
    lease => lease.state !== 'released'
  );
  return {
    ...payload,
    devices: [...(payload.devices ?? [])].sort(byIndex),
    leases,
    queue: normalizeQueue(payload.queue ?? [], leases)
  };
}

/**
 * Upsert one lease. Fields sent replace those kept; a released lease is removed, and the
 * entries queued behind it move up one place. A pending lease gets or updates its queue entry.
 */
export function upsertLease(status: IStatus, update: LeaseUpdate): IStatus {
  const index = status.leases.findIndex(lease => lease.id === update.id);
  const previous = index >= 0 ? status.leases[index] : null;

  if (update.state === 'released') {
    const leases = status.leases.filter(lease => lease.id !== update.id);
    return { ...status, leases, queue: dropFromQueue(status.queue, update.id) };
  }
  if (previous === null && !isCompleteLease(update)) {
    // A part of a lease we never saw: nothing to merge it into; the next snapshot has it.
    return status;
  }
  const merged: ILease = previous
    ? { ...previous, ...update }
    : (update as ILease);
  const leases = [...status.leases];
  if (index >= 0) {
    leases[index] = merged;
  } else {
    leases.push(merged);
  }

  let queue = status.queue;
  if (merged.state === 'pending') {
    const existing = queue.find(entry => entry.lease_id === merged.id);
    const entry: IQueueEntry = {
      ...(existing ?? {}),
      lease_id: merged.id,
      position:
        update.position ??
        existing?.position ??
        merged.position ??
        queue.length + 1,
      kernel_id: merged.kernel_id,
      user: merged.user
    };
    if (merged.holder !== undefined) {
      entry.holder = merged.holder;
    }
    if (merged.notebook !== undefined) {
      entry.notebook = merged.notebook;
    }
    queue = placeInQueue(queue, entry);
  } else if (queue.some(entry => entry.lease_id === merged.id)) {
    queue = dropFromQueue(queue, merged.id);
  }
  return { ...status, leases, queue };
}

/**
 * Put an entry at its position: it leaves its old place (those behind move up) and those at
 * or behind the new place move back one, so that positions stay 1..n.
 */
function placeInQueue(queue: IQueueEntry[], entry: IQueueEntry): IQueueEntry[] {
  const others = dropFromQueue(queue, entry.lease_id);
  const position = Math.min(Math.max(1, entry.position), others.length + 1);
  const shifted = others.map(item =>
    item.position >= position ? { ...item, position: item.position + 1 } : item
  );
  return sortQueue([...shifted, { ...entry, position }]);
}

function isCompleteLease(update: LeaseUpdate): update is ILease {
  return (
    (typeof update.kernel_id === 'string' || update.kernel_id === null) &&
    typeof update.state === 'string' &&
    Array.isArray(update.devices)
  );
}

function dropFromQueue(queue: IQueueEntry[], leaseId: string): IQueueEntry[] {
  const removed = queue.find(entry => entry.lease_id === leaseId);
  if (!removed) {
    return queue;
  }
  return queue
    .filter(entry => entry.lease_id !== leaseId)
    .map(entry =>
      entry.position > removed.position
        ? { ...entry, position: entry.position - 1 }
        : entry
    );
}

/** Upsert one device by UUID (fields sent replace those kept); devices stay in index order. */
export function upsertDevice(status: IStatus, update: DeviceUpdate): IStatus {
  const index = status.devices.findIndex(device => device.uuid === update.uuid);
  const devices = [...status.devices];
  if (index >= 0) {
    devices[index] = { ...devices[index], ...update };
  } else if (
    typeof update.index === 'number' &&
    typeof update.name === 'string' &&
    typeof update.memory_total === 'number'
  ) {
    devices.push({
      memory_used: null,
      utilization: null,
      health: 'ok',
      lease_ids: [],
      processes: [],
      ...update
    } as IDevice);
  } else {
    return status;
  }
  return { ...status, devices: devices.sort(byIndex) };
}

/**
 * The status after one event: a snapshot replaces it, a lease or device event upserts one
 * object, a notice changes nothing. Events before the first snapshot are dropped (the
 * snapshot will carry them).
 */
export function applyEvent(
  status: IStatus | null,
  event: GPUSchedEvent
): IStatus | null {
  switch (event.type) {
    case 'snapshot':
      return normalizeStatus(event.status);
    case 'lease':
      return status ? upsertLease(status, event.lease) : status;
    case 'device':
      return status ? upsertDevice(status, event.device) : status;
    default:
      return status;
  }
}

/**
 * Whether a lease belongs to the user of this page: the same user where the server says who
 * that is, else a lease of one of this server's own kernels.
 */
export function isOwnLease(
  status: IStatus | null,
  lease: ILease,
  localKernels: ReadonlyMap<string, string> = new Map()
): boolean {
  if (typeof lease.mine === 'boolean') {
    return lease.mine;
  }
  if (lease.holder === 'another user') {
    return false;
  }
  if (status?.user) {
    return lease.user === status.user;
  }
  return lease.kernel_id !== null && localKernels.has(lease.kernel_id);
}
