"""``tm-launch rehearse``: proves, on this machine, that a live recovery of the user's own script
ends where the fault-free run ends, or names what breaks it.

Runs on the operator's side: it starts torchrun, etcd and tm-launch agents as processes and reads
the state the workers wrote (``tm_launch.worker.rehearsal_dump``), never importing worker code.
``runs`` starts the runs, ``compare`` (pure) finds the differing tensors and their likely cause,
``report`` (pure) says it, ``main`` is the command.
"""
