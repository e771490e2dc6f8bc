"""A spare's life inside its worker: warm up without peers, park, be promoted.

``sandbox`` (``Spare``: the warm-up steps on local backends, parking until a generation names
this node, entering before a framework's loop, running the script again for ranks it did not
warm up as: ``RankChanged``), ``ddp_rebuild`` (DDP's early-step bucket rebuild done in the
sandbox), ``sharding_decisions`` (DTensor's cached decisions kept across a change of ranks),
``cuda_warmup`` (what the warm-up leaves in the CUDA allocator, handed back).

Imports: ``generation``, ``snapshots``, ``state``, ``comms`` and the worker's root modules.
"""
