/**
 * Turns scheduler notices into JupyterLab notifications: queued, granted, a reclaim warning
 * with a live countdown and a "Keep" action, suspended, resumed, lost.
 */
import type { Notification } from '@jupyterlab/apputils';
import type { ReadonlyJSONValue } from '@lumino/coreutils';
import type { IDisposable } from '@lumino/disposable';

import { DEFAULT_KEEP_SECONDS, ILease, INotice } from './api';
import {
  baseName,
  deviceIndicesOf,
  devicesOfLease,
  formatCountdown,
  formatDeviceIndices,
  keepLabel,
  kernelLabel,
  secondsUntil,
  shortDeviceName
} from './format';
import type { GPUSchedModel } from './model';

/** Where notifications go: JupyterLab's `Notification` fits. */
export interface INotificationSink {
  emit(
    message: string,
    type: Notification.TypeOptions,
    options: Notification.IOptions<ReadonlyJSONValue>
  ): string;
  update(args: Notification.IUpdate<ReadonlyJSONValue>): boolean;
  dismiss(id?: string): void;
}

/** JupyterLab shows up to this many characters of a notification and cuts the rest. */
export const MAX_MESSAGE = 140;

/** Words that tell nothing new next to a headline about a GPU lease. */
const FILLER = new Set([
  'a',
  'an',
  'and',
  'as',
  'at',
  'by',
  'for',
  'from',
  'in',
  'is',
  'it',
  'its',
  'now',
  'of',
  'on',
  'onto',
  'the',
  'to',
  'was',
  'your',
  'this',
  'gpu',
  'gpus',
  'lease',
  'kernel',
  'waiting',
  'wait'
]);

