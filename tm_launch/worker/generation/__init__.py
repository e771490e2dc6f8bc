"""Entering a generation inside a worker: what the agent says, who builds what, which state goes where.

``directives`` (the agent's directives, read through one object), ``world_builds`` (a
generation's communicators built on its store, on a thread, or ahead of time),
``generations`` (entering, following the agent at a step boundary, planned switches, delta
set-up of subgroups), ``commit`` (the job-wide vote through the generation's store),
``recovery`` (which step the job continues from and who sends what: pure, table-tested),
``state_exchange`` (the holdings gathered, the plan carried out: live sends, snapshots,
parity).

Imports: ``snapshots``, ``state``, ``comms``, ``torch_patches`` and the worker's root modules.
"""
