import type { Notification } from '@jupyterlab/apputils';
import type { ReadonlyJSONValue } from '@lumino/coreutils';

import { INotice } from '../api';
import { GPUSchedModel } from '../model';
import {
  GPUSchedNotifier,
  INotificationSink,
  MAX_MESSAGE,
  noticeSentence
} from '../notifier';
import { FakeClient } from './fakes';
import { device, iso, lease, payload, T0 } from './fixtures';

interface IShown {
  id: string;
  message: string;
  type: Notification.TypeOptions;
  options: Notification.IOptions<ReadonlyJSONValue>;
  dismissed: boolean;
}

class FakeSink implements INotificationSink {
  shown: IShown[] = [];
  private _next = 0;

  emit(
    message: string,
    type: Notification.TypeOptions,
    options: Notification.IOptions<ReadonlyJSONValue>
  ): string {
    const id = `n${++this._next}`;
    this.shown.push({ id, message, type, options, dismissed: false });
    return id;
  }

  update(args: Notification.IUpdate<ReadonlyJSONValue>): boolean {
    const item = this.shown.find(
      shown => shown.id === args.id && !shown.dismissed
    );
    if (!item) {
      return false;
    }
    item.message = args.message ?? item.message;
    item.type = args.type ?? item.type;
    item.options = { ...item.options, ...args };
    return true;
  }

  dismiss(id?: string): void {
    for (const item of this.shown) {
      if (id === undefined || item.id === id) {
        item.dismissed = true;
      }
    }
  }

  get visible(): IShown[] {
    return this.shown.filter(item => !item.dismissed);
  }

  get last(): IShown {
    return this.shown[this.shown.length - 1];
  }
}

const KERNEL = 'kernel-0001-aaaa';

function notice(kind: string, overrides: Partial<INotice> = {}): INotice {
  return { kind, lease_id: 'L1', kernel_id: KERNEL, message: '', ...overrides };
}

