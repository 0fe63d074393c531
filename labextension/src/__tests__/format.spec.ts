import {
  baseName,
  formatBytes,
  formatCountdown,
  formatDeviceIndices,
  formatDuration,
  formatMemory,
  formatPercent,
  holdersOfDevice,
  idleSeconds,
  keepLabel,
  leaseLabel,
  leaseMemory,
  leaseOfKernel,
  percentOf,
  queuePosition,
  reclaimCountdown,
  secondsUntil,
  shortDeviceName,
  summarizeKernel,
  bindsLazily,
  idleOutlook,
  checkpointMemoryFull,
  checkpointMemoryLine,
  formatAmount,
  formatGpuHours,
  formatHalfLife,
  overShareLabel,
  queueReason,
  usageHeading,
  usageRows,
  usageTracked
} from '../format';
import type { ILease } from '../api';
import { device, GiB, iso, lease, status, T0 } from './fixtures';

describe('formatBytes', () => {
  it.each([
    [0, '0 B'],
    [512, '512 B'],
    [1536, '1.5 KiB'],
    [80 * GiB, '80.0 GiB'],
    [12.34 * GiB, '12.3 GiB'],
    [2 * 1024 * GiB, '2.0 TiB']
  ])('%p -> %p', (bytes, text) => {
    expect(formatBytes(bytes)).toBe(text);
  });

  it('says n/a for unknown sizes', () => {
    expect(formatBytes(null)).toBe('n/a');
    expect(formatBytes(undefined)).toBe('n/a');
    expect(formatBytes(NaN)).toBe('n/a');
  });
});

describe('formatMemory', () => {
  it('shows used and total in the unit of the total', () => {
    expect(formatMemory(12 * GiB, 80 * GiB)).toBe('12.0 / 80.0 GiB');
    expect(formatMemory(512 * 1024 ** 2, 80 * GiB)).toBe('0.5 / 80.0 GiB');
  });

  it('marks unknown parts', () => {
    expect(formatMemory(null, 80 * GiB)).toBe('? / 80.0 GiB');
    expect(formatMemory(GiB, null)).toBe('1.0 GiB / n/a');
  });
});

describe('formatPercent and percentOf', () => {
  it('rounds and clamps', () => {
    expect(formatPercent(42.4)).toBe('42%');
    expect(formatPercent(42.46, 1)).toBe('42.5%');
    expect(formatPercent(140)).toBe('100%');
    expect(formatPercent(-3)).toBe('0%');
    expect(formatPercent(null)).toBe('n/a');
  });

  it('computes shares, unknown when the total is not positive', () => {
    expect(percentOf(20 * GiB, 80 * GiB)).toBe(25);
    expect(percentOf(null, 80 * GiB)).toBeNull();
    expect(percentOf(1, 0)).toBeNull();
  });
});

describe('formatDuration', () => {
  it.each([
    [0, '0s'],
    [45.9, '45s'],
    [252, '4m 12s'],
    [3900, '1h 05m'],
    [183600, '2d 3h'],
    [-10, '0s']
  ])('%p s -> %p', (seconds, text) => {
    expect(formatDuration(seconds)).toBe(text);
  });

  it('says n/a for unknown durations', () => {
    expect(formatDuration(null)).toBe('n/a');
  });
});

describe('formatCountdown', () => {
  it.each([
    [59.2, '1:00'],
    [42, '0:42'],
    [0.1, '0:01'],
    [0, '0:00'],
    [-5, '0:00'],
    [3723, '1:02:03']
  ])('%p s -> %p', (seconds, text) => {
    expect(formatCountdown(seconds)).toBe(text);
  });
});

describe('small helpers', () => {
  it('names things', () => {
    expect(baseName('work/deep/Train.ipynb')).toBe('Train.ipynb');
    expect(baseName('Untitled.ipynb')).toBe('Untitled.ipynb');
    expect(shortDeviceName('NVIDIA A100-SXM4-80GB')).toBe('A100-SXM4-80GB');
    expect(formatDeviceIndices([0])).toBe('GPU 0');
    expect(formatDeviceIndices([0, 1])).toBe('GPUs 0, 1');
    expect(keepLabel(1800)).toBe('30 min');
    expect(keepLabel(7200)).toBe('2 h');
  });

  it('labels a lease by notebook, session path or kernel id', () => {
    expect(leaseLabel(lease('a', { notebook: 'x/Train.ipynb' }))).toBe(
      'Train.ipynb'
    );
    expect(leaseLabel(lease('a'), 'y/Eval.ipynb')).toBe('Eval.ipynb');
    expect(leaseLabel(lease('a', { kernel_id: '0123456789abcdef' }))).toBe(
      'kernel 01234567'
    );
  });

  it('computes times relative to a given now', () => {
    expect(secondsUntil(iso(T0 + 30000), T0)).toBe(30);
    expect(secondsUntil(null, T0)).toBeNull();
    expect(secondsUntil('not a time', T0)).toBeNull();
  });
});

