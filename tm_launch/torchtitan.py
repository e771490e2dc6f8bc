"""Public name of the torchtitan integration: ``python -m tm_launch.torchtitan`` (torchtitan's
``torchtitan.train`` with live steps), and ``LiveTrainer`` to subclass.

The code lives with the rest of the worker runtime (``tm_launch.worker.integrations.torchtitan``);
this module keeps the name users run and import.
"""

from .worker.integrations.torchtitan import LiveTrainer, main

__all__ = ["LiveTrainer", "main"]

if __name__ == "__main__":
    main()
