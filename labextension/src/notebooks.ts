/**
 * The open notebooks: reclaim countdowns that nobody updates any more are replaced by what became
 * of the reclaim, and a kernel restarted by the server to free its GPU is shown as it is.
 */
import type { ICodeCellModel } from '@jupyterlab/cells';
import type { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import type { IDisposable } from '@lumino/disposable';

import { leaseEnd } from './format';
import type { GPUSchedModel } from './model';
import { closingLine, countdownMark } from './outputs';
import type { ILease } from './types';

/**
 * How long a countdown may say more than its lease before it is replaced, while its kernel
 * lives: the kernel agent updates it itself within a poll (3 s), with its own words.
 */
export const KERNEL_GRACE_MS = 6000;

/** How long after a server-side restart the lab asks the kernel for its state, at most. */
const RESTART_FOLLOW_MS = 90_000;

/** Keeps the countdowns of the open notebooks honest. */
export class NotebookNotices implements IDisposable {
  constructor(options: NotebookNotices.IOptions) {
    this._model = options.model;
    this._tracker = options.tracker;
    this._clock = options.clock ?? Date.now;
    this._model.changed.connect(this._schedule, this);
    this._model.leaseEnded.connect(this._onLeaseEnded, this);
    this._tracker.widgetAdded.connect(this._onNotebook, this);
    this._tracker.forEach(panel => this._onNotebook(this._tracker, panel));
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    if (this._timer !== null) {
      clearTimeout(this._timer);
    }
    this._model.changed.disconnect(this._schedule, this);
    this._model.leaseEnded.disconnect(this._onLeaseEnded, this);
    this._tracker.widgetAdded.disconnect(this._onNotebook, this);
  }

  /** Replace every countdown that is over, in every open notebook. */
  sweep(): void {
    this._timer = null;
    if (this._isDisposed || this._model.status === null) {
      return;
    }
    const now = this._clock();
    let again = false;
    this._tracker.forEach(panel => {
      const cells = panel.content.model?.cells;
      if (!cells) {
        return;
      }
      for (let c = 0; c < cells.length; c++) {
        const cell = cells.get(c);
        if (cell.type !== 'code') {
          continue;
        }
        const outputs = (cell as ICodeCellModel).outputs;
        for (let i = 0; i < outputs.length; i++) {
          const mark = countdownMark(outputs.get(i).data);
          if (!mark) {
            continue;
          }
          const ended = this._model.endedLease(mark.leaseId);
          const line = closingLine(
            mark,
            this._model.lease(mark.leaseId),
            ended
          );
          const key = `${mark.leaseId}:${mark.reclaimAt ?? ''}`;
          if (line === null) {
            this._staleSince.delete(key);
            continue;
          }
          // A kernel that lives says itself what became of its countdown; one restarted or
          // shut down to free its GPU, or a countdown from before this page, cannot.
          const gone = ended !== null && leaseEnd(ended) !== 'taken';
          const since = this._staleSince.get(key) ?? now;
          this._staleSince.set(key, since);
          if (!gone && now - since < KERNEL_GRACE_MS) {
            again = true;
            continue;
          }
          const data: Record<string, string> = { 'text/plain': line.text };
          if (line.html) {
            data['text/html'] = line.html;
          }
          outputs.set(i, { output_type: 'display_data', data, metadata: {} });
        }
      }
    });
    if (again) {
      this._scheduleIn(KERNEL_GRACE_MS / 2);
    }
  }

  private _schedule(): void {
    this._scheduleIn(300);
  }

  private _scheduleIn(delayMs: number): void {
    if (this._isDisposed || this._timer !== null) {
      return;
    }
    this._timer = setTimeout(() => this.sweep(), delayMs);
  }

  private _onNotebook(_: INotebookTracker, panel: NotebookPanel): void {
    void panel.context.ready.then(() => this._schedule());
  }

  /**
   * A kernel the server restarted to free its GPU: the lab hears nothing of it on the kernel's
   * connection (no "restarting" status), and the new kernel's first status can be lost, so the
   * lab would show it "Starting" for as long as nothing else is said. Ask it for its info
   * until it answers: the reply's status messages show its real state.
   */
  private _onLeaseEnded(_: GPUSchedModel, lease: ILease): void {
    this._schedule();
    if (leaseEnd(lease) !== 'restart' || !lease.kernel_id) {
      return;
    }
    const kernelId = lease.kernel_id;
    const until = this._clock() + RESTART_FOLLOW_MS;
    let asked = false;
    const ask = (): void => {
      if (this._isDisposed || this._clock() > until) {
        return;
      }
      let settled = asked;
      this._tracker.forEach(panel => {
        const kernel = panel.sessionContext.session?.kernel;
        if (!kernel || kernel.id !== kernelId || kernel.isDisposed) {
          return;
        }
        if (kernel.status === 'idle' || kernel.status === 'busy') {
          return;
        }
        settled = false;
        asked = true;
        kernel.requestKernelInfo().catch(() => undefined);
      });
      // Until the kernel was seen in another state and answered: the server restarts it
      // right after it releases the lease, which is when this starts.
      if (!settled) {
        setTimeout(ask, 2000);
      }
    };
    setTimeout(ask, 1000);
  }

  private _model: GPUSchedModel;
  private _tracker: INotebookTracker;
  private _clock: () => number;
  private _timer: ReturnType<typeof setTimeout> | null = null;
  private _staleSince = new Map<string, number>();
  private _isDisposed = false;
}

export namespace NotebookNotices {
  export interface IOptions {
    model: GPUSchedModel;
    tracker: INotebookTracker;
    /** Milliseconds since the epoch (tests). */
    clock?: () => number;
  }
}