describe('leaseOfKernel', () => {
  it('finds nothing without status, kernel or lease', () => {
    expect(leaseOfKernel(null, 'k')).toBeNull();
    expect(leaseOfKernel(status(), null)).toBeNull();
    expect(leaseOfKernel(status({ leases: [lease('a')] }), 'other')).toBeNull();
  });

  it('prefers a holding lease over a pending or suspended one, ignores released', () => {
    const leases = [
      lease('old', { kernel_id: 'k', state: 'released' }),
      lease('wait', { kernel_id: 'k', state: 'pending', granted_at: null }),
      lease('held', { kernel_id: 'k', state: 'idle' }),
      lease('susp', { kernel_id: 'k', state: 'suspended' })
    ];
    expect(leaseOfKernel(status({ leases }), 'k')?.id).toBe('held');
    expect(leaseOfKernel(status({ leases: leases.slice(0, 2) }), 'k')?.id).toBe(
      'wait'
    );
    expect(leaseOfKernel(status({ leases: [leases[0]] }), 'k')).toBeNull();
  });

  it('takes the most recently granted among equals', () => {
    const leases = [
      lease('first', { kernel_id: 'k', granted_at: '2024-05-01T10:00:00Z' }),
      lease('second', { kernel_id: 'k', granted_at: '2024-05-01T11:00:00Z' })
    ];
    expect(leaseOfKernel(status({ leases }), 'k')?.id).toBe('second');
  });
});

describe('device and queue lookups', () => {
  it('finds the holders of a device by lease devices or device lease ids', () => {
    const s = status({
      devices: [device(0, { lease_ids: ['b'] }), device(1)],
      leases: [
        lease('a', { devices: ['GPU-0'] }),
        lease('b', { devices: [] }),
        lease('c', { devices: ['GPU-0'], state: 'suspended' })
      ]
    });
    expect(holdersOfDevice(s, s.devices[0]).map(l => l.id)).toEqual(['a', 'b']);
    expect(holdersOfDevice(s, s.devices[1])).toEqual([]);
  });

  it('reads a queue position from the queue, else the lease', () => {
    const waiting = lease('w', { state: 'pending', position: 7 });
    expect(
      queuePosition(
        status({ queue: [{ lease_id: 'w', position: 2 }] }),
        waiting
      )
    ).toBe(2);
    expect(queuePosition(status(), waiting)).toBe(7);
    expect(queuePosition(status(), lease('x'))).toBeNull();
  });
});

describe('leaseMemory', () => {
  it('sums the kernel processes on its devices', () => {
    const s = status({
      devices: [
        device(0, {
          memory_used: 30 * GiB,
          processes: [
            { pid: 1, memory_used: 10 * GiB, kernel_id: 'k' },
            { pid: 2, memory_used: 20 * GiB, kernel_id: 'other' }
          ]
        })
      ]
    });
    const l = lease('a', {
      kernel_id: 'k',
      devices: ['GPU-0'],
      mode: 'shared',
      memory: 16 * GiB
    });
    expect(leaseMemory(s, l)).toEqual({ used: 10 * GiB, total: 16 * GiB });
  });

  it('uses device usage for an exclusive lease without process data', () => {
    const s = status({
      devices: [device(0, { memory_used: 5 * GiB }), device(1)]
    });
    const l = lease('a', { devices: ['GPU-0', 'GPU-1'] });
    expect(leaseMemory(s, l)).toEqual({ used: 5 * GiB, total: 160 * GiB });
  });

  it('is unknown for a shared lease without process data', () => {
    const s = status({ devices: [device(0, { memory_used: 5 * GiB })] });
    const l = lease('a', {
      devices: ['GPU-0'],
      mode: 'shared',
      memory: 8 * GiB
    });
    expect(leaseMemory(s, l)).toEqual({ used: null, total: 8 * GiB });
  });
});

