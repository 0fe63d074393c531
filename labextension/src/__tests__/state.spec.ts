/**
 * The pure state updates (`state.ts`): no server, no socket, no signals.
 */
import type { INotice, IStatus } from '../types';
import {
  applyEvent,
  isOwnLease,
  normalizeQueue,
  normalizeStatus,
  upsertDevice,
  upsertLease
} from '../state';
import { device, lease, payload, status } from './fixtures';

describe('normalizeQueue', () => {
  it('accepts lease ids and objects, fills positions, sorts', () => {
    const leases = [lease('b', { state: 'pending', position: 1, user: 'bob' })];
    const queue = normalizeQueue(
      ['a', { id: 'b' }, { lease_id: 'c', position: 3 }, {}],
      leases
    );
    expect(queue.map(e => [e.lease_id, e.position])).toEqual([
      ['a', 1],
      ['b', 1],
      ['c', 3]
    ]);
    expect(queue[1].user).toBe('bob');
  });

  it("keeps each entry's reason and waiting time", () => {
    const queue = normalizeQueue(
      [
        {
          lease_id: 'b',
          position: 1,
          reason: 'waiting for a GPU; 1st in line: within quota',
          waiting_since: '2024-05-01T10:00:00Z'
        },
        { lease_id: 'c', position: 2, reason: '' }
      ],
      []
    );
    expect(queue[0].reason).toBe(
      'waiting for a GPU; 1st in line: within quota'
    );
    expect(queue[0].waiting_since).toBe('2024-05-01T10:00:00Z');
    expect(queue[1].reason).toBeUndefined();
  });
});

describe('normalizeStatus', () => {
  it('orders devices by index and drops released leases', () => {
    const s = normalizeStatus(
      payload({
        devices: [device(2), device(0)],
        leases: [lease('a'), lease('gone', { state: 'released' })],
        queue: ['w']
      })
    );
    expect(s.devices.map(d => d.index)).toEqual([0, 2]);
    expect(s.leases.map(l => l.id)).toEqual(['a']);
    expect(s.queue).toEqual([{ lease_id: 'w', position: 1 }]);
  });
});

describe('upsertLease', () => {
  const base = status({
    leases: [
      lease('a', { devices: ['GPU-0'] }),
      lease('w1', { state: 'pending', position: 1 }),
      lease('w2', { state: 'pending', position: 2 }),
      lease('w3', { state: 'pending', position: 3 })
    ],
    queue: [
      { lease_id: 'w1', position: 1 },
      { lease_id: 'w2', position: 2 },
      { lease_id: 'w3', position: 3 }
    ]
  });

  it('inserts a new lease', () => {
    const next = upsertLease(base, lease('b'));
    expect(next.leases.map(l => l.id)).toContain('b');
    expect(base.leases.map(l => l.id)).not.toContain('b');
  });

  it('merges the fields of a partial update', () => {
    const next = upsertLease(base, {
      id: 'a',
      state: 'idle',
      idle_seconds: 40
    });
    const a = next.leases.find(l => l.id === 'a');
    expect(a).toMatchObject({
      state: 'idle',
      idle_seconds: 40,
      devices: ['GPU-0']
    });
  });

  it("inserts another user's lease whose kernel is hidden", () => {
    const hidden = lease('h', {
      kernel_id: null,
      user: 'another user',
      holder: 'another user'
    });
    expect(upsertLease(base, hidden).leases.map(l => l.id)).toContain('h');
  });

  it('ignores a partial update of a lease it never saw', () => {
    expect(upsertLease(base, { id: 'zzz', state: 'idle' })).toBe(base);
  });

  it('removes a released lease and moves those behind it up', () => {
    const next = upsertLease(base, { id: 'w1', state: 'released' });
    expect(next.leases.map(l => l.id)).toEqual(['a', 'w2', 'w3']);
    expect(next.queue).toEqual([
      { lease_id: 'w2', position: 1 },
      { lease_id: 'w3', position: 2 }
    ]);
  });

  it('moves an entry to its new position, whatever order the updates come in', () => {
    let next = upsertLease(base, { id: 'w3', position: 1 });
    expect(next.queue.map(e => [e.lease_id, e.position])).toEqual([
      ['w3', 1],
      ['w1', 2],
      ['w2', 3]
    ]);
    // The server then renumbers everyone; positions past the end are clamped.
    next = upsertLease(next, { id: 'w1', position: 9 });
    next = upsertLease(next, { id: 'w2', position: 2 });
    expect(next.queue.map(e => [e.lease_id, e.position])).toEqual([
      ['w3', 1],
      ['w2', 2],
      ['w1', 3]
    ]);
  });

  it('takes a granted lease out of the queue', () => {
    const next = upsertLease(base, {
      id: 'w2',
      state: 'active',
      position: null,
      devices: ['GPU-1']
    });
    expect(next.queue.map(e => [e.lease_id, e.position])).toEqual([
      ['w1', 1],
      ['w3', 2]
    ]);
  });

  it('queues a new pending lease at its position', () => {
    const next = upsertLease(
      base,
      lease('w0', { state: 'pending', position: 1, user: 'bob' })
    );
    expect(next.queue.map(e => e.lease_id)).toEqual(['w0', 'w1', 'w2', 'w3']);
    expect(next.queue.map(e => e.position)).toEqual([1, 2, 3, 4]);
    expect(next.queue[0]).toMatchObject({
      position: 1,
      user: 'bob',
      kernel_id: 'kernel-w0'
    });
    const appended = upsertLease(
      base,
      lease('w9', { state: 'pending', position: null })
    );
    expect(appended.queue[3]).toMatchObject({ lease_id: 'w9', position: 4 });
  });
});

