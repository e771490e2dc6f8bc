"""Runs in every training process: ``tm_launch.init()``, the live job and the generation protocol.

A worker knows only its own agent, through ``tm_launch.protocol`` (the agent's local TCPStore
and the environment): it never imports etcd clients, the rendezvous or the agent's code, which
``tests/unit/test_boundaries.py`` checks in a fresh interpreter.
``python -m tm_launch.worker SCRIPT`` (``__main__``) is how the agent starts a live worker.
"""
