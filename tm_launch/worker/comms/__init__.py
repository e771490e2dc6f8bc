"""Groups that survive substitution and the communicators behind them.

``groups`` (``LiveGroup``: one Python object whose communicator is swapped; ``LocalBackend``
for the sandbox), ``communicators`` (the one place that builds a generation's gloo/NCCL
communicator, and gives one up), ``connections`` (this process's TCP connections: a
communicator's sockets, shut down when given up), ``store_clients`` (connections to the
generation stores, opened before they are needed).

Imports: the worker's root modules only.
"""