describe('upsertDevice', () => {
  it('merges a known device, adds a complete new one, keeps index order', () => {
    const base = status({ devices: [device(0), device(2)] });
    const merged = upsertDevice(base, {
      uuid: 'GPU-2',
      utilization: 93,
      health: 'drained'
    });
    expect(merged.devices[1]).toMatchObject({
      index: 2,
      utilization: 93,
      health: 'drained'
    });

    const added = upsertDevice(base, {
      uuid: 'MIG-1',
      index: 1,
      name: 'A100 MIG 1g.10gb',
      memory_total: 10
    });
    expect(added.devices.map(d => d.uuid)).toEqual(['GPU-0', 'MIG-1', 'GPU-2']);
    expect(added.devices[1]).toMatchObject({
      health: 'ok',
      processes: [],
      memory_used: null
    });

    expect(upsertDevice(base, { uuid: 'unknown', utilization: 5 })).toBe(base);
  });
});

describe('applyEvent', () => {
  it('drops lease and device events before the first snapshot', () => {
    expect(applyEvent(null, { type: 'lease', lease: lease('a') })).toBeNull();
    expect(applyEvent(null, { type: 'device', device: device(0) })).toBeNull();
  });

  it('replaces the status with a snapshot', () => {
    const next = applyEvent(status({ leases: [lease('old')] }), {
      type: 'snapshot',
      status: payload({ leases: [lease('new')] })
    });
    expect(next?.leases.map(l => l.id)).toEqual(['new']);
  });

  it('changes nothing for a notice', () => {
    const s = status();
    const notice: INotice = {
      kind: 'granted',
      lease_id: 'a',
      kernel_id: 'k',
      message: ''
    };
    expect(applyEvent(s, { type: 'notice', notice })).toBe(s);
  });
});

