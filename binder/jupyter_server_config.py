# Configuration of the Jupyter server on Binder (binder/start adds this directory to
# JUPYTER_CONFIG_PATH). Binder machines have no GPU: the scheduler runs on simulated ones, which
# have names, UUIDs, memory and utilization, and which kernels "use" through
# jupyter_gpusched.devices.simulated. Everything else is as on a real GPU host.
c = get_config()  # noqa: F821 - provided by the config loader

c.GPUSchedApp.backend = "simulated"
c.GPUSchedApp.simulated_devices = 4
# A simulated checkpoint holds no host RAM: the budget is what the four simulated 80 GiB GPUs could
# hold, not half of the Binder machine's small RAM (which would make every reclaim after the first
# checkpoint a restart).
c.GPUSchedApp.checkpoint_host_memory = "320GiB"

# Short enough to watch a GPU go idle and be taken back within a Binder session.
c.GPUSchedApp.idle_timeout = 120
c.GPUSchedApp.contended_idle_timeout = 30
c.GPUSchedApp.grace_period = 30

# New notebooks get the kernel that asks the scheduler for its GPU.
c.MappingKernelManager.default_kernel_name = "python3-gpu"