function wordsOf(text: string): string[] {
  return text
    .toLowerCase()
    .split(/[^a-z0-9_.'-]+/)
    .map(word => word.replace(/^[.'-]+|[.'-]+$/g, ''))
    .filter(word => word.length > 0);
}

function bare(word: string): string {
  return word.toLowerCase().replace(/[^a-z0-9]/g, '');
}

/** Parentheses open and closed in equal number. */
function balanced(text: string): boolean {
  return (text.match(/\(/g) ?? []).length === (text.match(/\)/g) ?? []).length;
}

/**
 * Shorten a sentence that JupyterLab would cut: end it at the last clause boundary that
 * fits (after `keep` characters), never in the middle of a clause; `null` if none fits.
 */
function fitClauses(text: string, keep: number): string | null {
  if (text.length <= MAX_MESSAGE) {
    return text;
  }
  const boundary = /[;:,]\s|\s\(|\s—\s/g;
  let best: string | null = null;
  let match: RegExpExecArray | null;
  while ((match = boundary.exec(text)) !== null) {
    const candidate = text.slice(0, match.index).replace(/[\s,;:]+$/, '');
    if (candidate.length > MAX_MESSAGE) {
      break;
    }
    if (candidate.length > keep && balanced(candidate)) {
      best = candidate;
    }
  }
  return best;
}

/**
 * One sentence from a headline and the server's message: the message is left out when it
 * says nothing the headline does not, it continues the headline where it starts with the
 * headline's last word ("GPU of a.ipynb released" + "released while idle: ..." ->
 * "GPU of a.ipynb released while idle: ..."), else it follows after `join`. The result fits
 * a notification whole: clauses that do not fit are left out, never cut in the middle.
 */
export function noticeSentence(
  headline: string,
  detail: string,
  join = ': '
): string {
  const extra = detail.trim().replace(/[.\s]+$/, '');
  const said = new Set(wordsOf(headline));
  const news = wordsOf(extra).filter(
    word => !said.has(word) && !FILLER.has(word)
  );
  if (!extra || news.length === 0) {
    return fitClauses(headline, 0) ?? headline;
  }
  let text = `${headline}${join}${extra}`;
  const last = bare(headline.split(/\s+/).pop() ?? '');
  const tokens = extra.split(/\s+/);
  const at = tokens.findIndex(token => bare(token) === last);
  if (last && at >= 0) {
    const before = tokens.slice(0, at).map(bare);
    if (before.every(word => FILLER.has(word) || said.has(word))) {
      // What follows the repeated word in its token (a colon, say), then the rest.
      const token = tokens[at];
      const tail = token.slice(
        token.toLowerCase().lastIndexOf(last) + last.length
      );
      const rest = tokens.slice(at + 1).join(' ');
      text = `${headline}${tail}${rest ? ` ${rest}` : ''}`.replace(
        /[\s:;,]+$/,
        ''
      );
    }
  }
  return (
    fitClauses(text, headline.length) ?? fitClauses(headline, 0) ?? headline
  );
}

/** Between a countdown ("... in 0:59") and its reason: a colon would read as part of the time. */
const COUNTDOWN_JOIN = ' — ';

/** A long notebook name shortened in its middle, so that the sentence around it fits. */
export function shortName(name: string, max = 40): string {
  if (name.length <= max) {
    return name;
  }
  const tail = Math.floor((max - 1) / 3);
  return `${name.slice(0, max - 1 - tail)}…${name.slice(name.length - tail)}`;
}

/** Texts of the notifications, given what is known of the lease. */
export namespace NoticeText {
  export function queued(
    label: string,
    position: number | null | undefined
  ): string {
    return position
      ? `GPU request for ${label} queued at position ${position}`
      : `GPU request for ${label} queued`;
  }

  export function granted(
    label: string,
    devices: string,
    names: string[] = []
  ): string {
    return `${devices}${names.length > 0 ? ` (${names.join(', ')})` : ''} granted to ${label}`;
  }

  export function reclaimWarning(
    label: string,
    devices: string,
    seconds: number
  ): string {
    return `${devices} of ${label} will be reclaimed in ${formatCountdown(seconds)}`;
  }

  export function reclaimNow(label: string, devices: string): string {
    return `${devices} of ${label} is being reclaimed`;
  }

  /** The server says how (checkpoint) and when it comes back; without it, this does. */
  export function suspended(label: string, detail = ''): string {
    return detail.trim()
      ? noticeSentence(`GPU of ${label} suspended`, detail)
      : `GPU of ${label} suspended; it is restored when the next cell runs`;
  }

  export function resumed(label: string, devices: string): string {
    return `${devices} resumed for ${label}`;
  }

  export function lost(label: string): string {
    return `GPU of ${label} lost`;
  }

  export function reclaimCancelled(label: string, devices: string): string {
    return `Reclaim of ${devices} of ${label} cancelled`;
  }

  export function released(label: string): string {
    return `GPU of ${label} released`;
  }

  export function reclaimed(label: string): string {
    return `GPU of ${label} reclaimed`;
  }

  export function freeCache(label: string, devices: string): string {
    return `Freeing the cached GPU memory of ${label} on ${devices}: it holds more than its share`;
  }

  export function keptElsewhere(label: string, message: string): string {
    return noticeSentence(`GPU of ${label} kept`, message);
  }

  export function kept(label: string, seconds: number): string {
    return `GPU of ${label} kept for ${keepLabel(seconds)}`;
  }

  export function keepFailed(label: string, reason: string): string {
    return noticeSentence(`Could not keep the GPU of ${label}`, reason);
  }
}

interface ICountdown {
  notificationId: string;
  leaseId: string | null;
  kernelId: string | null;
  reclaimAt: string;
  label: string;
  devices: string;
  detail: string;
  timer: ReturnType<typeof setInterval>;
  /** The countdown reached zero. */
  finished: boolean;
  /** The lease record carried a reclaim time since the countdown began. */
  leaseHadReclaimAt: boolean;
}

/** Shows notices of the model as notifications. */
export class GPUSchedNotifier implements IDisposable {
  constructor(options: GPUSchedNotifier.IOptions) {
    this._model = options.model;
    this._sink = options.sink;
    this._enabled = options.enabled ?? true;
    this._keepSeconds = options.keepSeconds ?? DEFAULT_KEEP_SECONDS;
    this._model.noticeReceived.connect(this._onNotice, this);
    this._model.changed.connect(this._onModelChanged, this);
  }

  /** Whether notices are shown. Turning this off removes running countdowns. */
  get enabled(): boolean {
    return this._enabled;
  }
  set enabled(value: boolean) {
    this._enabled = value;
    if (!value) {
      for (const key of Array.from(this._countdowns.keys())) {
        this._stopCountdown(key, true);
      }
    }
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    for (const key of Array.from(this._countdowns.keys())) {
      this._stopCountdown(key, false);
    }
    this._model.noticeReceived.disconnect(this._onNotice, this);
    this._model.changed.disconnect(this._onModelChanged, this);
  }

  /** Show one notice (public for tests and for other sources of notices). */
  handle(notice: INotice): void {
    if (!this._enabled || this._isDisposed || !this._concernsUser(notice)) {
      return;
    }
    const lease = this._leaseOf(notice);
    const label = this._label(notice, lease);
    const devices = lease
      ? formatDeviceIndices(deviceIndicesOf(this._model.status, lease))
      : 'GPU';
    const key = this._key(notice);

    switch (notice.kind) {
      case 'queued': {
        const position =
          notice.position ?? (lease ? this._model.queuePosition(lease) : null);
        this._replace(
          key,
          noticeSentence(NoticeText.queued(label, position), notice.message),
          'info',
          { autoClose: 10000 }
        );
        break;
      }
      case 'granted': {
        // The server's message only lists the GPUs, which the headline names already.
        const names = lease
          ? Array.from(
              new Set(
                devicesOfLease(this._model.status, lease).map(item =>
                  shortDeviceName(item.name)
                )
              )
            )
          : [];
        this._stopCountdown(key, false);
        this._replace(
          key,
          noticeSentence(NoticeText.granted(label, devices, names), ''),
          'success',
          {
            autoClose: 6000
          }
        );
        break;
      }
      case 'reclaim_warning':
        this._startCountdown(key, notice, lease, label, devices);
        break;
      case 'reclaim_cancelled':
        this._stopCountdown(key, false);
        this._replace(
          key,
          noticeSentence(
            NoticeText.reclaimCancelled(label, devices),
            notice.message
          ),
          'info',
          { autoClose: 6000 }
        );
        break;
      case 'kept': {
        this._stopCountdown(key, false);
        const keptHere = this._keptAt.get(key);
        if (keptHere !== undefined && Date.now() - keptHere < 15000) {
          // This page asked for the keep and says so itself.
          break;
        }
        this._replace(
          key,
          NoticeText.keptElsewhere(label, notice.message),
          'success',
          {
            autoClose: 6000
          }
        );
        break;
      }
      case 'suspended':
        this._stopCountdown(key, false);
        this._replace(
          key,
          NoticeText.suspended(label, notice.message),
          'info',
          {
            autoClose: 10000
          }
        );
        break;
      case 'resumed':
        this._replace(
          key,
          // The server's words name the GPU again, which the headline does.
          NoticeText.resumed(label, devices),
          'success',
          { autoClose: 6000 }
        );
        break;
      case 'released':
        this._stopCountdown(key, false);
        this._replace(
          key,
          noticeSentence(NoticeText.released(label), notice.message),
          'info',
          {
            autoClose: 8000
          }
        );
        break;
      case 'reclaimed':
        this._stopCountdown(key, false);
        this._replace(
          key,
          noticeSentence(NoticeText.reclaimed(label), notice.message),
          'warning',
          {
            autoClose: false
          }
        );
        break;
      case 'over_share':
        this._replace(key, noticeSentence(notice.message, ''), 'warning', {
          autoClose: false
        });
        break;
      case 'free_cache':
        this._replace(key, NoticeText.freeCache(label, devices), 'info', {
          autoClose: 8000
        });
        break;
      case 'lost':
        this._stopCountdown(key, false);
        this._replace(
          key,
          noticeSentence(NoticeText.lost(label), notice.message),
          'error',
          {
            autoClose: false
          }
        );
        break;
      default:
        if (notice.message) {
          this._sink.emit(noticeSentence(notice.message, ''), 'info', {
            autoClose: 10000
          });
        }
    }
  }

  // -------------------------------------------------------------------------------------------

  private _onNotice(_: GPUSchedModel, notice: INotice): void {
    this.handle(notice);
  }

  /** A countdown ends quietly when its lease is no longer headed for reclaim. */
  private _onModelChanged(): void {
    for (const [key, countdown] of Array.from(this._countdowns.entries())) {
      const lease = countdown.leaseId
        ? this._model.lease(countdown.leaseId)
        : this._model.leaseOfKernel(countdown.kernelId);
      if (!lease) {
        if (this._model.status) {
          // Released (by the user, or the reclaim is done): the result has its own notice.
          this._stopCountdown(key, !countdown.finished);
        }
        continue;
      }
      if (lease.reclaim_at) {
        countdown.leaseHadReclaimAt = true;
      }
      const keptFor = secondsUntil(lease.keep_until, this._model.now());
      const cancelled =
        lease.state === 'active' ||
        lease.state === 'pending' ||
        lease.state === 'suspended' ||
        // A keep does not call off what a lease over its memory share is due for.
        (keptFor !== null && keptFor > 0 && !lease.over_share_since) ||
        (countdown.leaseHadReclaimAt && !lease.reclaim_at);
      if (cancelled) {
        this._stopCountdown(
          key,
          !countdown.finished || lease.state === 'active'
        );
      } else if (lease.reclaim_at && lease.reclaim_at !== countdown.reclaimAt) {
        countdown.reclaimAt = lease.reclaim_at;
        countdown.finished = false;
        this._tick(key);
      }
    }
  }

  private _startCountdown(
    key: string,
    notice: INotice,
    lease: ILease | null,
    label: string,
    devices: string
  ): void {
    const reclaimAt = notice.reclaim_at ?? lease?.reclaim_at ?? null;
    if (!reclaimAt) {
      this._replace(
        key,
        noticeSentence(
          `${devices} of ${label} will be reclaimed soon`,
          notice.message,
          COUNTDOWN_JOIN
        ),
        'warning',
        { autoClose: false, actions: [this._keepAction(notice, label)] }
      );
      return;
    }
    this._stopCountdown(key, false);
    const previous = this._ids.get(key);
    const seconds = secondsUntil(reclaimAt, this._model.now()) ?? 0;
    const message = noticeSentence(
      NoticeText.reclaimWarning(label, devices, seconds),
      notice.message,
      COUNTDOWN_JOIN
    );
    const options = {
      autoClose: false as const,
      actions: [this._keepAction(notice, label)]
    };
    let id: string;
    if (
      previous &&
      this._sink.update({ id: previous, message, type: 'warning', ...options })
    ) {
      id = previous;
    } else {
      id = this._sink.emit(message, 'warning', options);
    }
    this._ids.set(key, id);
    const countdown: ICountdown = {
      notificationId: id,
      leaseId: notice.lease_id,
      kernelId: notice.kernel_id,
      reclaimAt,
      label,
      devices,
      detail: notice.message,
      timer: setInterval(() => this._tick(key), 1000),
      finished: false,
      leaseHadReclaimAt: Boolean(lease?.reclaim_at)
    };
    this._countdowns.set(key, countdown);
  }

  private _tick(key: string): void {
    const countdown = this._countdowns.get(key);
    if (!countdown || countdown.finished) {
      return;
    }
    const seconds = secondsUntil(countdown.reclaimAt, this._model.now()) ?? 0;
    if (seconds <= 0) {
      countdown.finished = true;
      this._sink.update({
        id: countdown.notificationId,
        message: noticeSentence(
          NoticeText.reclaimNow(countdown.label, countdown.devices),
          countdown.detail,
          COUNTDOWN_JOIN
        ),
        type: 'warning',
        autoClose: 10000,
        actions: []
      });
      return;
    }
    this._sink.update({
      id: countdown.notificationId,
      message: noticeSentence(
        NoticeText.reclaimWarning(countdown.label, countdown.devices, seconds),
        countdown.detail,
        COUNTDOWN_JOIN
      ),
      type: 'warning',
      autoClose: false
    });
  }

  private _stopCountdown(key: string, dismiss: boolean): void {
    const countdown = this._countdowns.get(key);
    if (!countdown) {
      return;
    }
    clearInterval(countdown.timer);
    this._countdowns.delete(key);
    if (dismiss) {
      this._sink.dismiss(countdown.notificationId);
      if (this._ids.get(key) === countdown.notificationId) {
        this._ids.delete(key);
      }
    }
  }

  private _keepAction(notice: INotice, label: string): Notification.IAction {
    const seconds = this._model.keepSeconds(this._keepSeconds);
    return {
      label: `Keep ${keepLabel(seconds)}`,
      caption: `Keep the GPU of ${label} for ${keepLabel(seconds)}: no idle reclaim until then`,
      displayType: 'accent',
      callback: () => {
        void this._keep(notice, label, seconds);
      }
    };
  }

  private async _keep(
    notice: INotice,
    label: string,
    seconds: number
  ): Promise<void> {
    const key = this._key(notice);
    const leaseId =
      notice.lease_id ?? this._model.leaseOfKernel(notice.kernel_id)?.id;
    if (!leaseId) {
      this._replace(
        key,
        NoticeText.keepFailed(label, 'the lease is gone'),
        'error',
        {
          autoClose: 8000
        }
      );
      return;
    }
    this._stopCountdown(key, true);
    this._keptAt.set(key, Date.now());
    try {
      await this._model.keep(leaseId, seconds);
      this._replace(key, NoticeText.kept(label, seconds), 'success', {
        autoClose: 5000
      });
    } catch (error) {
      this._keptAt.delete(key);
      const reason = error instanceof Error ? error.message : String(error);
      this._replace(key, NoticeText.keepFailed(label, reason), 'error', {
        autoClose: false
      });
    }
  }

  /** Replace the notification shown for a lease, or show a new one. */
  private _replace(
    key: string,
    message: string,
    type: Notification.TypeOptions,
    options: Notification.IOptions<ReadonlyJSONValue>
  ): void {
    const previous = this._ids.get(key);
    if (previous) {
      this._sink.dismiss(previous);
    }
    this._ids.set(key, this._sink.emit(message, type, options));
  }

  /** Whether a notice is about this user's kernels (when that can be told). */
  private _concernsUser(notice: INotice): boolean {
    const user = this._model.status?.user;
    if (notice.user && user && notice.user !== user) {
      return false;
    }
    const lease = this._leaseOf(notice);
    return lease ? this._model.isOwn(lease) : true;
  }

  private _leaseOf(notice: INotice): ILease | null {
    return (
      this._model.lease(notice.lease_id) ??
      this._model.leaseOfKernel(notice.kernel_id)
    );
  }

  private _label(notice: INotice, lease: ILease | null): string {
    const kernelId = notice.kernel_id ?? lease?.kernel_id ?? null;
    const path =
      lease?.notebook || (kernelId ? this._model.pathOfKernel(kernelId) : null);
    if (path) {
      return shortName(baseName(path));
    }
    return kernelId ? kernelLabel(kernelId) : 'your kernel';
  }

  private _key(notice: INotice): string {
    return notice.lease_id ?? `kernel:${notice.kernel_id ?? ''}`;
  }

  private _model: GPUSchedModel;
  private _sink: INotificationSink;
  private _enabled: boolean;
  private _keepSeconds: number;
  private _ids = new Map<string, string>();
  private _keptAt = new Map<string, number>();
  private _countdowns = new Map<string, ICountdown>();
  private _isDisposed = false;
}

export namespace GPUSchedNotifier {
  export interface IOptions {
    model: GPUSchedModel;
    sink: INotificationSink;
    /** Whether notices are shown (the `notifications` setting). */
    enabled?: boolean;
    /** How long the "Keep" action keeps a lease, seconds. */
    keepSeconds?: number;
  }
}
