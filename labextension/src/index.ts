import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  ICommandPalette,
  ISessionContext,
  Notification
} from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { KernelSpec, Session } from '@jupyterlab/services';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { refreshIcon } from '@jupyterlab/ui-components';
import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { gpuIcon } from './icons';
import { GPUSchedModel } from './model';
import { NotebookNotices } from './notebooks';
import { GPUSchedNotifier, INotificationSink } from './notifier';
import { GPUSchedPanel, PANEL_ID } from './panel';
import { GPUStatusItem } from './statusbar';
import { bindsLazily } from './format';

export * from './api';
export * from './format';
export { GPUSchedModel } from './model';
export type { ConnectionState } from './model';

/** The plugin id; also the id of its settings (`schema/plugin.json`). */
const PLUGIN_ID = 'jupyter-gpusched:plugin';

/** Command ids. */
export namespace CommandIDs {
  export const showPanel = 'gpusched:show-panel';
  export const refresh = 'gpusched:refresh';
}

/** JupyterLab's notifications as a sink for the notifier. */
const labNotifications: INotificationSink = {
  emit: (message, type, options) => Notification.emit(message, type, options),
  update: args => Notification.update(args),
  dismiss: id => Notification.dismiss(id)
};

/** The session context of a widget, if it has one (notebooks, consoles). */
function sessionContextOf(widget: Widget | null): ISessionContext | null {
  if (!widget || !('sessionContext' in widget)) {
    return null;
  }
  const context: unknown = (widget as { sessionContext?: unknown })
    .sessionContext;
  if (
    typeof context === 'object' &&
    context !== null &&
    'kernelChanged' in context &&
    'sessionChanged' in context
  ) {
    return context as ISessionContext;
  }
  return null;
}

function kernelIdOf(context: ISessionContext | null): string | null {
  return context?.session?.kernel?.id ?? null;
}

/** Whether the kernel of a session binds lazily, from its kernelspec's provisioner config. */
function lazyKernel(
  context: ISessionContext | null,
  specs: KernelSpec.ISpecModels | null | undefined
): boolean {
  const name = context?.session?.kernel?.name;
  const spec = name ? specs?.kernelspecs[name] : undefined;
  return bindsLazily(spec?.metadata);
}

/** Kernel id -> session path of the running sessions. */
function kernelPaths(models: Iterable<Session.IModel>): Map<string, string> {
  const paths = new Map<string, string>();
  for (const model of models) {
    if (model.kernel?.id) {
      paths.set(model.kernel.id, model.path);
    }
  }
  return paths;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'GPU scheduling in JupyterLab: who holds which GPU, the queue, reclaim countdowns and notifications.',
  autoStart: true,
  optional: [
    ILabShell,
    IStatusBar,
    ISettingRegistry,
    ILayoutRestorer,
    ICommandPalette,
    INotebookTracker
  ],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    statusBar: IStatusBar | null,
    settingRegistry: ISettingRegistry | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    notebooks: INotebookTracker | null
  ): void => {
    const model = new GPUSchedModel({
      serverSettings: app.serviceManager.serverSettings
    });
    const notifier = new GPUSchedNotifier({ model, sink: labNotifications });
    const showError = (message: string): void => {
      Notification.error(message, { autoClose: 10000 });
    };

    // This server's kernels: their notebooks name the leases, and they are the user's own.
    const sessions = app.serviceManager.sessions;
    model.localKernels = kernelPaths(sessions.running());
    sessions.runningChanged.connect((_, models) => {
      model.localKernels = kernelPaths(models);
    });

    // Sidebar panel.
    const panel = new GPUSchedPanel({ model, onError: showError });
    app.shell.add(panel, 'left', { rank: 900 });
    if (restorer) {
      restorer.add(panel, 'jupyter-gpusched-panel');
    }

    app.commands.addCommand(CommandIDs.showPanel, {
      label: 'Show GPU Panel',
      caption: 'Show the GPUs of this host, their leases and the queue',
      icon: gpuIcon,
      execute: () => {
        app.shell.activateById(PANEL_ID);
      }
    });
    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh GPU Status',
      icon: refreshIcon,
      execute: () => model.refresh()
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.showPanel, category: 'GPU' });
      palette.addItem({ command: CommandIDs.refresh, category: 'GPU' });
    }

    // The current notebook's GPU: an item of JupyterLab's status bar. Notebook 7 has no
    // status bar: there the item sits in the menu bar of each notebook page, on the right.
    const item = new GPUStatusItem({
      model,
      onActivate: () => {
        void app.commands.execute(CommandIDs.showPanel);
      }
    });
    const activeChanged = new Signal<Widget, void>(item);
    const kernelspecs = app.serviceManager.kernelspecs;
    let context: ISessionContext | null = null;
    const onKernel = (): void => {
      item.kernelId = kernelIdOf(context);
      item.lazy = lazyKernel(context, kernelspecs.specs);
    };
    kernelspecs.specsChanged.connect(onKernel);
    const follow = (widget: Widget | null): void => {
      if (context) {
        context.kernelChanged.disconnect(onKernel);
        context.sessionChanged.disconnect(onKernel);
      }
      context = sessionContextOf(widget);
      if (context) {
        context.kernelChanged.connect(onKernel);
        context.sessionChanged.connect(onKernel);
      }
      onKernel();
      item.setHidden(statusBar === null && context === null);
      activeChanged.emit();
    };
    const shellChanged = labShell?.currentChanged ?? app.shell.currentChanged;
    if (shellChanged) {
      shellChanged.connect((_, args) => follow(args.newValue));
    }
    if (statusBar) {
      statusBar.registerStatusItem('jupyter-gpusched:status', {
        item,
        align: 'left',
        rank: 4,
        isActive: () => context !== null,
        activeStateChanged: activeChanged
      });
    } else if (!labShell) {
      item.addClass('jp-gpusched-StatusItem-menu');
      app.shell.add(item, 'menu', { rank: 1000 });
    }
    follow(app.shell.currentWidget);

    // Settings: refresh rate and notifications.
    if (settingRegistry) {
      const apply = (settings: ISettingRegistry.ISettings): void => {
        const rate = settings.get('refreshRate').composite;
        const notifications = settings.get('notifications').composite;
        if (typeof rate === 'number') {
          model.refreshInterval = rate;
        }
        notifier.enabled = notifications !== false;
      };
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          apply(settings);
          settings.changed.connect(apply);
        })
        .catch(reason => {
          console.error('jupyter-gpusched: failed to load settings.', reason);
        });
    }

    // Countdowns in notebooks that nobody updates any more (their kernel was restarted, or
    // they were saved and opened again) are replaced by what became of the reclaim.
    if (notebooks) {
      new NotebookNotices({ model, tracker: notebooks });
    }

    model.start();
  }
};

export default plugin;
