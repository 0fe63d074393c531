/**
 * The objects of the jupyter-gpusched REST and events contract (DESIGN.md section 8), as
 * TypeScript types. The interfaces that mirror a schema of the served OpenAPI document
 * (`GET /api/gpusched/openapi.json`) are checked against it by tests/test_frontend_contract.py,
 * which reads this file: keep one property per line, and no values here.
 *
 * Times are ISO 8601 UTC strings; sizes are bytes.
 */

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
  /** The kernel the process belongs to, `null` for a process of no kernel. */
  kernel_id: string | null;
  /**
   * The lease on this GPU the process counts toward; `null`: outside every lease (not a
   * kernel's, or a kernel's that holds no lease on this GPU): its memory counts as taken.
   */
  lease_id?: string | null;
  /** The user of the kernel it belongs to, where known. */
  user?: string | null;
}

/** A process a release left behind on a GPU (`IReleased.processes`). */
export interface IReleasedProcess {
  pid: number;
  /** The GPU's UUID. */
  device: string;
  device_index: number;
  /** Bytes. */
  memory_used: number;
}

/**
 * The answer to a release whose kernel's processes still hold GPU memory on the lease's GPUs
 * (`DELETE /api/gpusched/leases/{id}`, 200).
 */
export interface IReleased {
  /** Whether the lease was released (false: kept, as `memory_held=keep` asked). */
  released: boolean;
  lease: ILease;
  /** Bytes the kernel's processes hold on the lease's GPUs. */
  memory_held: number;
  processes: IReleasedProcess[];
  /** What happened and what to do, for a person. */
  message: string;
}

/** A GPU process outside every lease (`Status.unleased_processes`, for admins). */
export interface IUnleasedProcess {
  /** The host's process id, as the GPU driver reports it. */
  pid: number;
  /** The GPU's UUID. */
  device: string;
  memory_used: number | null;
  /** The kernel it belongs to, where it is a kernel's process on a GPU it holds no lease for. */
  kernel_id?: string | null;
  /** Hub broker: the Unix user it runs as. */
  unix_user?: string | null;
  /** Hub broker: the single-user server it runs under, `null` where none is known. */
  server_id?: string | null;
  /** Hub broker: that server's hub user. */
  user?: string | null;
  /** Hub broker: the pod (host name) of a server in a PID namespace of its own. */
  pod?: string | null;
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
  contended_by: 'anyone' | 'same_user' | null;
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
  /** When a shared lease was first seen holding more than its memory share; null: within it. */
  over_share_since?: string | null;
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
  /** Why the claim stands where it does in the fair queue, in words; empty where not shown. */
  reason?: string;
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
  /** Why the claim waits and stands where it does in the fair queue; empty where not shown. */
  reason?: string;
}

/** One user's recent GPU usage (`Status.usage`). */
export interface IUserUsage {
  /** The user, or "another user" as for their leases. */
  user: string;
  /** GPU-hours held recently, decayed with `usage_half_life`. */
  gpu_hours: number;
  /** GPUs guaranteed to the user. */
  quota: number;
  /** GPUs' worth held now (a shared lease counts its share). */
  held: number;
}

/** One group's recent GPU usage (`Status.group_usage`). */
export interface IGroupUsage {
  group: string;
  /** GPU-hours its members held recently, decayed. */
  gpu_hours: number;
  /** GPUs' worth its members hold now. */
  held: number;
}

/** Whether the host can suspend a kernel's GPU state instead of restarting it. */
export interface ICheckpointInfo {
  available: boolean;
  reason: string;
  /** Bytes of host memory checkpoints may hold together (checkpoint_host_memory); null: no limit. */
  host_memory_budget?: number | null;
  /** Bytes checkpoints hold now. */
  host_memory_held?: number;
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
  /** Half-life of the recent usage that orders the fair queue; 0: usage not tracked. */
  usage_half_life?: number;
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
  /** Recent GPU usage per user, most first (empty when usage is not tracked). */
  usage?: IUserUsage[];
  /** Recent GPU usage per group, most first. */
  group_usage?: IGroupUsage[];
  /** GPU processes outside every lease (empty unless the user is an admin). */
  unleased_processes?: IUnleasedProcess[];
  checkpoint?: ICheckpointInfo;
  /** The user this server answers for. */
  user?: string;
  is_admin?: boolean;
  /** Why the backend is what it is (for example why NVML did not load). */
  backend_note?: string | null;
  config?: ISchedulerConfig;
  /** The server's clock when the status was taken, seconds since the epoch. */
  time?: number;
  /** Hub broker: the node (host) whose GPUs it schedules. */
  node?: string;
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
  | 'over_share'
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
