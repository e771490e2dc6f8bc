"""Runs in the ``tm-launch`` process on every node: the agent and its parts.

The agent registers the node in etcd, follows the generations the planners publish, starts and
watches this node's workers, and reports what it sees (worker exits, hangs, health alarms, dead
peers). It talks to its workers only through ``tm_launch.protocol`` (the agent's TCPStore and
the environment it starts them with), never by importing worker code; it writes the job's
history for operators through ``tm_launch.joblog`` and ``rendezvous.membership``.
"""
