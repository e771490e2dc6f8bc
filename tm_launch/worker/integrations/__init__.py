"""Frameworks whose own loop runs live: Lightning, Hugging Face ``Trainer``, torchtitan.

``live_loop`` (a framework's optimizer-step hook driven as ``job.steps()``), ``lightning``
(``LiveStrategy``), ``huggingface`` (``LiveTrainer``), ``torchtitan`` (``LiveTrainer`` and
``python -m tm_launch.torchtitan``). Users import them by their public names
(``tm_launch.lightning``, ``tm_launch.huggingface``, ``tm_launch.torchtitan``), which re-export.

Imports: everything below (``job`` first); nothing in the worker imports them.
"""
