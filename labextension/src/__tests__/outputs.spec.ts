import { endReason, leaseEnd, summarizeKernel } from '../format';
import { closingLine, countdownMark, ICountdownMark } from '../outputs';
import { device, lease, status, T0 } from './fixtures';

// The countdown the kernel agent shows (kernel/notices.py countdown_html).
const COUNTDOWN_HTML =
  '<b data-gpusched-countdown="L1" data-gpu="GPU 1" data-step="restart" ' +
  'data-reclaim-at="2024-05-01T10:01:00Z">GPU 1 will be taken back in 55 s because bob&#x27;s ' +
  'claim waits; run <code>%gpu keep 30m</code> to keep it. Then the kernel restarts.</b>';

const RESTARTED =
  'reclaimed: the kernel was restarted to free its GPU: idle while bob waits for a GPU';

describe('countdownMark', () => {
  it('reads the lease, GPUs, step and deadline of a countdown', () => {
    expect(
      countdownMark({ 'text/html': COUNTDOWN_HTML, 'text/plain': 'GPU 1 ...' })
    ).toEqual({
      leaseId: 'L1',
      gpu: 'GPU 1',
      step: 'restart',
      reclaimAt: '2024-05-01T10:01:00Z'
    });
    // nbformat may store HTML as a list of lines.
    expect(
      countdownMark({
        'text/html': [COUNTDOWN_HTML.slice(0, 40), COUNTDOWN_HTML.slice(40)]
      })?.leaseId
    ).toBe('L1');
  });

  it('finds no countdown in other outputs', () => {
    expect(
      countdownMark({ 'text/plain': 'GPU 1 will be taken back in 5 s' })
    ).toBeNull();
    expect(
      countdownMark({ 'text/html': '<b>GPU 0: the reclaim is off.</b>' })
    ).toBeNull();
    expect(countdownMark(null)).toBeNull();
    expect(countdownMark('text')).toBeNull();
  });
});

describe('closingLine', () => {
  const mark: ICountdownMark = {
    leaseId: 'L1',
    gpu: 'GPU 1',
    step: 'restart',
    reclaimAt: '2024-05-01T10:01:00Z'
  };

  it('leaves a countdown that still runs', () => {
    expect(
      closingLine(mark, lease('L1', { state: 'reclaiming' }), null)
    ).toBeNull();
  });

  it('says in one bold line that the kernel was restarted and why', () => {
    const ended = lease('L1', { state: 'released', reason: RESTARTED });
    const line = closingLine(mark, null, ended);
    expect(line?.text).toBe(
      'GPU 1 was taken back: the kernel was restarted to free it and its variables were lost ' +
        '(idle while bob waits for a GPU).'
    );
    expect(line?.html).toBe(`<b>${line?.text}</b>`);
    expect(line?.text).not.toMatch(/will be taken back in/);
  });

  it('says a shutdown, a release by the kernel and another end', () => {
    const shut = closingLine(
      mark,
      null,
      lease('L1', {
        state: 'released',
        reason: 'reclaimed: the kernel was shut down to free its GPU: idle'
      })
    );
    expect(shut?.text).toMatch(
      /^GPU 1 was taken back: the kernel was shut down/
    );
    const own = closingLine(
      mark,
      null,
      lease('L1', { state: 'released', reason: 'released by kernel k1' })
    );
    expect(own).toEqual({
      text: 'GPU 1: the reclaim is off (this kernel gave its GPU back).',
      html: null
    });
    const other = closingLine(
      mark,
      null,
      lease('L1', { state: 'released', reason: 'released while idle' })
    );
    expect(other?.text).toBe('GPU 1 was taken back (released while idle).');
  });

  it('says the reclaim is off for a lease that holds its GPU again', () => {
    const kept = lease('L1', { state: 'idle', reason: 'kept for 30 min' });
    expect(closingLine(mark, kept, null)?.text).toBe(
      'GPU 1: the reclaim is off (kept for 30 min).'
    );
    expect(
      closingLine(mark, lease('L1', { state: 'suspended' }), null)?.text
    ).toMatch(/checkpointed; the next cell restores it/);
  });

  it('closes a countdown of a lease nobody lists any more (a saved notebook)', () => {
    const line = closingLine(mark, null, null);
    expect(line?.text).toMatch(
      /^GPU 1: the reclaim announced here for \d\d:\d\d:\d\d is over; this lease is no longer held\.$/
    );
    expect(closingLine({ ...mark, reclaimAt: null }, null, null)?.text).toBe(
      'GPU 1: the reclaim announced here is over; this lease is no longer held.'
    );
  });
});

describe('leaseEnd', () => {
  it('tells how a lease ended from the server reason', () => {
    expect(leaseEnd({ reason: 'released by kernel 0f3c' })).toBe('self');
    expect(leaseEnd({ reason: 'released by alice' })).toBe('taken');
    expect(leaseEnd({ reason: RESTARTED })).toBe('restart');
    expect(
      leaseEnd({
        reason: 'reclaimed: the kernel was shut down to free its GPU: x'
      })
    ).toBe('shutdown');
    expect(leaseEnd({ reason: 'released while idle: no memory' })).toBe(
      'taken'
    );
    expect(leaseEnd({})).toBe('taken');
    expect(endReason({ reason: RESTARTED })).toBe(
      'idle while bob waits for a GPU'
    );
    expect(endReason({ reason: 'released by alice' })).toBe(
      'released by alice'
    );
  });
});

describe('summarizeKernel after a lease ended', () => {
  const s = status({ devices: [device(0), device(1)] });
  const ended = (reason: string) =>
    lease('L1', {
      state: 'released',
      reason,
      device_indices: [1],
      devices: ['GPU-1']
    });

  it('says none after the kernel gave its GPU back, not "at first cell"', () => {
    const summary = summarizeKernel(s, null, T0, null, {
      lazy: true,
      ended: ended('released by kernel k1')
    });
    expect(summary.text).toBe('GPU: none');
    expect(summary.state).toBe('none');
    expect(summary.description).toBe(
      'This kernel gave its GPU 1 back and asks for none by itself: run %gpu acquire to get ' +
        'one (2 of 2 free on this host).'
    );
  });

  it('says the next cell asks again after a GPU was taken back', () => {
    const summary = summarizeKernel(s, null, T0, null, {
      lazy: false,
      ended: ended('released while idle: the kernel held no GPU memory')
    });
    expect(summary.text).toBe('GPU: at next cell');
    expect(summary.description).toMatch(
      /^GPU 1 was taken back \(released while idle/
    );
  });

  it('says a restarted lazy kernel gets a GPU at its first cell', () => {
    const summary = summarizeKernel(s, null, T0, null, {
      lazy: true,
      ended: ended(RESTARTED)
    });
    expect(summary.text).toBe('GPU: at first cell');
    expect(summary.description).toMatch(
      /^This kernel was restarted to free GPU 1/
    );
  });

  it('says "at first cell" only for a lazy kernel that never held a lease', () => {
    expect(summarizeKernel(s, null, T0, null, { lazy: true }).text).toBe(
      'GPU: at first cell'
    );
  });
});
