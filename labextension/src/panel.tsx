/**
 * The sidebar panel: every GPU of the host with utilization and memory bars and its holders,
 * the leases by kernel and user, the queue, and actions (keep, release, drain).
 */
import { ReactWidget, UseSignal, refreshIcon } from '@jupyterlab/ui-components';
import * as React from 'react';

import {
  DEFAULT_KEEP_SECONDS,
  IDevice,
  ILease,
  IQueueEntry,
  IStatus
} from './api';
import {
  baseName,
  checkpointMemoryFull,
  checkpointMemoryLine,
  clampPercent,
  deviceIndicesOf,
  formatBytes,
  formatCountdown,
  formatDeviceIndices,
  formatAmount,
  formatDuration,
  formatGpuHours,
  formatMemory,
  formatPercent,
  holderOf,
  holdersOfDevice,
  idleOutlook,
  idleSeconds,
  keepLabel,
  kernelLabel,
  keepRemaining,
  leaseLabel,
  leaseMemory,
  overShareLabel,
  percentOf,
  processRows,
  queueReason,
  reclaimCountdown,
  stateLabel,
  unleasedProcesses,
  usageHeading,
  usageRows,
  usageTracked
} from './format';
import { chartLines, chartSpan, ISample, peakAndLast } from './history';
import { useNow, usePending } from './hooks';
import { gpuIcon } from './icons';
import { ConnectionState, GPUSchedModel } from './model';

/** The DOM id of the sidebar panel. */
export const PANEL_ID = 'jp-gpusched-panel';

/** The sidebar panel widget. */
export class GPUSchedPanel extends ReactWidget {
  constructor(options: GPUSchedPanel.IOptions) {
    super();
    this._model = options.model;
    this._onError = options.onError;
    this._keepSeconds = options.keepSeconds ?? DEFAULT_KEEP_SECONDS;
    this.id = PANEL_ID;
    this.addClass('jp-gpusched-Panel');
    this.title.icon = gpuIcon;
    this.title.caption = 'GPU scheduler';
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU scheduler');
  }

  protected render(): React.ReactElement {
    return (
      <UseSignal signal={this._model.changed}>
        {() => (
          <PanelView
            model={this._model}
            onError={this._onError}
            keepSeconds={this._keepSeconds}
          />
        )}
      </UseSignal>
    );
  }

  private _model: GPUSchedModel;
  private _onError: (message: string) => void;
  private _keepSeconds: number;
}

export namespace GPUSchedPanel {
  export interface IOptions {
    model: GPUSchedModel;
    /** Shows an action's failure to the user. */
    onError: (message: string) => void;
    /** How long "Keep" keeps a lease, seconds. */
    keepSeconds?: number;
  }
}

interface IViewProps {
  model: GPUSchedModel;
  onError: (message: string) => void;
  keepSeconds: number;
}

const CONNECTION_TEXT: Record<
  ConnectionState,
  { label: string; title: string }
> = {
  connecting: { label: 'connecting', title: 'Connecting to the GPU scheduler' },
  live: { label: 'live', title: 'Live: changes are pushed by the server' },
  polling: {
    label: 'polling',
    title:
      'The live event stream is unavailable: the status is refreshed periodically'
  },
  offline: { label: 'offline', title: 'The GPU scheduler does not answer' }
};

function hasClock(status: IStatus | null): boolean {
  return (
    status !== null &&
    status.leases.some(
      lease =>
        lease.state === 'idle' ||
        lease.state === 'reclaiming' ||
        lease.reclaim_at !== null ||
        lease.keep_until !== null ||
        Boolean(lease.over_share_since) ||
        Boolean(lease.idle_forecast)
    )
  );
}

