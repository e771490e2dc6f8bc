"""What a rank holds, and how it is carried to a rank that takes its place.

``replicas`` (which live ranks hold exactly this rank's state: read off DTensor placements and
``register(replicas=...)``; fingerprints), ``transfer`` (the wire format of a state transfer and
its pure transfer plan), ``per_rank`` (state a rank alone advances: RNG, data position),
``zero`` (a ZeRO optimizer carried as this rank's partition), ``data_loaders`` (``job.data()``: batches
exact across a re-run and a joiner).

Imports: ``comms`` and the worker's root modules.
"""