describe('isOwnLease', () => {
  it("follows the server's `mine` where it is sent", () => {
    const s = status({ user: 'alice' });
    expect(isOwnLease(s, lease('a', { user: 'alice', mine: false }))).toBe(
      false
    );
    expect(isOwnLease(s, lease('b', { user: 'bob', mine: true }))).toBe(true);
  });

  it('compares users when the server names this user', () => {
    const s = status({ user: 'alice' });
    expect(isOwnLease(s, lease('a', { user: 'alice' }))).toBe(true);
    expect(isOwnLease(s, lease('b', { user: 'bob' }))).toBe(false);
  });

  it('never owns a lease shown as another user', () => {
    const s = status({ user: 'another user' });
    expect(
      isOwnLease(
        s,
        lease('a', { user: 'another user', holder: 'another user' })
      )
    ).toBe(false);
  });

  it("owns the leases of this server's kernels when the user is unknown", () => {
    const kernels = new Map([['k1', 'Train.ipynb']]);
    expect(isOwnLease(status(), lease('a', { kernel_id: 'k1' }), kernels)).toBe(
      true
    );
    expect(isOwnLease(status(), lease('b', { kernel_id: 'k2' }), kernels)).toBe(
      false
    );
  });
});

describe('purity', () => {
  const frozen = <T>(value: T): T => {
    if (typeof value === 'object' && value !== null) {
      Object.values(value).forEach(frozen);
      Object.freeze(value);
    }
    return value;
  };

  const before = (): IStatus =>
    frozen(
      normalizeStatus(
        payload({
          devices: [device(1), device(0)],
          leases: [
            lease('a', { devices: ['GPU-0'], device_indices: [0] }),
            lease('w1', {
              state: 'pending',
              devices: [],
              device_indices: [],
              position: 1
            }),
            lease('w2', {
              state: 'pending',
              devices: [],
              device_indices: [],
              position: 2
            })
          ],
          queue: ['w1', 'w2']
        })
      )
    );

  it('never modifies the status it is given', () => {
    const s = before();
    const copy = JSON.parse(JSON.stringify(s)) as IStatus;
    // Frozen objects throw on any write in strict mode, so each update proves it copies.
    upsertLease(s, { id: 'a', state: 'idle' });
    upsertLease(s, { id: 'w1', state: 'released' });
    upsertLease(s, { id: 'w2', position: 1 });
    upsertDevice(s, { uuid: 'GPU-1', utilization: 99, health: 'drained' });
    upsertDevice(s, {
      uuid: 'GPU-9',
      index: 9,
      name: 'new',
      memory_total: 1
    });
    applyEvent(s, { type: 'snapshot', status: payload() });
    expect(s).toEqual(copy);
  });

  it('returns the same object where an event changes nothing', () => {
    const s = before();
    const notice: INotice = {
      kind: 'kept',
      lease_id: 'a',
      kernel_id: 'k',
      message: 'kept'
    };
    expect(applyEvent(s, { type: 'notice', notice })).toBe(s);
    expect(applyEvent(s, { type: 'lease', lease: { id: 'never-seen' } })).toBe(
      s
    );
    expect(
      applyEvent(s, { type: 'device', device: { uuid: 'GPU-x', health: 'ok' } })
    ).toBe(s);
  });

  it('replays a sequence of events to the state the last snapshot would give', () => {
    let s: IStatus | null = null;
    s = applyEvent(s, {
      type: 'snapshot',
      status: payload({ devices: [device(0)] })
    });
    s = applyEvent(s, {
      type: 'lease',
      lease: lease('a', { devices: ['GPU-0'], device_indices: [0] })
    });
    s = applyEvent(s, {
      type: 'lease',
      lease: lease('w', { state: 'pending', devices: [], device_indices: [] })
    });
    s = applyEvent(s, { type: 'lease', lease: { id: 'a', state: 'released' } });
    s = applyEvent(s, {
      type: 'lease',
      lease: { id: 'w', state: 'active', devices: ['GPU-0'], position: null }
    });
    s = applyEvent(s, {
      type: 'device',
      device: { uuid: 'GPU-0', lease_ids: ['w'], utilization: 40 }
    });
    expect(s?.leases.map(l => [l.id, l.state, l.devices])).toEqual([
      ['w', 'active', ['GPU-0']]
    ]);
    expect(s?.queue).toEqual([]);
    expect(s?.devices.map(d => [d.uuid, d.lease_ids, d.utilization])).toEqual([
      ['GPU-0', ['w'], 40]
    ]);
  });
});