function PanelView(props: IViewProps): React.ReactElement {
  const { model, onError, keepSeconds } = props;
  const status = model.status;
  const now = useNow(model, hasClock(status));
  const [pending, run] = usePending(onError);
  const [refreshing, setRefreshing] = React.useState(false);
  const connection = CONNECTION_TEXT[model.connection];

  const refresh = (): void => {
    setRefreshing(true);
    void model.refresh().finally(() => setRefreshing(false));
  };

  return (
    <div className="jp-gpusched-PanelContent">
      <header className="jp-gpusched-Header">
        <h2 className="jp-gpusched-Title">GPUs</h2>
        <span
          className="jp-gpusched-Connection"
          data-connection={model.connection}
          title={connection.title}
        >
          {connection.label}
        </span>
        <button
          type="button"
          className="jp-gpusched-Button jp-gpusched-RefreshButton"
          aria-label="Refresh GPU status"
          title="Refresh GPU status"
          disabled={refreshing}
          onClick={refresh}
        >
          <refreshIcon.react tag="span" className="jp-gpusched-ButtonIcon" />
        </button>
      </header>
      {model.error && (
        <div className="jp-gpusched-Error" role="alert">
          {model.error}
        </div>
      )}
      {status === null ? (
        !model.error && <p className="jp-gpusched-Empty">Loading GPU status…</p>
      ) : (
        <>
          <Summary status={status} />
          <DevicesSection
            model={model}
            status={status}
            now={now}
            pending={pending}
            run={run}
          />
          <LeasesSection
            model={model}
            status={status}
            now={now}
            pending={pending}
            run={run}
            keepSeconds={keepSeconds}
          />
          <QueueSection
            model={model}
            status={status}
            pending={pending}
            run={run}
          />
          <UsageSection status={status} />
        </>
      )}
    </div>
  );
}

function Summary(props: { status: IStatus }): React.ReactElement {
  const { status } = props;
  const parts = [
    status.mode,
    `${status.backend} backend`,
    `${status.policy} policy`
  ];
  if (status.user) {
    parts.push(status.is_admin ? `${status.user} (admin)` : status.user);
  } else if (status.is_admin) {
    parts.push('admin');
  }
  const checkpointLine = checkpointMemoryLine(status.checkpoint);
  return (
    <div className="jp-gpusched-Summary">
      <p className="jp-gpusched-SummaryLine">{parts.join(' · ')}</p>
      {status.backend_note && (
        <p className="jp-gpusched-BackendNote">{status.backend_note}</p>
      )}
      {status.checkpoint && (
        <p
          className="jp-gpusched-Checkpoint"
          data-available={status.checkpoint.available ? 'true' : 'false'}
          title={status.checkpoint.reason}
        >
          {status.checkpoint.available
            ? 'Idle GPUs are suspended with a checkpoint (state kept).'
            : `No checkpoint: ${status.checkpoint.reason || 'not supported here'}.`}
        </p>
      )}
      {checkpointLine && (
        <p
          className="jp-gpusched-CheckpointMemory"
          data-full={checkpointMemoryFull(status.checkpoint) ? 'true' : 'false'}
          title="Host memory that checkpoints of suspended kernels hold, against checkpoint_host_memory"
        >
          {checkpointLine}
        </p>
      )}
    </div>
  );
}

type Run = (key: string, action: () => Promise<void>) => void;

interface ISectionProps {
  model: GPUSchedModel;
  status: IStatus;
  pending: ReadonlySet<string>;
  run: Run;
}

function Section(props: {
  name: string;
  title: string;
  count: number;
  /** The heading, where it is more than the title. */
  heading?: string;
  children: React.ReactNode;
}): React.ReactElement {
  const headingId = `jp-gpusched-${props.name}-heading`;
  return (
    <section
      className={`jp-gpusched-Section jp-gpusched-${props.title}`}
      aria-labelledby={headingId}
    >
      <h3 id={headingId} className="jp-gpusched-SectionTitle">
        {props.heading ?? props.title}{' '}
        <span className="jp-gpusched-Count">({props.count})</span>
      </h3>
      {props.children}
    </section>
  );
}

function DevicesSection(
  props: ISectionProps & { now: number }
): React.ReactElement {
  const { status } = props;
  return (
    <Section name="devices" title="Devices" count={status.devices.length}>
      {status.devices.length === 0 ? (
        <p className="jp-gpusched-Empty">No GPUs on this host.</p>
      ) : (
        <ul className="jp-gpusched-DeviceList" aria-label="GPUs on this host">
          {status.devices.map(device => (
            <DeviceCard key={device.uuid} {...props} device={device} />
          ))}
        </ul>
      )}
    </Section>
  );
}

