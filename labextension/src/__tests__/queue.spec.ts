/**
 * A new claim that must queue, as the server announces it over the events websocket: the
 * sidebar's queue, the status bar of the waiting kernel and one "queued" notification.
 */
import type { Notification } from '@jupyterlab/apputils';
import type { ReadonlyJSONValue } from '@lumino/coreutils';

import { summarizeKernel } from '../format';
import { GPUSchedNotifier, INotificationSink } from '../notifier';
import { harness } from './fakes';
import { T0 } from './fixtures';

const A = 'aaaaaaaa-0000-4000-8000-000000000001';
const B = 'bbbbbbbb-0000-4000-8000-000000000002';
const UUID = 'GPU-a663402b-ee40-55d5-be3a-5ff372c70174';

const held = {
  id: 'lease-a',
  kernel_id: A,
  user: 'root',
  holder: 'root',
  notebook: 'a.ipynb',
  count: 1,
  devices: [UUID],
  device_indices: [0],
  memory: null,
  mode: 'exclusive',
  priority: 0,
  state: 'active',
  position: null,
  created_at: '2024-05-01T10:00:00.000Z',
  granted_at: '2024-05-01T10:00:00.000Z',
  last_active_at: '2024-05-01T10:00:00.000Z',
  idle_seconds: 0.0,
  reclaim_at: null,
  reclaim_step: null,
  keep_until: null,
  memory_held: null,
  reason: 'granted least loaded free GPU: GPU 0',
  mine: true
};

const snapshot = {
  type: 'snapshot',
  mode: 'standalone',
  backend: 'simulated',
  policy: 'hybrid',
  user: 'root',
  is_admin: true,
  devices: [
    {
      uuid: UUID,
      index: 0,
      name: 'Simulated H100 80GB',
      memory_total: 85899345920,
      memory_used: 0,
      utilization: 0,
      health: 'ok',
      lease_ids: ['lease-a'],
      processes: []
    }
  ],
  leases: [held],
  queue: [],
  time: T0 / 1000
};

// Copied from the websocket of a server whose only GPU is held: B's claim, then its notice.
const pending = {
  type: 'lease',
  lease: {
    ...held,
    id: 'lease-b',
    kernel_id: B,
    notebook: null,
    devices: [],
    device_indices: [],
    state: 'pending',
    position: 1,
    granted_at: null,
    idle_seconds: null,
    reason: 'waiting for a GPU'
  }
};
const queued = {
  type: 'notice',
  kind: 'queued',
  lease_id: 'lease-b',
  kernel_id: B,
  user: 'root',
  message: 'waiting for a GPU',
  reclaim_at: null,
  state: 'pending',
  position: 1
};

class Sink implements INotificationSink {
  shown: Array<{ id: string; message: string; dismissed: boolean }> = [];
  emit(message: string, _type: Notification.TypeOptions): string {
    const id = `n${this.shown.length + 1}`;
    this.shown.push({ id, message, dismissed: false });
    return id;
  }
  update(_args: Notification.IUpdate<ReadonlyJSONValue>): boolean {
    return true;
  }
  dismiss(id?: string): void {
    this.shown
      .filter(item => id === undefined || item.id === id)
      .forEach(item => {
        item.dismissed = true;
      });
  }
  get visible(): string[] {
    return this.shown.filter(item => !item.dismissed).map(item => item.message);
  }
}

describe('a new claim that must queue', () => {
  it('shows in the queue, in the status bar of its kernel and in one notification', () => {
    const { model, sockets } = harness();
    model.localKernels = new Map([
      [A, 'a.ipynb'],
      [B, 'b.ipynb']
    ]);
    const sink = new Sink();
    const notifier = new GPUSchedNotifier({ model, sink });
    model.start();
    sockets[0].open();
    sockets[0].send(snapshot);
    expect(model.connection).toBe('live');
    expect(summarizeKernel(model.status, model.leaseOfKernel(B), T0).text).toBe(
      'GPU: none'
    );

    sockets[0].send(pending);
    sockets[0].send(queued);

    expect(model.status?.queue).toEqual([
      expect.objectContaining({
        lease_id: 'lease-b',
        kernel_id: B,
        position: 1
      })
    ]);
    const summary = summarizeKernel(model.status, model.leaseOfKernel(B), T0);
    expect(summary).toMatchObject({ text: 'GPU: queued #1', state: 'pending' });
    expect(sink.visible).toEqual([
      'GPU request for b.ipynb queued at position 1'
    ]);

    // The magic asks again while it waits: the same lease comes back, nothing doubles.
    sockets[0].send(pending);
    sockets[0].send(queued);
    expect(model.status?.queue).toHaveLength(1);
    expect(sink.visible).toEqual([
      'GPU request for b.ipynb queued at position 1'
    ]);

    // A's lease still shows where it was.
    expect(
      summarizeKernel(model.status, model.leaseOfKernel(A), T0).text
    ).toMatch(/^GPU 0: /);

    notifier.dispose();
    model.dispose();
  });

  it('shows a queued claim that the REST status lists while the socket is down', async () => {
    const { model, client } = harness({
      openSocket: () => {
        throw new Error('no socket');
      }
    });
    client.status = {
      ...snapshot,
      leases: [held, pending.lease],
      queue: [
        {
          lease_id: 'lease-b',
          kernel_id: B,
          user: 'root',
          position: 1,
          count: 1,
          waiting_since: null
        }
      ]
    } as unknown as typeof client.status;
    await model.refresh();
    expect(summarizeKernel(model.status, model.leaseOfKernel(B), T0).text).toBe(
      'GPU: queued #1'
    );
    model.dispose();
  });
});