describe('GPUSchedNotifier', () => {
  let now: number;
  let client: FakeClient;
  let model: GPUSchedModel;
  let sink: FakeSink;
  let notifier: GPUSchedNotifier;

  beforeEach(() => {
    jest.useFakeTimers();
    now = T0;
    client = new FakeClient();
    model = new GPUSchedModel({
      client,
      openSocket: () => {
        throw new Error('not used');
      },
      socketUrl: 'ws://unused',
      clock: () => now,
      standby: 'never'
    });
    model.localKernels = new Map([[KERNEL, 'work/Train.ipynb']]);
    model.handleEvent({
      type: 'snapshot',
      status: payload({
        user: 'alice',
        devices: [device(0), device(1)],
        leases: [
          lease('L1', {
            kernel_id: KERNEL,
            devices: ['GPU-0'],
            device_indices: [0],
            state: 'idle'
          }),
          lease('B1', {
            kernel_id: 'bob-kernel',
            user: 'bob',
            devices: ['GPU-1']
          })
        ]
      })
    });
    sink = new FakeSink();
    notifier = new GPUSchedNotifier({ model, sink });
  });

  afterEach(() => {
    notifier.dispose();
    model.dispose();
    jest.useRealTimers();
  });

  it('tells the queue position', () => {
    model.handleEvent({
      type: 'notice',
      notice: notice('queued', { position: 2, message: 'all 2 GPUs are busy' })
    });
    expect(sink.last).toMatchObject({
      message:
        'GPU request for Train.ipynb queued at position 2: all 2 GPUs are busy',
      type: 'info'
    });
  });

  it('replaces the queued notification when the GPU is granted', () => {
    notifier.handle(notice('queued', { position: 1 }));
    const queued = sink.last;
    notifier.handle(notice('granted'));
    expect(queued.dismissed).toBe(true);
    expect(sink.visible).toHaveLength(1);
    expect(sink.last).toMatchObject({
      message: 'GPU 0 (A100-SXM4-80GB) granted to Train.ipynb',
      type: 'success'
    });
  });

  it('counts down to a reclaim and offers to keep the GPU', async () => {
    notifier.handle(
      notice('reclaim_warning', {
        reclaim_at: iso(T0 + 60000),
        message: 'bob is waiting'
      })
    );
    const warning = sink.last;
    expect(warning.type).toBe('warning');
    expect(warning.message).toBe(
      'GPU 0 of Train.ipynb will be reclaimed in 1:00 — bob is waiting'
    );
    expect(warning.options.autoClose).toBe(false);
    const actions = warning.options.actions ?? [];
    expect(actions.map(action => action.label)).toEqual(['Keep 30 min']);

    now += 1000;
    jest.advanceTimersByTime(1000);
    expect(warning.message).toBe(
      'GPU 0 of Train.ipynb will be reclaimed in 0:59 — bob is waiting'
    );

    actions[0].callback(new MouseEvent('click'));
    expect(client.keepLease).toHaveBeenCalledWith('L1', 1800);
    await Promise.resolve();
    await Promise.resolve();
    expect(warning.dismissed).toBe(true);
    expect(sink.last).toMatchObject({
      message: 'GPU of Train.ipynb kept for 30 min',
      type: 'success'
    });
  });

  it('says when the reclaim starts', () => {
    notifier.handle(notice('reclaim_warning', { reclaim_at: iso(T0 + 2000) }));
    const warning = sink.last;
    now += 2000;
    jest.advanceTimersByTime(2000);
    expect(warning.message).toBe('GPU 0 of Train.ipynb is being reclaimed');
    expect(warning.options.actions).toEqual([]);
  });

  it('drops the countdown when the kernel becomes active again', () => {
    notifier.handle(notice('reclaim_warning', { reclaim_at: iso(T0 + 60000) }));
    const warning = sink.last;
    model.handleEvent({
      type: 'lease',
      lease: { id: 'L1', state: 'active', reclaim_at: null }
    });
    expect(warning.dismissed).toBe(true);
    jest.advanceTimersByTime(5000);
    expect(warning.message).toContain('1:00');
  });

  it('reports a failed keep', async () => {
    client.keepLease.mockRejectedValueOnce(
      new Error('keep is limited to 10 min')
    );
    notifier.handle(notice('reclaim_warning', { reclaim_at: iso(T0 + 60000) }));
    (sink.last.options.actions ?? [])[0].callback(new MouseEvent('click'));
    await Promise.resolve();
    await Promise.resolve();
    expect(sink.last).toMatchObject({
      message:
        'Could not keep the GPU of Train.ipynb: keep is limited to 10 min',
      type: 'error'
    });
  });

  it('tells about suspend, resume and loss', () => {
    notifier.handle(notice('suspended'));
    expect(sink.last).toMatchObject({
      message:
        'GPU of Train.ipynb suspended; it is restored when the next cell runs',
      type: 'info'
    });
    notifier.handle(notice('resumed'));
    expect(sink.last).toMatchObject({
      message: 'GPU 0 resumed for Train.ipynb',
      type: 'success'
    });
    notifier.handle(
      notice('lost', { message: 'Xid 79: GPU fell off the bus' })
    );
    expect(sink.last).toMatchObject({
      message: 'GPU of Train.ipynb lost: Xid 79: GPU fell off the bus',
      type: 'error'
    });
    expect(sink.last.options.autoClose).toBe(false);
  });

  it('ends the countdown when the reclaim is called off', () => {
    notifier.handle(notice('reclaim_warning', { reclaim_at: iso(T0 + 60000) }));
    const warning = sink.last;
    notifier.handle(
      notice('reclaim_cancelled', { message: 'the kernel ran a cell' })
    );
    expect(warning.dismissed).toBe(true);
    expect(sink.last).toMatchObject({
      message:
        'Reclaim of GPU 0 of Train.ipynb cancelled: the kernel ran a cell',
      type: 'info'
    });
  });

  it('does not repeat a keep this page asked for', async () => {
    notifier.handle(notice('reclaim_warning', { reclaim_at: iso(T0 + 60000) }));
    (sink.last.options.actions ?? [])[0].callback(new MouseEvent('click'));
    notifier.handle(notice('kept', { message: 'Kept for 30m' }));
    await Promise.resolve();
    await Promise.resolve();
    expect(sink.visible.map(item => item.message)).toEqual([
      'GPU of Train.ipynb kept for 30 min'
    ]);
  });

  it('tells about a keep from elsewhere (the %gpu magic)', () => {
    notifier.handle(notice('kept', { message: 'Kept for 1h' }));
    expect(sink.last).toMatchObject({
      message: 'GPU of Train.ipynb kept for 1h',
      type: 'success'
    });
  });

  it('tells about releases and disruptive reclaims', () => {
    notifier.handle(
      notice('released', { message: 'Your GPU lease was released by admin' })
    );
    expect(sink.last).toMatchObject({
      message: 'GPU of Train.ipynb released by admin',
      type: 'info'
    });
    notifier.handle(
      notice('reclaimed', {
        message: 'reclaimed: the kernel was restarted to free its GPU'
      })
    );
    expect(sink.last).toMatchObject({
      message:
        'GPU of Train.ipynb reclaimed: the kernel was restarted to free its GPU',
      type: 'warning'
    });
    expect(sink.visible).toHaveLength(1);
  });

  it('names kernels it cannot place', () => {
    notifier.handle(
      notice('granted', { lease_id: 'X9', kernel_id: 'abcdef0123456789' })
    );
    expect(sink.last.message).toBe('GPU granted to kernel abcdef01');
  });

  it('shows unknown kinds by their message', () => {
    notifier.handle(
      notice('freed_cache', { message: 'Freed 12 GiB of cached memory' })
    );
    expect(sink.last).toMatchObject({
      message: 'Freed 12 GiB of cached memory',
      type: 'info'
    });
  });

  it("stays quiet about other users' leases", () => {
    notifier.handle(
      notice('granted', { lease_id: 'B1', kernel_id: 'bob-kernel' })
    );
    notifier.handle(
      notice('granted', { lease_id: null, kernel_id: null, user: 'bob' })
    );
    expect(sink.shown).toHaveLength(0);
  });

  it('stays quiet when notifications are off', () => {
    notifier.enabled = false;
    notifier.handle(notice('granted'));
    expect(sink.shown).toHaveLength(0);
  });

  it('removes running countdowns when turned off', () => {
    notifier.handle(notice('reclaim_warning', { reclaim_at: iso(T0 + 60000) }));
    notifier.enabled = false;
    expect(sink.last.dismissed).toBe(true);
  });
});

