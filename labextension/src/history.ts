/**
 * A short history of each GPU's utilization and memory, sampled from the status the model
 * already keeps current, and the pure functions that draw it as a small chart.
 */
import type { IDevice, IStatus } from './types';
import { percentOf } from './format';

/** One reading of a GPU. */
export interface ISample {
  /** Milliseconds since the epoch. */
  t: number;
  /** Percent, `null` where the driver does not say. */
  utilization: number | null;
  /** Percent of the GPU's memory in use, `null` where unknown. */
  memory: number | null;
}

/** How far back the charts go: 5 minutes. */
export const HISTORY_WINDOW_MS = 5 * 60 * 1000;

/** The same reading is kept at most once per this many milliseconds. */
export const SAMPLE_SPACING_MS = 1000;

/** The most readings kept per GPU, whatever the window. */
export const MAX_SAMPLES = 2000;

/** The readings of every GPU over the last `windowMs`, by UUID. */
export class DeviceHistory {
  constructor(readonly windowMs: number = HISTORY_WINDOW_MS) {}

  /** Record what `status` says of every GPU at `nowMs`. */
  record(status: IStatus | null, nowMs: number): void {
    if (!status) {
      return;
    }
    const seen = new Set<string>();
    for (const device of status.devices) {
      seen.add(device.uuid);
      const samples = this._samples.get(device.uuid) ?? [];
      const sample = sampleOf(device, nowMs);
      const last = samples[samples.length - 1];
      const same =
        last !== undefined &&
        last.utilization === sample.utilization &&
        last.memory === sample.memory;
      // A change is always kept (a short peak is a peak); the same reading once a second.
      if (!(same && nowMs - last.t < SAMPLE_SPACING_MS)) {
        samples.push(sample);
      }
      while (
        samples.length > MAX_SAMPLES ||
        (samples.length > 0 && samples[0].t < nowMs - this.windowMs)
      ) {
        samples.shift();
      }
      this._samples.set(device.uuid, samples);
    }
    for (const uuid of Array.from(this._samples.keys())) {
      if (!seen.has(uuid)) {
        this._samples.delete(uuid);
      }
    }
  }

  /** The readings of one GPU, oldest first. */
  samples(uuid: string): ReadonlyArray<ISample> {
    return this._samples.get(uuid) ?? [];
  }

  private _samples = new Map<string, ISample[]>();
}

/** A GPU's reading now. */
export function sampleOf(device: IDevice, nowMs: number): ISample {
  const utilization =
    typeof device.utilization === 'number' &&
    Number.isFinite(device.utilization)
      ? Math.min(100, Math.max(0, device.utilization))
      : null;
  return {
    t: nowMs,
    utilization,
    memory: percentOf(device.memory_used, device.memory_total)
  };
}

/**
 * The lines of a chart of `pick` (0-100) over the `windowMs` before `nowMs`, in a `width` x
 * `height` box (time to the right, 100 % at the top): SVG `points` strings, one per stretch of
 * known readings (an unknown reading breaks the line). A value holds until the next reading,
 * and the last one until now.
 */
export function chartLines(
  samples: ReadonlyArray<ISample>,
  pick: (sample: ISample) => number | null,
  nowMs: number,
  windowMs: number,
  width: number,
  height: number
): string[] {
  const start = nowMs - windowMs;
  const x = (t: number): number =>
    round(((Math.max(start, Math.min(nowMs, t)) - start) / windowMs) * width);
  const y = (value: number): number =>
    round(height - (Math.max(0, Math.min(100, value)) / 100) * height);
  const lines: string[] = [];
  let points: string[] = [];
  const flush = (): void => {
    if (points.length > 0) {
      lines.push(points.join(' '));
    }
    points = [];
  };
  for (let i = 0; i < samples.length; i++) {
    const value = pick(samples[i]);
    if (value === null) {
      flush();
      continue;
    }
    const from = samples[i].t;
    const until = i + 1 < samples.length ? samples[i + 1].t : nowMs;
    if (until < start) {
      continue;
    }
    // A step: the value from this reading until the next.
    points.push(`${x(from)},${y(value)}`, `${x(until)},${y(value)}`);
  }
  flush();
  return lines;
}

/** The highest and the latest of a series (for the chart's label), `null` when unknown. */
export function peakAndLast(
  samples: ReadonlyArray<ISample>,
  pick: (sample: ISample) => number | null
): { peak: number | null; last: number | null } {
  let peak: number | null = null;
  let last: number | null = null;
  for (const sample of samples) {
    const value = pick(sample);
    if (value !== null) {
      peak = peak === null ? value : Math.max(peak, value);
    }
    last = value;
  }
  return { peak, last };
}

function round(value: number): number {
  return Math.round(value * 10) / 10;
}

/** Shortest span a chart shows (a page just opened has little history). */
export const MIN_CHART_SPAN_MS = 60 * 1000;

/**
 * The span a chart shows: the history it has, at least `MIN_CHART_SPAN_MS`, at most the
 * window, so that a page just opened does not draw its first minute as a sliver.
 */
export function chartSpan(
  samples: ReadonlyArray<ISample>,
  nowMs: number,
  windowMs: number = HISTORY_WINDOW_MS
): number {
  const first = samples.length > 0 ? samples[0].t : nowMs;
  return Math.min(windowMs, Math.max(MIN_CHART_SPAN_MS, nowMs - first));
}
