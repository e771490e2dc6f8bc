"""Several tm-launch "nodes" on one machine: ``LocalJob`` (agents on loopback around one etcd,
real faults, the step log read back) for the demo, the end-to-end tests and the benchmarks, and
``make demo`` itself (``python -m tm_launch.local.demo``). It starts processes and reads files;
it never reaches into the agents.
"""