function Meter(props: {
  kind: 'utilization' | 'memory';
  caption: string;
  label: string;
  value: number | null;
  text: string;
}): React.ReactElement {
  const value = clampPercent(props.value);
  const level =
    value === null
      ? 'unknown'
      : value >= 90
        ? 'high'
        : value >= 60
          ? 'medium'
          : 'low';
  const known = value !== null;
  return (
    <div className={`jp-gpusched-Meter jp-gpusched-Meter-${props.kind}`}>
      <span className="jp-gpusched-Meter-caption" aria-hidden="true">
        {props.caption}
      </span>
      <div
        className="jp-gpusched-Meter-track"
        role={known ? 'meter' : 'img'}
        aria-label={known ? props.label : `${props.label}: ${props.text}`}
        aria-valuemin={known ? 0 : undefined}
        aria-valuemax={known ? 100 : undefined}
        aria-valuenow={known ? Math.round(value) : undefined}
        aria-valuetext={known ? props.text : undefined}
      >
        <div
          className="jp-gpusched-Meter-fill"
          data-level={level}
          style={{ width: `${value ?? 0}%` }}
        />
      </div>
      <span className="jp-gpusched-Meter-value" aria-hidden="true">
        {props.text}
      </span>
    </div>
  );
}

function DeviceCard(
  props: ISectionProps & { now: number; device: IDevice }
): React.ReactElement {
  const { model, status, device, pending, run } = props;
  const holders = holdersOfDevice(status, device);
  const unleased = unleasedProcesses(device);
  const unleasedBytes = unleased.reduce(
    (sum, process) => sum + (process.memory_used ?? 0),
    0
  );
  const gpu = `GPU ${device.index}`;
  const drainKey = `device:${device.uuid}`;
  const drained = device.health === 'drained';

  return (
    <li
      className="jp-gpusched-Device"
      data-uuid={device.uuid}
      data-index={device.index}
      data-health={device.health}
      aria-label={`${gpu}: ${device.name}`}
    >
      <div className="jp-gpusched-Device-header">
        <span className="jp-gpusched-Device-title">{gpu}</span>
        <span
          className="jp-gpusched-Device-name"
          title={`${device.name}\n${device.uuid}`}
        >
          {device.name}
          {device.mig_profile ? ` (MIG ${device.mig_profile})` : ''}
        </span>
        {device.health !== 'ok' && (
          <span
            className="jp-gpusched-HealthBadge"
            data-health={device.health}
            title={device.drain_reason || undefined}
          >
            {device.health}
          </span>
        )}
        {status.is_admin === true && (
          <button
            type="button"
            className={`jp-gpusched-Button jp-gpusched-SmallButton ${drained ? 'jp-gpusched-UndrainButton' : 'jp-gpusched-DrainButton'}`}
            aria-label={`${drained ? 'Undrain' : 'Drain'} ${gpu}`}
            title={
              drained
                ? `Put ${gpu} back into service`
                : `Drain ${gpu}: no new leases; current holders keep it until they release`
            }
            disabled={pending.has(drainKey) || device.health === 'lost'}
            onClick={() =>
              run(drainKey, () =>
                drained ? model.undrain(device.uuid) : model.drain(device.uuid)
              )
            }
          >
            {drained ? 'Undrain' : 'Drain'}
          </button>
        )}
      </div>
      <Meter
        kind="utilization"
        caption="Util"
        label={`${gpu} utilization`}
        value={device.utilization}
        text={formatPercent(device.utilization)}
      />
      <Meter
        kind="memory"
        caption="Mem"
        label={`${gpu} memory`}
        value={percentOf(device.memory_used, device.memory_total)}
        text={formatMemory(device.memory_used, device.memory_total)}
      />
      <UseSignal signal={model.sampled}>
        {() => (
          <DeviceChart
            gpu={gpu}
            samples={model.history.samples(device.uuid)}
            now={model.now()}
          />
        )}
      </UseSignal>
      <div className="jp-gpusched-Holders">
        {holders.length === 0 ? (
          <span className="jp-gpusched-Free">
            {device.health === 'ok' ? 'free' : 'unused'}
          </span>
        ) : (
          holders.map(lease => (
            <span
              key={lease.id}
              className="jp-gpusched-Holder"
              data-lease-id={lease.id}
              data-own={model.isOwn(lease) ? 'true' : 'false'}
            >
              {holderOf(lease)}
              {model.isOwn(lease) ? ' (you)' : ''}:{' '}
              {leaseLabel(lease, model.pathOfLease(lease))} (
              {stateLabel(lease.state)})
            </span>
          ))
        )}
      </div>
      <ProcessList model={model} status={status} device={device} />
      {unleased.length > 0 && (
        <div className="jp-gpusched-Unleased" role="note">
          {unleased.length === 1 ? '1 process' : `${unleased.length} processes`}{' '}
          outside any lease
          {unleasedBytes > 0 ? ` (${formatBytes(unleasedBytes)})` : ''}
        </div>
      )}
    </li>
  );
}