/** Word pairs that occur more than once: a sentence that says the same thing twice. */
function repeatedPairs(text: string): string[] {
  const words = text
    .toLowerCase()
    .split(/\s+/)
    .map(word => word.replace(/^[^a-z0-9]+|[^a-z0-9]+$/g, ''))
    .filter(word => word.length > 0);
  const seen = new Set<string>();
  const repeated: string[] = [];
  for (let i = 0; i + 1 < words.length; i++) {
    const pair = `${words[i]} ${words[i + 1]}`;
    if (seen.has(pair)) {
      repeated.push(pair);
    }
    seen.add(pair);
  }
  return repeated;
}

describe('notification wording', () => {
  // What the server sends with each kind (arbiter.py and the core's reasons).
  const SERVER: Array<[string, string]> = [
    ['queued', 'waiting for a GPU'],
    ['queued', 'waiting for a GPU to restore onto'],
    [
      'released',
      'released while idle: the kernel held no GPU memory; its next cell asks again'
    ],
    ['released', 'Your GPU lease was released by root'],
    [
      'reclaimed',
      'reclaimed: the kernel was restarted to free its GPU (idle 1m 05s while 1 kernel waits (borrowed capacity))'
    ],
    [
      'suspended',
      'suspended: GPU state checkpointed to host memory; the next cell restores it'
    ],
    ['kept', 'Kept for 30m'],
    ['resumed', 'restored onto GPU 0'],
    [
      'lost',
      "restore failed, the kernel's GPU state is lost: CUDA_ERROR_ILLEGAL_STATE"
    ],
    [
      'free_cache',
      'the kernel holds more than its share: dropping framework caches'
    ]
  ];

  let model: GPUSchedModel;
  let sink: FakeSink;
  let notifier: GPUSchedNotifier;

  beforeEach(() => {
    model = new GPUSchedModel({
      client: new FakeClient(),
      openSocket: () => {
        throw new Error('not used');
      },
      socketUrl: 'ws://unused',
      clock: () => T0,
      standby: 'never'
    });
    model.localKernels = new Map([
      [KERNEL, 'projects/a-notebook-with-a-rather-long-name-2024.ipynb']
    ]);
    model.handleEvent({
      type: 'snapshot',
      status: payload({
        leases: [
          lease('L1', {
            kernel_id: KERNEL,
            devices: ['GPU-0'],
            device_indices: [0]
          })
        ]
      })
    });
    sink = new FakeSink();
    notifier = new GPUSchedNotifier({ model, sink });
  });

  afterEach(() => {
    notifier.dispose();
    model.dispose();
  });

  it.each(SERVER)(
    'says %s with "%s" in one whole sentence',
    (kind, message) => {
      notifier.handle(notice(kind, { message, position: 1 }));
      const shown = sink.last.message;
      expect(shown.length).toBeLessThanOrEqual(MAX_MESSAGE);
      expect(shown).not.toMatch(/…$/);
      expect(shown).not.toMatch(/\.\s+\S/);
      expect(repeatedPairs(shown)).toEqual([]);
      expect(balancedParens(shown)).toBe(true);
    }
  );

  it('leaves out what the headline says already', () => {
    notifier.handle(
      notice('queued', { message: 'waiting for a GPU', position: 1 })
    );
    expect(sink.last.message).toBe(
      'GPU request for a-notebook-with-a-rather-l…me-2024.ipynb queued at position 1'
    );
    notifier.handle(
      notice('released', {
        message:
          'released while idle: the kernel held no GPU memory; its next cell asks again'
      })
    );
    expect(sink.last.message).toBe(
      'GPU of a-notebook-with-a-rather-l…me-2024.ipynb released while idle: the kernel held no GPU memory; its next cell asks again'
    );
  });

  it('drops whole clauses that do not fit, never cuts a word', () => {
    expect(
      noticeSentence(
        'GPU of train.ipynb reclaimed',
        'reclaimed: the kernel was restarted to free its GPU (idle 1m 05s while 3 kernels of 2 users wait for a GPU of this model and size)'
      )
    ).toBe(
      'GPU of train.ipynb reclaimed: the kernel was restarted to free its GPU'
    );
    expect(noticeSentence('GPU of a.ipynb lost', 'x'.repeat(200))).toBe(
      'GPU of a.ipynb lost'
    );
  });
});

function balancedParens(text: string): boolean {
  return (text.match(/\(/g) ?? []).length === (text.match(/\)/g) ?? []).length;
}