describe('countdowns', () => {
  it('counts down to a scheduled reclaim of a held lease only', () => {
    const l = lease('a', { state: 'reclaiming', reclaim_at: iso(T0 + 42000) });
    expect(reclaimCountdown(l, T0)).toBe(42);
    expect(reclaimCountdown({ ...l, state: 'suspended' }, T0)).toBeNull();
    expect(reclaimCountdown({ ...l, reclaim_at: null }, T0)).toBeNull();
  });

  it('measures idle time from last activity, else idle_seconds', () => {
    const l = lease('a', {
      state: 'idle',
      last_active_at: iso(T0 - 90000),
      idle_seconds: 5
    });
    expect(idleSeconds(l, T0)).toBe(90);
    expect(idleSeconds({ ...l, last_active_at: null }, T0)).toBe(5);
    expect(idleSeconds({ ...l, state: 'active' }, T0)).toBeNull();
  });
});

describe('summarizeKernel', () => {
  const devices = [
    device(0, { memory_used: 12 * GiB }),
    device(1, { health: 'drained' }),
    device(2)
  ];

  it('says loading, unavailable or none', () => {
    expect(summarizeKernel(null, null, T0).text).toBe('GPU: …');
    expect(summarizeKernel(null, null, T0, 'boom')).toMatchObject({
      text: 'GPU: unavailable',
      state: 'unavailable'
    });
    const none = summarizeKernel(status({ devices }), null, T0);
    expect(none.text).toBe('GPU: none');
    expect(none.description).toContain('2 of 3 free');
  });

  it('shows the queue position', () => {
    const l = lease('w', { state: 'pending' });
    const s = status({
      devices,
      leases: [l],
      queue: [{ lease_id: 'w', position: 2 }]
    });
    expect(summarizeKernel(s, l, T0)).toMatchObject({
      text: 'GPU: queued #2',
      state: 'pending'
    });
    expect(summarizeKernel(status({ leases: [l] }), l, T0).text).toBe(
      'GPU: queued'
    );
  });

  it('shows device, memory and idle time', () => {
    const l = lease('a', {
      devices: ['GPU-0'],
      device_indices: [0],
      state: 'idle',
      last_active_at: iso(T0 - 252000)
    });
    const s = status({ devices, leases: [l] });
    expect(summarizeKernel(s, l, T0).text).toBe(
      'GPU 0: A100-SXM4-80GB · 12.0 / 80.0 GiB · idle 4m 12s'
    );
    const active = { ...l, state: 'active' as const };
    expect(summarizeKernel(s, active, T0).text).toBe(
      'GPU 0: A100-SXM4-80GB · 12.0 / 80.0 GiB'
    );
  });

  it('counts down to a reclaim', () => {
    const l = lease('a', {
      devices: ['GPU-0'],
      device_indices: [0],
      state: 'reclaiming',
      reclaim_at: iso(T0 + 42000)
    });
    const summary = summarizeKernel(status({ devices, leases: [l] }), l, T0);
    expect(summary.text).toBe('GPU 0: A100-SXM4-80GB · reclaim in 0:42');
    expect(summary.state).toBe('reclaiming');
  });

  it('shows a suspended lease', () => {
    const l = lease('a', { state: 'suspended' });
    expect(summarizeKernel(status({ leases: [l] }), l, T0).text).toBe(
      'GPU: suspended'
    );
  });
});

describe('a lazily bound kernel', () => {
  const lazy = {
    kernel_provisioner: {
      provisioner_name: 'gpusched-provisioner',
      config: { gpus: 1, bind: 'lazy' }
    }
  };

  it('is told from its kernelspec metadata', () => {
    expect(bindsLazily(lazy)).toBe(true);
    // Lazy is the provisioner's default.
    expect(
      bindsLazily({
        kernel_provisioner: { provisioner_name: 'gpusched-provisioner' }
      })
    ).toBe(true);
    expect(
      bindsLazily({
        kernel_provisioner: {
          provisioner_name: 'gpusched-provisioner',
          config: { bind: 'launch' }
        }
      })
    ).toBe(false);
    expect(
      bindsLazily({
        kernel_provisioner: { provisioner_name: 'local-provisioner' }
      })
    ).toBe(false);
    expect(bindsLazily(undefined)).toBe(false);
  });

  it('says its GPU comes at the first cell, not that it has none', () => {
    const summary = summarizeKernel(status(), null, T0, null, { lazy: true });
    expect(summary).toMatchObject({
      text: 'GPU: at first cell',
      state: 'lazy'
    });
    expect(summary.description).toContain('first cell runs');
    expect(summary.description).toContain('2 of 2 free');
    // Once it holds a lease, the lease is what it shows.
    const held = lease('L1', { devices: ['GPU-0'], device_indices: [0] });
    expect(
      summarizeKernel(status({ leases: [held] }), held, T0, null, {
        lazy: true
      }).text
    ).toMatch(/^GPU 0: /);
  });
});