const CHART_WIDTH = 240;
const CHART_HEIGHT = 40;
const pickUtilization = (sample: ISample): number | null => sample.utilization;
const pickMemory = (sample: ISample): number | null => sample.memory;

/** Utilization and memory of one GPU over the last minutes, as two lines. */
function DeviceChart(props: {
  gpu: string;
  samples: ReadonlyArray<ISample>;
  now: number;
}): React.ReactElement {
  const { gpu, samples, now } = props;
  const span = chartSpan(samples, now);
  const spanText = formatDuration(Math.round(span / 1000));
  const series = [
    { kind: 'utilization', name: 'Util', pick: pickUtilization },
    { kind: 'memory', name: 'Mem', pick: pickMemory }
  ] as const;
  const summaries = series.map(item => {
    const { peak, last } = peakAndLast(samples, item.pick);
    return `${item.name} ${formatPercent(last)} (peak ${formatPercent(peak)})`;
  });
  const label = `${gpu} over the last ${spanText}: ${summaries.join(', ')}`;
  return (
    <figure
      className="jp-gpusched-Chart"
      data-samples={samples.length}
      aria-label={label}
      title={label}
    >
      <svg
        className="jp-gpusched-Chart-plot"
        viewBox={`0 0 ${CHART_WIDTH} ${CHART_HEIGHT}`}
        preserveAspectRatio="none"
        role="img"
        aria-hidden="true"
      >
        <line
          className="jp-gpusched-Chart-grid"
          x1={0}
          x2={CHART_WIDTH}
          y1={CHART_HEIGHT / 2}
          y2={CHART_HEIGHT / 2}
        />
        {series.map(item =>
          chartLines(
            samples,
            item.pick,
            now,
            span,
            CHART_WIDTH,
            CHART_HEIGHT
          ).map((points, index) => (
            <polyline
              key={`${item.kind}-${index}`}
              className={`jp-gpusched-Chart-line jp-gpusched-Chart-${item.kind}`}
              points={points}
            />
          ))
        )}
      </svg>
      <figcaption className="jp-gpusched-Chart-caption">
        <span className="jp-gpusched-Chart-key jp-gpusched-Chart-key-utilization">
          util
        </span>
        <span className="jp-gpusched-Chart-key jp-gpusched-Chart-key-memory">
          memory
        </span>
        <span className="jp-gpusched-Chart-span">last {spanText}</span>
      </figcaption>
    </figure>
  );
}

