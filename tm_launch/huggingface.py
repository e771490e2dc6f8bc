"""Public name of the Hugging Face integration: ``tm_launch.huggingface.LiveTrainer``, ``ReportSteps``.

The code lives with the rest of the worker runtime (``tm_launch.worker.integrations.huggingface``);
this module keeps the name users import.
"""

from .worker.integrations.huggingface import LiveTrainer, ReportSteps

__all__ = ["LiveTrainer", "ReportSteps"]
