"""Runs on an operator's machine: ``tm-launch ctl status|events|drain|cordon|uncordon|timeline``.

Everything it shows is read from etcd (``rendezvous.membership`` and ``tm_launch.joblog``), so it
works for a running job and for one that ended hours ago; it imports no agent or worker code.
"""