/** The processes on a GPU with their memory and the lease each counts toward, or none. */
function ProcessList(props: {
  model: GPUSchedModel;
  status: IStatus;
  device: IDevice;
}): React.ReactElement | null {
  const { model, status, device } = props;
  const rows = processRows(status, device, lease => model.pathOfLease(lease));
  if (rows.length === 0) {
    return null;
  }
  return (
    <table
      className="jp-gpusched-Processes"
      aria-label={`Processes on GPU ${device.index}`}
    >
      <tbody>
        {rows.map(row => (
          <tr
            key={row.pid}
            className="jp-gpusched-Process"
            data-pid={row.pid}
            data-lease-id={row.lease?.id ?? ''}
          >
            <td className="jp-gpusched-Process-pid">{row.pid}</td>
            <td className="jp-gpusched-Process-memory">{row.memory}</td>
            <td
              className="jp-gpusched-Process-lease"
              data-leased={row.lease ? 'true' : 'false'}
            >
              {row.label}
            </td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

function leaseOrder(model: GPUSchedModel, status: IStatus) {
  return (a: ILease, b: ILease): number => {
    const own = Number(model.isOwn(b)) - Number(model.isOwn(a));
    if (own !== 0) {
      return own;
    }
    const user = holderOf(a).localeCompare(holderOf(b));
    if (user !== 0) {
      return user;
    }
    const first = (lease: ILease): number =>
      deviceIndicesOf(status, lease)[0] ?? 1e9;
    return first(a) - first(b);
  };
}

function LeasesSection(
  props: ISectionProps & { now: number; keepSeconds: number }
): React.ReactElement {
  const { model, status } = props;
  const leases = status.leases
    .filter(lease => lease.state !== 'pending' && lease.state !== 'released')
    .sort(leaseOrder(model, status));
  return (
    <Section name="leases" title="Leases" count={leases.length}>
      {leases.length === 0 ? (
        <p className="jp-gpusched-Empty">No kernel holds a GPU.</p>
      ) : (
        <ul className="jp-gpusched-LeaseList" aria-label="GPU leases">
          {leases.map(lease => (
            <LeaseItem key={lease.id} {...props} lease={lease} />
          ))}
        </ul>
      )}
    </Section>
  );
}

function leaseTimer(lease: ILease, now: number): string | null {
  const reclaimIn = reclaimCountdown(lease, now);
  if (reclaimIn !== null) {
    return `reclaim in ${formatCountdown(reclaimIn)}`;
  }
  const kept = keepRemaining(lease, now);
  if (kept !== null) {
    return `kept ${formatDuration(kept)}`;
  }
  const idle = idleSeconds(lease, now);
  if (idle !== null) {
    return `idle ${formatDuration(idle)}`;
  }
  return null;
}

function LeaseItem(
  props: ISectionProps & { now: number; keepSeconds: number; lease: ILease }
): React.ReactElement {
  const { model, status, lease, now, pending, run, keepSeconds } = props;
  const path = model.pathOfLease(lease);
  const label = leaseLabel(lease, path);
  const keepFor = model.keepSeconds(keepSeconds);
  const own = model.isOwn(lease);
  const memory = leaseMemory(status, lease);
  const timer = leaseTimer(lease, now);
  const outlook = idleOutlook(lease, now, status.queue.length > 0);
  const overShare = overShareLabel(lease, now);
  const holding =
    lease.state === 'active' ||
    lease.state === 'idle' ||
    lease.state === 'reclaiming';
  const keepKey = `keep:${lease.id}`;
  const releaseKey = `release:${lease.id}`;

  return (
    <li
      className="jp-gpusched-Lease"
      data-lease-id={lease.id}
      data-kernel-id={lease.kernel_id ?? ''}
      data-state={lease.state}
      data-own={own ? 'true' : 'false'}
      data-over-share={overShare ? 'true' : 'false'}
    >
      <div className="jp-gpusched-Lease-main">
        <span
          className="jp-gpusched-Lease-label"
          title={
            path ?? (lease.kernel_id ? `kernel ${lease.kernel_id}` : undefined)
          }
        >
          {label}
        </span>
        <span className="jp-gpusched-Lease-holder">
          {holderOf(lease)}
          {own ? ' (you)' : ''}
        </span>
      </div>
      <div className="jp-gpusched-Lease-details">
        <span className="jp-gpusched-Lease-devices">
          {formatDeviceIndices(deviceIndicesOf(status, lease))}
          {lease.mode === 'shared' ? ' (shared)' : ''}
        </span>
        <span className="jp-gpusched-StateBadge" data-state={lease.state}>
          {stateLabel(lease.state)}
        </span>
        {holding && (
          <span className="jp-gpusched-Lease-memory">
            {formatMemory(memory.used, memory.total)}
          </span>
        )}
        {overShare && (
          <span className="jp-gpusched-OverShareBadge" title={overShare}>
            over share
          </span>
        )}
        {timer && (
          <span
            className="jp-gpusched-Lease-timer"
            data-reclaim={lease.reclaim_at ? 'true' : 'false'}
          >
            {timer}
          </span>
        )}
      </div>
      {overShare && (
        <div className="jp-gpusched-Lease-overShare" role="note">
          {lease.reason || overShare}
        </div>
      )}
      {outlook && (
        <div
          className="jp-gpusched-Lease-forecast"
          data-step={lease.idle_forecast?.step ?? ''}
          title={[outlook.sentence, lease.idle_forecast?.reason]
            .filter(Boolean)
            .join('\n')}
        >
          {outlook.brief}
        </div>
      )}
      {own && (
        <div className="jp-gpusched-Actions">
          {holding && (
            <button
              type="button"
              className="jp-gpusched-Button jp-gpusched-KeepButton"
              aria-label={`Keep the GPU of ${label} for ${keepLabel(keepFor)}`}
              title={`No idle reclaim for ${keepLabel(keepFor)}`}
              disabled={pending.has(keepKey)}
              onClick={() => run(keepKey, () => model.keep(lease.id, keepFor))}
            >
              Keep {keepLabel(keepFor)}
            </button>
          )}
          <button
            type="button"
            className="jp-gpusched-Button jp-gpusched-ReleaseButton"
            aria-label={`Release the GPU of ${label}`}
            title="Give the GPU back now"
            disabled={pending.has(releaseKey)}
            onClick={() => run(releaseKey, () => model.release(lease.id))}
          >
            Release
          </button>
        </div>
      )}
    </li>
  );
}

function QueueSection(props: ISectionProps): React.ReactElement {
  const { status } = props;
  return (
    <Section name="queue" title="Queue" count={status.queue.length}>
      {status.queue.length === 0 ? (
        <p className="jp-gpusched-Empty">Nobody is waiting.</p>
      ) : (
        <ol className="jp-gpusched-QueueList" aria-label="GPU queue">
          {status.queue.map(entry => (
            <QueueItem key={entry.lease_id} {...props} entry={entry} />
          ))}
        </ol>
      )}
    </Section>
  );
}

function QueueItem(
  props: ISectionProps & { entry: IQueueEntry }
): React.ReactElement {
  const { model, entry, pending, run } = props;
  const lease = model.lease(entry.lease_id);
  const kernelId = entry.kernel_id ?? lease?.kernel_id;
  const path =
    entry.notebook ||
    lease?.notebook ||
    (kernelId ? model.localKernels.get(kernelId) : null);
  const label = path ? baseName(path) : kernelLabel(kernelId);
  const who = entry.holder || entry.user || (lease ? holderOf(lease) : '');
  const own = lease ? model.isOwn(lease) : false;
  const count = entry.count ?? lease?.count ?? null;
  const reason = queueReason(entry, lease);
  const cancelKey = `release:${entry.lease_id}`;

  return (
    <li
      className="jp-gpusched-QueueEntry"
      data-lease-id={entry.lease_id}
      data-position={entry.position}
      data-own={own ? 'true' : 'false'}
    >
      <span
        className="jp-gpusched-QueuePosition"
        aria-label={`Position ${entry.position}`}
      >
        #{entry.position}
      </span>
      <span className="jp-gpusched-QueueLabel">{label}</span>
      {who && (
        <span className="jp-gpusched-QueueUser">
          {who}
          {own ? ' (you)' : ''}
        </span>
      )}
      {count !== null && count > 0 && (
        <span className="jp-gpusched-QueueCount">
          {count === 1 ? '1 GPU' : `${count} GPUs`}
        </span>
      )}
      {own && (
        <button
          type="button"
          className="jp-gpusched-Button jp-gpusched-CancelButton"
          aria-label={`Cancel the GPU request of ${label}`}
          title="Leave the queue"
          disabled={pending.has(cancelKey)}
          onClick={() => run(cancelKey, () => model.release(entry.lease_id))}
        >
          Cancel
        </button>
      )}
      {reason && (
        <div className="jp-gpusched-QueueReason" title={reason}>
          {reason}
        </div>
      )}
    </li>
  );
}

function UsageSection(props: { status: IStatus }): React.ReactElement | null {
  const { status } = props;
  if (!usageTracked(status)) {
    return null;
  }
  const rows = usageRows(status);
  const groups = status.group_usage ?? [];
  return (
    <Section
      name="usage"
      title="Usage"
      heading={usageHeading(status)}
      count={rows.length}
    >
      {rows.length === 0 ? (
        <p className="jp-gpusched-Empty">No GPU use recently.</p>
      ) : (
        <table className="jp-gpusched-UsageTable" aria-label="Recent GPU usage">
          <thead>
            <tr>
              <th scope="col">User</th>
              <th scope="col" title="GPU-hours held recently, decayed">
                GPU-h
              </th>
              <th scope="col" title="GPUs guaranteed">
                Quota
              </th>
              <th scope="col" title="GPUs held now">
                Now
              </th>
            </tr>
          </thead>
          <tbody>
            {rows.map((row, index) => (
              <tr
                key={`${row.user}:${index}`}
                className="jp-gpusched-UsageRow"
                data-user={row.user}
                data-own={row.own ? 'true' : 'false'}
                data-over-quota={row.overQuota ? 'true' : 'false'}
                title={row.title}
              >
                <th scope="row" className="jp-gpusched-UsageUser">
                  {row.user}
                  {row.own ? ' (you)' : ''}
                </th>
                <td>{row.gpuHours}</td>
                <td>{row.quota}</td>
                <td className="jp-gpusched-UsageHeld">{row.held}</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
      {groups.length > 0 && (
        <p className="jp-gpusched-GroupUsage">
          Groups:{' '}
          {groups
            .map(
              group =>
                `${group.group} ${formatGpuHours(group.gpu_hours)} GPU-h, holds ${formatAmount(group.held, 2)}`
            )
            .join(' · ')}
        </p>
      )}
    </Section>
  );
}
