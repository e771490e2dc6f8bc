"""Runs in every training process: ``tm_launch.init()``, the live job and the generation protocol.

A worker knows only its own agent, through ``tm_launch.protocol`` (the agent's local TCPStore
and the environment): it never imports etcd clients, the rendezvous or the agent's code, which
``tests/unit/test_boundaries.py`` checks in a fresh interpreter.
``python -m tm_launch.worker SCRIPT`` (``__main__``) is how the agent starts a live worker.

Its rooms, top to bottom; a module imports only from its own room or the rooms below it (the
same test checks it):

=================  ============================================================================
``integrations``   Lightning, Hugging Face ``Trainer``, torchtitan: a framework's own loop driven
                   as live steps (``live_loop``); ``tm_launch.lightning`` & co. re-export them
``job``            what a script holds: ``init`` (``entry``), ``PlainJob``, ``LiveJob`` (the live
                   API and its step loop), the step guard (effects wait for the commit)
``spare``          a spare's warm-up in the sandbox, parking, promotion to other ranks
``generation``     entering a generation: the directives, communicators built (ahead), the
                   commit vote, the recovery plan, the state exchange, planned switches
``torch_patches``  every change made to torch's own objects, with why and how it is undone
``torch_support``  the torch releases tested, the warning a worker on another logs at start
``snapshots``      in-memory snapshots of what no live rank replicates, and their holders
``state``          what a rank holds: replica sets, the wire format of a transfer, per-rank
                   state (RNG, data position), ZeRO partitions
``comms``          groups that survive substitution (``LiveGroup``), the communicators behind
                   them, their connections and the stores' clients
(root)             ``api`` (the ``Job`` interface), ``log`` (its lines), ``agent_client`` and ``step_report`` (the
                   worker's side of the agent protocol), ``failpoints``, ``exit_notice``
=================  ============================================================================
"""
