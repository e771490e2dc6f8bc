"""The job a script holds (``tm_launch.init()``), its user API and its step loop.

``entry`` (``init``, ``report_step``: which job this process gets), ``plain`` (``PlainJob``:
torchrun, restart mode), ``live`` (``LiveJob``: the live API and the step loop), ``step_guard``
(the job-wide commit asked at a step's first effect: optimizers, schedulers, scalers),
``training_state`` (what a live worker carries from one generation to the next),
``optimizer_steps`` (the steps of a script that never reports them).

Imports: ``spare``, ``generation``, ``snapshots``, ``state``, ``comms`` and the worker's root
modules; nothing imports ``job`` but ``integrations`` and ``tm_launch``'s public API.
"""
