"""tm-launch: a torchrun drop-in that survives failures.

Worker API (see ``tm_launch.worker.api.Job``)::

    import tm_launch
    job = tm_launch.init()
    model = DDP(model, process_group=job.group)
    job.register(model=model, optimizer=opt)
    batches = job.data(loader)            # a DataLoader over a DistributedSampler, a StatefulDataLoader
    for step in job.steps(total_steps):
        x, y = next(batches)              # exact when the step runs again or another rank takes over
        ...

A loop of its own (a framework's, or any plain loop: restart mode) reports its progress instead::

    job.report_step(global_step)   # or tm_launch.report_step(global_step) without init()
"""


def init(backend: str | None = None, rng_per_rank: bool = True, timeout=None):
    """Start this worker's part of the job (imported lazily: `tm-launch ctl` needs no torch).
    ``timeout``: a ``datetime.timedelta``, as ``init_process_group(timeout=...)`` takes it."""
    from .worker.job.entry import init as _init

    return _init(backend, rng_per_rank, timeout)


def report_step(step: int) -> None:
    """This worker finished step ``step`` (the global step count; see ``tm_launch.worker.job.entry``)."""
    from .worker.job.entry import report_step as _report_step

    _report_step(step)


def __getattr__(name: str):
    if name == "RNGState":  # job.register(per_rank=True, rng=tm_launch.RNGState())
        from .worker.state.per_rank import RNGState

        return RNGState
    raise AttributeError(name)


__all__ = ["init", "report_step", "RNGState"]
