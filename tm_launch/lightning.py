"""Public name of the Lightning integration: ``Trainer(strategy=tm_launch.lightning.LiveStrategy())``.

The code lives with the rest of the worker runtime (``tm_launch.worker.integrations.lightning``);
this module keeps the name users import, as ``torch.distributed.run`` keeps torchrun's.
"""

from .worker.integrations.lightning import LiveStrategy, ReportSteps

__all__ = ["LiveStrategy", "ReportSteps"]
