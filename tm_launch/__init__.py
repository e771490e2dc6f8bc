"""tm-launch: a torchrun drop-in that survives failures.

Worker API (see ``tm_launch.runtime``)::

    import tm_launch
    job = tm_launch.init()
    model = DDP(model, process_group=job.group)
    job.register(model=model, optimizer=opt)
    for step in job.steps(total_steps):
        ...
"""


def init(backend: str | None = None):
    """Start this worker's part of the job (imported lazily: `tm-launch ctl` needs no torch)."""
    from .runtime import init as _init

    return _init(backend)


def __getattr__(name: str):
    if name == "RNGState":  # job.register(per_rank=True, rng=tm_launch.RNGState())
        from .per_rank import RNGState

        return RNGState
    raise AttributeError(name)


__all__ = ["init", "RNGState"]