describe('idleOutlook', () => {
  const idle = (
    forecast: Partial<NonNullable<ILease['idle_forecast']>> | null,
    extra = {}
  ) =>
    lease('L1', {
      devices: ['GPU-0'],
      device_indices: [0],
      state: 'idle',
      last_active_at: iso(T0 - 60_000),
      idle_forecast:
        forecast === null
          ? null
          : {
              step: 'checkpoint',
              at: iso(T0 + 3540_000),
              contended_at: iso(T0 + 60_000),
              contended_by: 'anyone',
              reason: 'idle for an hour',
              ...forecast
            },
      ...extra
    });

  it('names the step and when, and what happens sooner if someone waits', () => {
    const outlook = idleOutlook(idle({}), T0);
    expect(outlook).toMatchObject({
      short: 'suspend in 59m 00s',
      brief: 'If idle: suspend in 59m 00s, in 1m 00s if someone waits',
      seconds: 3540
    });
    expect(outlook?.sentence).toBe(
      'If this kernel stays idle, its GPU state is suspended to host memory (variables kept) in 59m 00s, or in 1m 00s if someone waits for a GPU.'
    );
    // With someone in the queue, the sooner time is the one that applies.
    expect(idleOutlook(idle({}), T0, true)).toMatchObject({
      short: 'suspend in 1m 00s',
      brief: 'If idle: suspend in 1m 00s (someone waits)'
    });
  });

  it('speaks of the other kernels of the same user where only they can take it', () => {
    const outlook = idleOutlook(idle({ contended_by: 'same_user' }), T0);
    expect(outlook?.brief).toBe(
      'If idle: suspend in 59m 00s, in 1m 00s if another kernel of yours waits'
    );
  });

  it('says when idle takes nothing back', () => {
    const outlook = idleOutlook(
      idle({ step: null, at: null, contended_at: null }),
      T0
    );
    expect(outlook).toMatchObject({
      short: null,
      brief: 'If idle: kept until released'
    });
  });

  it('has nothing to say without a forecast, or once a reclaim is announced', () => {
    expect(idleOutlook(idle(null), T0)).toBeNull();
    expect(
      idleOutlook(idle({}, { reclaim_at: iso(T0 + 30_000) }), T0)
    ).toBeNull();
  });

  it('shows in the status bar text of an idle lease and in its tooltip', () => {
    const held = idle({ step: 'restart' });
    const summary = summarizeKernel(status({ leases: [held] }), held, T0);
    expect(summary.text).toMatch(/ · idle 1m 00s · restart in 59m 00s$/);
    expect(summary.description).toContain(
      'If this kernel stays idle, the kernel is restarted (variables lost) in 59m 00s'
    );
  });
});

