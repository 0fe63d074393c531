import * as React from 'react';

import type { GPUSchedModel } from './model';

/**
 * The current time on the server's clock, re-read every `intervalMs` while `ticking` (for
 * countdowns); when not ticking, the time of the render.
 */
export function useNow(
  model: GPUSchedModel,
  ticking: boolean,
  intervalMs = 1000
): number {
  const [now, setNow] = React.useState<number>(() => model.now());
  React.useEffect(() => {
    if (!ticking) {
      return undefined;
    }
    setNow(model.now());
    const timer = setInterval(() => setNow(model.now()), intervalMs);
    return () => clearInterval(timer);
  }, [model, ticking, intervalMs]);
  return ticking ? now : model.now();
}

/** Runs actions by key, remembering which are in flight (to disable their buttons). */
export function usePending(
  onError: (message: string) => void
): [ReadonlySet<string>, (key: string, action: () => Promise<void>) => void] {
  const [pending, setPending] = React.useState<ReadonlySet<string>>(new Set());
  const mounted = React.useRef(true);
  React.useEffect(() => {
    mounted.current = true;
    return () => {
      mounted.current = false;
    };
  }, []);
  const run = React.useCallback(
    (key: string, action: () => Promise<void>) => {
      setPending(current => new Set(current).add(key));
      action()
        .catch((error: unknown) => {
          onError(error instanceof Error ? error.message : String(error));
        })
        .finally(() => {
          if (mounted.current) {
            setPending(current => {
              const next = new Set(current);
              next.delete(key);
              return next;
            });
          }
        });
    },
    [onError]
  );
  return [pending, run];
}
