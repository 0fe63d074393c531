/**
 * Reclaim countdowns in notebook outputs: which outputs are countdowns, and the line that
 * replaces one once its reclaim is over. Pure functions; `notebooks.ts` applies them.
 *
 * The kernel agent shows a reclaim countdown in the notebook and updates it in place while it
 * lives. When the kernel is restarted or shut down to free its GPU, or when the notebook was
 * saved with a countdown and opened again, nobody updates that output any more: the lab
 * extension replaces it with what became of the reclaim, so that no countdown stays behind, on
 * screen or in the saved notebook.
 */
import type { ILease } from './types';
import { endReason, leaseEnd, parseTime } from './format';

/** What the kernel agent marks a countdown with (`kernel/notices.py` `countdown_html`). */
export interface ICountdownMark {
  /** The lease counted down. */
  leaseId: string;
  /** Its GPUs: `"GPU 1"`, `"GPUs 0, 2"`. */
  gpu: string;
  /** The announced step: `restart`, `shutdown`, `checkpoint`, ... (may be empty). */
  step: string;
  /** When it was due (ISO 8601), or `null`. */
  reclaimAt: string | null;
}

/** A line shown in place of a countdown. */
export interface IClosingLine {
  /** Plain text. */
  text: string;
  /** HTML, where the line stands out (the kernel lost its variables). */
  html: string | null;
}

/** The attribute that marks a countdown. */
export const COUNTDOWN_ATTRIBUTE = 'data-gpusched-countdown';

function unescapeHtml(value: string): string {
  return value
    .replace(/&quot;/g, '"')
    .replace(/&#x27;/g, "'")
    .replace(/&#39;/g, "'")
    .replace(/&lt;/g, '<')
    .replace(/&gt;/g, '>')
    .replace(/&amp;/g, '&');
}

function escapeHtml(value: string): string {
  return value
    .replace(/&/g, '&amp;')
    .replace(/</g, '&lt;')
    .replace(/>/g, '&gt;')
    .replace(/"/g, '&quot;')
    .replace(/'/g, '&#x27;');
}

function attribute(html: string, name: string): string | null {
  const match = new RegExp(`\\s${name}="([^"]*)"`).exec(html);
  return match ? unescapeHtml(match[1]) : null;
}

/**
 * The countdown mark of an output's data bundle (`{"text/html": ..., "text/plain": ...}`),
 * or `null` when the output is no countdown.
 */
export function countdownMark(data: unknown): ICountdownMark | null {
  if (typeof data !== 'object' || data === null) {
    return null;
  }
  const raw = (data as Record<string, unknown>)['text/html'];
  const html = Array.isArray(raw)
    ? raw.filter(part => typeof part === 'string').join('')
    : raw;
  if (typeof html !== 'string' || html.indexOf(COUNTDOWN_ATTRIBUTE) < 0) {
    return null;
  }
  const leaseId = attribute(html, COUNTDOWN_ATTRIBUTE);
  if (!leaseId) {
    return null;
  }
  return {
    leaseId,
    gpu: attribute(html, 'data-gpu') || 'The GPU',
    step: attribute(html, 'data-step') ?? '',
    reclaimAt: attribute(html, 'data-reclaim-at') || null
  };
}

/** `"14:03:07"`: a time of day for a line in a notebook (local time). */
export function timeOfDay(iso: string | null): string | null {
  const ms = parseTime(iso);
  if (ms === null) {
    return null;
  }
  const date = new Date(ms);
  const pad = (n: number): string => (n < 10 ? `0${n}` : `${n}`);
  return `${pad(date.getHours())}:${pad(date.getMinutes())}:${pad(date.getSeconds())}`;
}

function sentence(text: string): string {
  return /[.!?]$/.test(text) ? text : `${text}.`;
}

/**
 * The line that replaces a countdown, or `null` while the countdown still runs (or nothing is
 * known yet).
 *
 * @param mark - the countdown.
 * @param live - the lease of that id in the status, `null` if the status has none.
 * @param ended - the lease of that id as it ended (state `released`, the server's reason),
 *   `null` if this page did not see it end.
 */
export function closingLine(
  mark: ICountdownMark,
  live: ILease | null,
  ended: ILease | null
): IClosingLine | null {
  const gpu = mark.gpu;
  if (live && live.state === 'reclaiming') {
    return null;
  }
  if (ended) {
    const why = endReason(ended);
    const because = why ? ` (${why})` : '';
    switch (leaseEnd(ended)) {
      case 'restart': {
        const text = sentence(
          `${gpu} was taken back: the kernel was restarted to free it and its variables were lost${because}`
        );
        return { text, html: `<b>${escapeHtml(text)}</b>` };
      }
      case 'shutdown': {
        const text = sentence(
          `${gpu} was taken back: the kernel was shut down to free it and its variables were lost${because}`
        );
        return { text, html: `<b>${escapeHtml(text)}</b>` };
      }
      case 'self':
        return {
          text: `${gpu}: the reclaim is off (this kernel gave its GPU back).`,
          html: null
        };
      default:
        return {
          text: sentence(`${gpu} was taken back${because}`),
          html: null
        };
    }
  }
  if (live) {
    if (live.state === 'suspended') {
      return {
        text: `${gpu} was taken back while this kernel was idle. GPU state checkpointed; the next cell restores it.`,
        html: null
      };
    }
    if (live.state === 'pending') {
      return {
        text: `${gpu} was taken back; this kernel waits for a GPU again.`,
        html: null
      };
    }
    return {
      text: `${gpu}: the reclaim is off (${live.reason || 'the kernel is active again'}).`,
      html: null
    };
  }
  const due = timeOfDay(mark.reclaimAt);
  return {
    text: `${gpu}: the reclaim announced here${due ? ` for ${due}` : ''} is over; this lease is no longer held.`,
    html: null
  };
}
