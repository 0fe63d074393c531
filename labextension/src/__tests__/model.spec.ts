import { GPUSchedError, INotice, parseEvent } from '../api';
import { socketRetryDelay } from '../model';
import { harness, IHarness, sleep, waitFor } from './fakes';
import { device, GiB, iso, lease, payload, T0 } from './fixtures';

// ---------------------------------------------------------------------------------------------
// Parsing

describe('parseEvent', () => {
  it('accepts objects nested under their type name or inline', () => {
    const nested = parseEvent(
      JSON.stringify({ type: 'lease', lease: lease('a') })
    );
    const inline = parseEvent(JSON.stringify({ type: 'lease', ...lease('a') }));
    expect(nested).toEqual({ type: 'lease', lease: lease('a') });
    expect(inline).toEqual({ type: 'lease', lease: lease('a') });

    const snapshot = parseEvent({ type: 'snapshot', ...payload() });
    expect(snapshot?.type).toBe('snapshot');
    expect(parseEvent({ type: 'snapshot', status: payload() })).toEqual({
      type: 'snapshot',
      status: payload()
    });
    expect(parseEvent({ type: 'device', device: device(3) })).toEqual({
      type: 'device',
      device: device(3)
    });
  });

  it('normalizes notices', () => {
    const event = parseEvent({
      type: 'notice',
      kind: 'reclaim_warning',
      lease_id: 'a',
      kernel_id: 'k',
      message: 'idle for 5 min while bob waits',
      reclaim_at: '2024-05-01T10:01:00Z'
    });
    expect(event).toEqual({
      type: 'notice',
      notice: {
        kind: 'reclaim_warning',
        lease_id: 'a',
        kernel_id: 'k',
        message: 'idle for 5 min while bob waits',
        reclaim_at: '2024-05-01T10:01:00Z'
      }
    });
    expect(parseEvent({ type: 'notice', notice: { kind: 'granted' } })).toEqual(
      {
        type: 'notice',
        notice: {
          kind: 'granted',
          lease_id: null,
          kernel_id: null,
          message: ''
        }
      }
    );
  });

  it('ignores what it does not understand', () => {
    expect(parseEvent('not json')).toBeNull();
    expect(parseEvent('[1, 2]')).toBeNull();
    expect(parseEvent({ type: 'mystery' })).toBeNull();
    expect(
      parseEvent({ type: 'lease', lease: { state: 'active' } })
    ).toBeNull();
    expect(
      parseEvent({ type: 'snapshot', status: { devices: [] } })
    ).toBeNull();
    expect(parseEvent({ type: 'notice', message: 'no kind' })).toBeNull();
  });
});

// ---------------------------------------------------------------------------------------------
// Transport decisions

describe('socketRetryDelay', () => {
  const options = {
    baseMs: 2000,
    maxMs: 60000,
    maxAttempts: 5,
    slowMs: 300000
  };

  it('backs off exponentially up to the cap', () => {
    expect(
      [1, 2, 3, 4].map(n => socketRetryDelay(n, false, 1006, options))
    ).toEqual([2000, 4000, 8000, 16000]);
    expect(socketRetryDelay(10, true, 1006, options)).toBe(60000);
  });

  it('slows down when the socket never worked', () => {
    expect(socketRetryDelay(5, false, 1006, options)).toBe(300000);
    expect(socketRetryDelay(5, true, 1006, options)).toBe(32000);
  });

  it('slows down when the server refuses the socket', () => {
    expect(socketRetryDelay(1, true, 1008, options)).toBe(300000);
    expect(socketRetryDelay(1, true, 4403, options)).toBe(300000);
    expect(socketRetryDelay(1, true, 1001, options)).toBe(2000);
  });
});

// ---------------------------------------------------------------------------------------------
// The model

