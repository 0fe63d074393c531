import { IGPUSchedClient, IStatusPayload, LeaseUpdate } from '../api';
import { GPUSchedModel, IEventSocket } from '../model';
import { iso, payload, T0 } from './fixtures';

// ---------------------------------------------------------------------------------------------
// Test doubles for the model's transport.

export class FakeSocket implements IEventSocket {
  onopen: ((event: Event) => void) | null = null;
  onmessage: ((event: MessageEvent) => void) | null = null;
  onerror: ((event: Event) => void) | null = null;
  onclose: ((event: CloseEvent) => void) | null = null;
  closed = false;

  constructor(readonly url: string) {}

  close(): void {
    this.closed = true;
  }

  open(): void {
    this.onopen?.(new Event('open'));
  }

  send(data: unknown): void {
    this.onmessage?.(
      new MessageEvent('message', { data: JSON.stringify(data) })
    );
  }

  fail(code = 1006): void {
    this.onerror?.(new Event('error'));
    this.onclose?.(new CloseEvent('close', { code }));
  }
}

export class FakeClient implements IGPUSchedClient {
  status: IStatusPayload = payload();
  failWith: Error | null = null;
  calls = { getStatus: 0 };
  getStatus = jest.fn(async (): Promise<IStatusPayload> => {
    this.calls.getStatus += 1;
    if (this.failWith) {
      throw this.failWith;
    }
    return this.status;
  });
  ended: Record<string, LeaseUpdate> = {};
  getLease = jest.fn(
    async (id: string): Promise<LeaseUpdate | null> => this.ended[id] ?? null
  );
  releaseLease = jest.fn(async (_id: string): Promise<void> => undefined);
  keepLease = jest.fn(
    async (id: string, seconds: number): Promise<LeaseUpdate | null> => ({
      id,
      keep_until: iso(T0 + seconds * 1000)
    })
  );
  drainDevice = jest.fn(async (_uuid: string): Promise<void> => undefined);
  undrainDevice = jest.fn(async (_uuid: string): Promise<void> => undefined);
}

export function sleep(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

export async function waitFor(
  condition: () => boolean,
  timeoutMs = 2000
): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!condition()) {
    if (Date.now() > deadline) {
      throw new Error('condition not met in time');
    }
    await sleep(5);
  }
}

export interface IHarness {
  model: GPUSchedModel;
  client: FakeClient;
  sockets: FakeSocket[];
  changes: () => number;
}

export function harness(
  options: Partial<GPUSchedModel.IOptions> = {}
): IHarness {
  const client = new FakeClient();
  const sockets: FakeSocket[] = [];
  let changes = 0;
  const model = new GPUSchedModel({
    client,
    socketUrl: 'ws://example/api/gpusched/events',
    openSocket: url => {
      const socket = new FakeSocket(url);
      sockets.push(socket);
      return socket;
    },
    refreshInterval: 1,
    retry: { baseMs: 20, maxMs: 40, maxAttempts: 3, slowMs: 10000 },
    snapshotWaitMs: 30,
    standby: 'never',
    clock: () => T0,
    ...options
  });
  model.changed.connect(() => {
    changes += 1;
  });
  return { model, client, sockets, changes: () => changes };
}