describe('recent usage', () => {
  it('words the half-life as the server does', () => {
    expect(formatHalfLife(86400)).toBe('1 day');
    expect(formatHalfLife(3 * 86400)).toBe('3 days');
    expect(formatHalfLife(43200)).toBe('12h 00m');
    expect(formatHalfLife(1.5 * 86400)).toBe('1d 12h');
    expect(formatHalfLife(undefined)).toBe('n/a');
  });

  it('shows amounts without trailing zeros and tiny usage as <0.1', () => {
    expect(formatAmount(1)).toBe('1');
    expect(formatAmount(0.5, 2)).toBe('0.5');
    expect(formatAmount(1 / 3, 2)).toBe('0.33');
    expect(formatAmount(0)).toBe('0');
    expect(formatGpuHours(0.73)).toBe('0.7');
    expect(formatGpuHours(41.25)).toBe('41.3');
    expect(formatGpuHours(0.01)).toBe('<0.1');
    expect(formatGpuHours(0)).toBe('0');
  });

  it('lists users in the server order, marks the viewer and who holds over quota', () => {
    const s = status({
      user: 'alice',
      config: { usage_half_life: 86400 },
      usage: [
        { user: 'bob', gpu_hours: 2.345, quota: 1, held: 2 },
        { user: 'alice', gpu_hours: 0.7, quota: 1, held: 0 },
        { user: 'another user', gpu_hours: 0, quota: 0.5, held: 0.5 }
      ]
    });
    expect(usageTracked(s)).toBe(true);
    expect(usageHeading(s)).toBe('Recent usage (half-life 1 day)');
    const rows = usageRows(s);
    expect(rows.map(r => [r.user, r.gpuHours, r.quota, r.held, r.own])).toEqual(
      [
        ['bob', '2.3', '1', '2', false],
        ['alice', '0.7', '1', '0', true],
        ['another user', '0', '0.5', '0.5', false]
      ]
    );
    expect(rows.map(r => r.overQuota)).toEqual([true, false, false]);
    expect(rows[0].title).toBe(
      'bob: 2.3 GPU-hours recently; 1 GPU guaranteed; 2 GPUs held now'
    );
    expect(rows[1].title).toBe(
      'You: 0.7 GPU-hours recently; 1 GPU guaranteed; no GPU held now'
    );
  });

  it('is not shown where the server does not track usage', () => {
    expect(usageTracked(status())).toBe(false);
    expect(
      usageTracked(status({ usage: [], config: { usage_half_life: 0 } }))
    ).toBe(false);
    const untimed = status({ usage: [] });
    expect(usageTracked(untimed)).toBe(true);
    expect(usageHeading(untimed)).toBe('Recent usage');
    expect(usageRows(untimed)).toEqual([]);
  });
});

describe('queueReason', () => {
  const reason =
    'waiting for a GPU; 2nd in line: within quota; bob used 0.7 GPU-hours recently (half-life 1 day)';

  it("takes the pending lease's reason, kept current by lease events", () => {
    const entry = { lease_id: 'b', position: 2, reason: 'older words' };
    expect(queueReason(entry, lease('b', { state: 'pending', reason }))).toBe(
      reason
    );
  });

  it("falls back to the entry's reason, and is empty where the server says nothing", () => {
    expect(
      queueReason(
        { lease_id: 'b', position: 2, reason },
        lease('b', { state: 'pending' })
      )
    ).toBe(reason);
    expect(queueReason({ lease_id: 'b', position: 2, reason }, null)).toBe(
      reason
    );
    expect(queueReason({ lease_id: 'b', position: 2, reason: '' }, null)).toBe(
      ''
    );
    expect(queueReason({ lease_id: 'b', position: 2 }, undefined)).toBe('');
  });
});

describe('checkpointMemoryLine', () => {
  it('says what checkpoints hold of the budget', () => {
    const checkpoint = {
      available: true,
      reason: '',
      host_memory_budget: 64 * GiB,
      host_memory_held: 12 * GiB
    };
    expect(checkpointMemoryLine(checkpoint)).toBe(
      'Checkpoints hold 12.0 GiB of 64.0 GiB host memory'
    );
    expect(checkpointMemoryFull(checkpoint)).toBe(false);
    expect(
      checkpointMemoryFull({ ...checkpoint, host_memory_held: 64 * GiB })
    ).toBe(true);
  });

  it('says when there is no limit, and nothing without checkpoints', () => {
    expect(
      checkpointMemoryLine({
        available: true,
        reason: '',
        host_memory_budget: null,
        host_memory_held: 0
      })
    ).toBe('Checkpoints hold 0 B host memory (no limit)');
    expect(
      checkpointMemoryLine({
        available: false,
        reason: 'no cuda-checkpoint',
        host_memory_budget: 64 * GiB,
        host_memory_held: 0
      })
    ).toBeNull();
    expect(checkpointMemoryLine({ available: true, reason: '' })).toBeNull();
    expect(checkpointMemoryLine(undefined)).toBeNull();
  });
});

describe('overShareLabel', () => {
  it('says how long a shared lease has been over its memory share', () => {
    const over = lease('s', {
      mode: 'shared',
      over_share_since: iso(T0 - 125 * 1000)
    });
    expect(overShareLabel(over, T0)).toBe('over its memory share for 2m 05s');
    expect(
      overShareLabel(lease('s', { over_share_since: null }), T0)
    ).toBeNull();
    expect(overShareLabel(lease('s'), T0)).toBeNull();
  });
});