describe('GPUSchedModel', () => {
  let h: IHarness;

  afterEach(() => {
    h?.model.dispose();
  });

  it('goes live on the first snapshot of the events socket', () => {
    h = harness();
    h.model.start();
    expect(h.sockets).toHaveLength(1);
    expect(h.sockets[0].url).toBe('ws://example/api/gpusched/events');
    expect(h.model.connection).toBe('connecting');

    h.sockets[0].open();
    h.sockets[0].send({
      type: 'snapshot',
      status: payload({ leases: [lease('a')] })
    });
    expect(h.model.connection).toBe('live');
    expect(h.model.status?.leases.map(l => l.id)).toEqual(['a']);
    expect(h.changes()).toBeGreaterThan(0);
    expect(h.client.getStatus).not.toHaveBeenCalled();
  });

  it('upserts lease and device events and finds the lease of a kernel', () => {
    h = harness();
    h.model.start();
    const socket = h.sockets[0];
    socket.open();
    socket.send({ type: 'snapshot', ...payload() });
    expect(h.model.leaseOfKernel('k1')).toBeNull();

    const before = h.changes();
    socket.send({
      type: 'lease',
      lease: lease('a', {
        kernel_id: 'k1',
        devices: ['GPU-1'],
        device_indices: [1]
      })
    });
    expect(h.changes()).toBe(before + 1);
    expect(h.model.leaseOfKernel('k1')?.id).toBe('a');

    socket.send({ type: 'lease', lease: { id: 'a', state: 'idle' } });
    expect(h.model.leaseOfKernel('k1')?.state).toBe('idle');

    socket.send({ type: 'device', device: { uuid: 'GPU-1', utilization: 77 } });
    expect(h.model.status?.devices[1].utilization).toBe(77);

    socket.send({ type: 'lease', lease: { id: 'a', state: 'released' } });
    expect(h.model.leaseOfKernel('k1')).toBeNull();
  });

  it("remembers how a kernel's lease ended, with the GPUs it held", () => {
    h = harness();
    h.model.start();
    const socket = h.sockets[0];
    socket.open();
    const held = lease('a', {
      kernel_id: 'k1',
      devices: ['GPU-1'],
      device_indices: [1],
      mine: true
    });
    socket.send({ type: 'snapshot', ...payload({ leases: [held] }) });
    const ended: string[] = [];
    h.model.leaseEnded.connect((_, l) => ended.push(l.id));
    expect(h.model.endedLeaseOfKernel('k1')).toBeNull();

    // A released lease names no GPU: the model keeps those it held.
    socket.send({
      type: 'lease',
      lease: {
        ...held,
        state: 'released',
        devices: [],
        device_indices: [],
        reason: 'released by kernel k1'
      }
    });
    expect(ended).toEqual(['a']);
    expect(h.model.leaseOfKernel('k1')).toBeNull();
    expect(h.model.endedLeaseOfKernel('k1')).toMatchObject({
      id: 'a',
      reason: 'released by kernel k1',
      device_indices: [1]
    });
    expect(h.model.endedLease('a')?.kernel_id).toBe('k1');

    // A new lease of the kernel: it holds one again, and the old end no longer counts.
    socket.send({ type: 'lease', lease: lease('b', { kernel_id: 'k1' }) });
    expect(h.model.endedLeaseOfKernel('k1')).toBeNull();
  });

  it('asks the server how a lease ended when it went without an event', async () => {
    h = harness();
    h.model.start();
    const socket = h.sockets[0];
    socket.open();
    const held = lease('a', {
      kernel_id: 'k1',
      device_indices: [0],
      mine: true
    });
    socket.send({ type: 'snapshot', ...payload({ leases: [held] }) });
    h.client.ended.a = {
      ...held,
      state: 'released',
      reason: 'reclaimed: the kernel was restarted to free its GPU: idle'
    };
    socket.send({ type: 'snapshot', ...payload({ leases: [] }) });
    await waitFor(() => h.model.endedLeaseOfKernel('k1') !== null);
    expect(h.client.getLease).toHaveBeenCalledWith('a');
    expect(h.model.endedLeaseOfKernel('k1')?.reason).toMatch(/restarted/);
  });

  it('emits notices without changing the status', () => {
    h = harness();
    const notices: INotice[] = [];
    h.model.noticeReceived.connect((_, notice) => notices.push(notice));
    h.model.start();
    h.sockets[0].open();
    h.sockets[0].send({ type: 'snapshot', ...payload() });
    const before = h.changes();
    h.sockets[0].send({
      type: 'notice',
      kind: 'queued',
      lease_id: 'w',
      kernel_id: 'k',
      message: 'position 2',
      position: 2
    });
    expect(notices).toEqual([
      {
        kind: 'queued',
        lease_id: 'w',
        kernel_id: 'k',
        message: 'position 2',
        position: 2
      }
    ]);
    expect(h.changes()).toBe(before);
  });

  it('polls the REST status when the socket fails, and returns to the socket', async () => {
    h = harness();
    h.client.status = payload({ leases: [lease('polled')] });
    h.model.start();
    h.sockets[0].fail();

    await waitFor(() => h.model.connection === 'polling');
    expect(h.client.getStatus).toHaveBeenCalled();
    expect(h.model.status?.leases.map(l => l.id)).toEqual(['polled']);

    // The socket is retried after the backoff delay and, once live, polling stops.
    await waitFor(() => h.sockets.length === 2);
    h.sockets[1].open();
    h.sockets[1].send({
      type: 'snapshot',
      ...payload({ leases: [lease('pushed')] })
    });
    expect(h.model.connection).toBe('live');
    expect(h.model.status?.leases.map(l => l.id)).toEqual(['pushed']);
    const calls = h.client.calls.getStatus;
    await sleep(1300);
    expect(h.client.calls.getStatus).toBe(calls);
  });

  it('fetches the usage again once after lease events change who holds or waits', async () => {
    h = harness({ usageRefreshMs: 30 });
    h.model.start();
    const socket = h.sockets[0];
    socket.open();
    socket.send({
      type: 'snapshot',
      ...payload({
        leases: [lease('a')],
        usage: [{ user: 'alice', gpu_hours: 0, quota: 1, held: 1 }]
      })
    });
    expect(h.model.connection).toBe('live');

    // An update that changes no state (a device, a lease's memory) fetches nothing.
    socket.send({ type: 'lease', lease: { id: 'a', memory_held: GiB } });
    await sleep(60);
    expect(h.client.getStatus).not.toHaveBeenCalled();

    h.client.status = payload({
      leases: [lease('a'), lease('b', { user: 'bob', state: 'pending' })],
      queue: [{ lease_id: 'b', position: 1, reason: 'waiting for a GPU' }],
      usage: [
        { user: 'alice', gpu_hours: 0.1, quota: 1, held: 1 },
        { user: 'bob', gpu_hours: 0, quota: 1, held: 0 }
      ]
    });
    socket.send({
      type: 'lease',
      lease: lease('b', { user: 'bob', state: 'pending', position: 1 })
    });
    socket.send({ type: 'lease', lease: { id: 'a', state: 'idle' } });
    await waitFor(() => h.client.calls.getStatus > 0);
    await sleep(60);
    expect(h.client.calls.getStatus).toBe(1);
    expect(h.model.connection).toBe('live');
    expect(h.model.status?.usage?.map(u => u.user)).toEqual(['alice', 'bob']);
    expect(h.model.status?.queue[0].reason).toBe('waiting for a GPU');
  });

  it('does not fetch again for a server that sends no usage', async () => {
    h = harness({ usageRefreshMs: 10 });
    h.model.start();
    h.sockets[0].open();
    h.sockets[0].send({ type: 'snapshot', ...payload() });
    h.sockets[0].send({ type: 'lease', lease: lease('a') });
    await sleep(40);
    expect(h.client.getStatus).not.toHaveBeenCalled();
  });

  it('falls back to polling when the socket cannot even be created', async () => {
    h = harness({
      openSocket: () => {
        throw new Error('WebSocket is not available');
      }
    });
    h.model.start();
    await waitFor(() => h.model.connection === 'polling');
    expect(h.model.status).not.toBeNull();
  });

  it('goes offline when neither socket nor REST answers, and recovers', async () => {
    h = harness();
    h.client.failWith = new GPUSchedError(
      'The GPU scheduler is not available',
      404
    );
    h.model.start();
    h.sockets[0].fail();
    await waitFor(() => h.model.connection === 'offline');
    expect(h.model.error).toBe('The GPU scheduler is not available');
    expect(h.model.status).toBeNull();

    h.client.failWith = null;
    await h.model.refresh();
    expect(h.model.connection).toBe('polling');
    expect(h.model.error).toBeNull();
    expect(h.model.status).not.toBeNull();
  });

  it('keeps retrying the socket with backoff after it was live', async () => {
    h = harness();
    h.model.start();
    h.sockets[0].open();
    h.sockets[0].send({ type: 'snapshot', ...payload() });
    h.sockets[0].fail(1001);
    expect(h.model.connection).toBe('polling');
    await waitFor(() => h.sockets.length === 2);
    h.sockets[1].fail();
    await waitFor(() => h.sockets.length === 3);
    h.sockets[2].fail();
    await waitFor(() => h.sockets.length === 4);
  });

  it('asks REST when an open socket sends no snapshot', async () => {
    h = harness();
    h.client.status = payload({ leases: [lease('rest')] });
    h.model.start();
    h.sockets[0].open();
    await waitFor(() => h.model.connection === 'live');
    expect(h.client.getStatus).toHaveBeenCalledTimes(1);
    expect(h.model.status?.leases.map(l => l.id)).toEqual(['rest']);
  });

  it('releases and keeps leases through the client', async () => {
    h = harness();
    h.model.start();
    h.sockets[0].open();
    h.sockets[0].send({
      type: 'snapshot',
      ...payload({ leases: [lease('a'), lease('b')] })
    });

    await h.model.keep('a');
    expect(h.client.keepLease).toHaveBeenCalledWith('a', 1800);
    expect(h.model.lease('a')?.keep_until).toBe(iso(T0 + 1800 * 1000));

    await h.model.release('b');
    expect(h.client.releaseLease).toHaveBeenCalledWith('b');
    expect(h.model.lease('b')).toBeNull();

    await h.model.drain('GPU-1');
    expect(h.client.drainDevice).toHaveBeenCalledWith('GPU-1');
    expect(h.model.status?.devices[1].health).toBe('drained');
    await h.model.undrain('GPU-1');
    expect(h.model.status?.devices[1].health).toBe('ok');
    // Live: no REST refresh needed after actions.
    expect(h.client.getStatus).not.toHaveBeenCalled();
  });

  it("keeps within the server's max_keep", async () => {
    h = harness();
    h.model.handleEvent({
      type: 'snapshot',
      status: payload({ leases: [lease('a')], config: { max_keep: 600 } })
    });
    expect(h.model.keepSeconds()).toBe(600);
    await h.model.keep('a');
    expect(h.client.keepLease).toHaveBeenCalledWith('a', 600);
  });

  it('takes the events as the server sends them', () => {
    h = harness();
    const notices: INotice[] = [];
    h.model.noticeReceived.connect((_, notice) => notices.push(notice));
    h.model.start();
    const socket = h.sockets[0];
    socket.open();
    socket.send({
      type: 'snapshot',
      ...payload({ user: 'alice', is_admin: true, time: T0 / 1000 }),
      backend_note: null,
      unleased_processes: [],
      queue: [
        {
          lease_id: 'w',
          kernel_id: null,
          user: 'another user',
          position: 1,
          count: 2
        }
      ]
    });
    expect(h.model.status?.queue[0]).toMatchObject({
      lease_id: 'w',
      position: 1,
      count: 2
    });
    socket.send({
      type: 'lease',
      lease: lease('a', {
        kernel_id: 'k',
        mine: true,
        count: 1,
        reason: 'granted'
      })
    });
    socket.send({
      type: 'notice',
      kind: 'reclaim_warning',
      lease_id: 'a',
      kernel_id: 'k',
      user: 'alice',
      message: 'idle 5m while 1 waits',
      reclaim_at: iso(T0 + 60000),
      state: 'reclaiming'
    });
    expect(h.model.leaseOfKernel('k')?.mine).toBe(true);
    expect(notices[0]).toMatchObject({
      kind: 'reclaim_warning',
      user: 'alice',
      state: 'reclaiming'
    });
  });

  it('lets action errors reach the caller', async () => {
    h = harness();
    h.client.keepLease.mockRejectedValueOnce(
      new GPUSchedError('keep is limited to 2 h (max_keep)', 400, 'Bad Request')
    );
    await expect(h.model.keep('a', 99999)).rejects.toThrow('max_keep');
  });

  it('follows the server clock and tracks local kernels', () => {
    h = harness();
    h.model.start();
    h.sockets[0].open();
    h.sockets[0].send({
      type: 'snapshot',
      ...payload({ time: (T0 + 90000) / 1000 })
    });
    expect(h.model.now()).toBe(T0 + 90000);
    // A server time a tick old is not clock skew.
    h.sockets[0].send({
      type: 'snapshot',
      ...payload({ time: (T0 - 2000) / 1000 })
    });
    expect(h.model.now()).toBe(T0);

    const before = h.changes();
    h.model.localKernels = new Map([['k', 'dir/Train.ipynb']]);
    h.model.localKernels = new Map([['k', 'dir/Train.ipynb']]);
    expect(h.changes()).toBe(before + 1);
    expect(h.model.pathOfKernel('k')).toBe('dir/Train.ipynb');
    expect(h.model.isOwn(lease('x', { kernel_id: 'k' }))).toBe(true);
  });

  it('bounds the refresh interval', () => {
    h = harness();
    h.model.refreshInterval = 0.1;
    expect(h.model.refreshInterval).toBe(1);
    h.model.refreshInterval = 30;
    expect(h.model.refreshInterval).toBe(30);
  });

  it('closes the socket when disposed and ignores it afterwards', () => {
    h = harness();
    h.model.start();
    const socket = h.sockets[0];
    h.model.dispose();
    expect(socket.closed).toBe(true);
    expect(h.model.isDisposed).toBe(true);
  });
});
