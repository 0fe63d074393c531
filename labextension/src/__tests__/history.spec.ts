import { leaseMemory, processRows } from '../format';
import {
  chartLines,
  chartSpan,
  DeviceHistory,
  ISample,
  peakAndLast,
  sampleOf
} from '../history';
import { device, GiB, lease, status, T0 } from './fixtures';

const util = (sample: ISample): number | null => sample.utilization;
const mem = (sample: ISample): number | null => sample.memory;

describe('DeviceHistory', () => {
  it('keeps every change and the same reading once a second, over its window', () => {
    const history = new DeviceHistory(10_000);
    const at = (utilization: number, memoryGiB: number) =>
      status({
        devices: [device(0, { utilization, memory_used: memoryGiB * GiB })]
      });
    history.record(at(10, 8), T0);
    history.record(at(10, 8), T0 + 300); // the same within a second: not again
    history.record(at(85, 8), T0 + 400); // a change within a second: kept (a short peak)
    history.record(at(30, 40), T0 + 2000);
    expect(history.samples('GPU-0')).toEqual([
      { t: T0, utilization: 10, memory: 10 },
      { t: T0 + 400, utilization: 85, memory: 10 },
      { t: T0 + 2000, utilization: 30, memory: 50 }
    ]);
    history.record(at(30, 40), T0 + 3000); // the same a second later: kept
    expect(history.samples('GPU-0')).toHaveLength(4);
    history.record(at(40, 40), T0 + 11_000); // the first readings are now out of the window
    expect(history.samples('GPU-0').map(s => s.t)).toEqual([
      T0 + 2000,
      T0 + 3000,
      T0 + 11_000
    ]);
    // A GPU the status no longer lists is forgotten.
    history.record(status({ devices: [device(1)] }), T0 + 12_000);
    expect(history.samples('GPU-0')).toEqual([]);
    expect(history.samples('GPU-1')).toHaveLength(1);
  });

  it('reads unknown values as unknown, never as 0', () => {
    expect(
      sampleOf(device(0, { utilization: null, memory_used: null }), T0)
    ).toEqual({ t: T0, utilization: null, memory: null });
    expect(sampleOf(device(0, { utilization: 130 }), T0).utilization).toBe(100);
  });
});

describe('chartLines', () => {
  const samples: ISample[] = [
    { t: T0, utilization: 0, memory: 50 },
    { t: T0 + 5000, utilization: 100, memory: 50 }
  ];

  it('draws each value as a step until the next reading, the last until now', () => {
    // 10 s window, 100 x 10 box: T0 is the left edge, now the right one.
    expect(chartLines(samples, util, T0 + 10_000, 10_000, 100, 10)).toEqual([
      '0,10 50,10 50,0 100,0'
    ]);
    expect(chartLines(samples, mem, T0 + 10_000, 10_000, 100, 10)).toEqual([
      '0,5 50,5 50,5 100,5'
    ]);
  });

  it('breaks the line at an unknown reading and clips to the window', () => {
    const gappy: ISample[] = [
      { t: T0 - 20_000, utilization: 50, memory: null },
      { t: T0, utilization: null, memory: null },
      { t: T0 + 5000, utilization: 20, memory: null }
    ];
    expect(chartLines(gappy, util, T0 + 10_000, 10_000, 100, 10)).toEqual([
      '0,5 0,5',
      '50,8 100,8'
    ]);
    expect(chartLines(gappy, mem, T0 + 10_000, 10_000, 100, 10)).toEqual([]);
  });

  it('says the peak and the latest value', () => {
    expect(peakAndLast(samples, util)).toEqual({ peak: 100, last: 100 });
    expect(peakAndLast([], util)).toEqual({ peak: null, last: null });
  });
});

describe('processRows', () => {
  it("lists a GPU's processes by memory, each with its lease or none", () => {
    const held = lease('L1', {
      kernel_id: 'k1',
      devices: ['GPU-0'],
      notebook: 'work/b.ipynb',
      holder: 'alice'
    });
    const gpu = device(0, {
      lease_ids: ['L1'],
      processes: [
        {
          pid: 11,
          memory_used: 1 * GiB,
          kernel_id: null,
          lease_id: null,
          user: null
        },
        {
          pid: 12,
          memory_used: 8 * GiB,
          kernel_id: 'k1',
          lease_id: 'L1',
          user: 'alice'
        },
        {
          pid: 13,
          memory_used: null,
          kernel_id: 'k2abcdef99',
          lease_id: null,
          user: 'bob'
        }
      ]
    });
    expect(processRows(status({ leases: [held] }), gpu)).toEqual([
      { pid: 12, memory: '8.0 GiB', lease: held, label: 'b.ipynb · alice' },
      { pid: 11, memory: '1.0 GiB', lease: null, label: 'no lease' },
      {
        pid: 13,
        memory: 'n/a',
        lease: null,
        label: 'no lease · kernel k2abcdef · user bob'
      }
    ]);
  });

  it("finds the lease of a process's kernel on a server that sends no lease_id", () => {
    const held = lease('L1', { kernel_id: 'k1', devices: ['GPU-0'] });
    const gpu = device(0, {
      processes: [{ pid: 5, memory_used: 0, kernel_id: 'k1' }]
    });
    const rows = processRows(status({ leases: [held] }), gpu, () => 'x.ipynb');
    expect(rows[0].lease?.id).toBe('L1');
    expect(rows[0].label).toBe('x.ipynb · alice');
    // Not this GPU's lease: none.
    const elsewhere = lease('L2', { kernel_id: 'k1', devices: ['GPU-1'] });
    expect(processRows(status({ leases: [elsewhere] }), gpu)[0].label).toBe(
      'no lease · kernel k1'
    );
  });
});

describe('chartSpan', () => {
  it('spans the history there is, at least a minute, at most the window', () => {
    const at = (t: number): ISample => ({ t, utilization: 0, memory: 0 });
    expect(chartSpan([], T0)).toBe(60_000);
    expect(chartSpan([at(T0 - 10_000)], T0)).toBe(60_000);
    expect(chartSpan([at(T0 - 150_000)], T0)).toBe(150_000);
    expect(chartSpan([at(T0 - 900_000)], T0)).toBe(300_000);
  });
});

describe('leaseMemory with processes outside the lease', () => {
  it("counts only the kernel's own processes where the GPU lists its processes", () => {
    const held = lease('L1', { kernel_id: 'k1', devices: ['GPU-0'] });
    const gpu = device(0, {
      memory_used: 3 * GiB,
      lease_ids: ['L1'],
      processes: [
        { pid: 9, memory_used: 3 * GiB, kernel_id: null, lease_id: null }
      ]
    });
    expect(
      leaseMemory(status({ devices: [gpu], leases: [held] }), held)
    ).toEqual({
      used: 0,
      total: 80 * GiB
    });
    // A driver that lists no process: the exclusive lease's GPU usage is the best guess.
    const quiet = device(0, { memory_used: 3 * GiB, lease_ids: ['L1'] });
    expect(
      leaseMemory(status({ devices: [quiet], leases: [held] }), held).used
    ).toBe(3 * GiB);
  });
});
