/**
 * The status bar item: the GPU lease of the current notebook's kernel.
 */
import { ReactWidget, UseSignal } from '@jupyterlab/ui-components';
import { ISignal, Signal } from '@lumino/signaling';
import * as React from 'react';

import { isHolding, summarizeKernel } from './format';
import { useNow } from './hooks';
import type { GPUSchedModel } from './model';

/** The status bar widget. Set `kernelId` when the current notebook or its kernel changes. */
export class GPUStatusItem extends ReactWidget {
  constructor(options: GPUStatusItem.IOptions) {
    super();
    this._model = options.model;
    this._onActivate = options.onActivate;
    this.addClass('jp-gpusched-StatusItem');
  }

  /** The kernel shown, `null` when the current widget has none. */
  get kernelId(): string | null {
    return this._kernelId;
  }
  set kernelId(kernelId: string | null) {
    if (kernelId === this._kernelId) {
      return;
    }
    this._kernelId = kernelId;
    this._kernelChanged.emit(kernelId);
    this.update();
  }

  /** Whether the kernel shown binds lazily (its first cell asks for a GPU). */
  get lazy(): boolean {
    return this._lazy;
  }
  set lazy(lazy: boolean) {
    if (lazy === this._lazy) {
      return;
    }
    this._lazy = lazy;
    this.update();
  }

  /** Emitted when the kernel shown changes. */
  get kernelChanged(): ISignal<this, string | null> {
    return this._kernelChanged;
  }

  protected render(): React.ReactElement {
    return (
      <UseSignal signal={this._model.changed}>
        {() => (
          <KernelStatus
            model={this._model}
            kernelId={this._kernelId}
            lazy={this._lazy}
            onActivate={this._onActivate}
          />
        )}
      </UseSignal>
    );
  }

  private _model: GPUSchedModel;
  private _onActivate: () => void;
  private _kernelId: string | null = null;
  private _lazy = false;
  private _kernelChanged = new Signal<this, string | null>(this);
}

export namespace GPUStatusItem {
  export interface IOptions {
    model: GPUSchedModel;
    /** Called when the item is clicked (opens the panel). */
    onActivate: () => void;
  }
}

function KernelStatus(props: {
  model: GPUSchedModel;
  kernelId: string | null;
  lazy: boolean;
  onActivate: () => void;
}): React.ReactElement {
  const { model, kernelId, lazy, onActivate } = props;
  const lease = model.leaseOfKernel(kernelId);
  // The text and the tooltip count time (idle, the idle forecast, a keep, a reclaim) while the
  // lease holds GPUs, whether or not the server says anything new meanwhile.
  const ticking =
    lease !== null && (isHolding(lease.state) || lease.reclaim_at !== null);
  const now = useNow(model, ticking);
  const summary = summarizeKernel(model.status, lease, now, model.error, {
    lazy,
    ended: model.endedLeaseOfKernel(kernelId)
  });
  const descriptionId = 'jp-gpusched-status-description';

  return (
    <>
      <button
        type="button"
        className="jp-gpusched-StatusItem-button"
        data-state={summary.state}
        data-kernel-id={kernelId ?? ''}
        data-lease-id={lease?.id ?? ''}
        title={`${summary.description}\nClick to show all GPUs.`}
        aria-describedby={descriptionId}
        onClick={onActivate}
      >
        {summary.text}
      </button>
      <span id={descriptionId} className="jp-gpusched-visuallyHidden">
        {summary.description} Activate to show all GPUs.
      </span>
    </>
  );
}
