"""Shared fixtures: one real etcd per test session, KV clients for both API versions, and a port
that refuses connections."""

import os
import socket
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rendezvous.etcd_server import EtcdServer  # noqa: E402
from rendezvous.kv import EtcdOptions, connect  # noqa: E402


@pytest.fixture
def refusing_port():
    """A loopback port that refuses connections for the whole test: bound, never listening.

    A port bound and closed again ("nothing listens there") can be taken by any socket of the
    suite's other processes before the test connects, or by the connect itself as its own
    source port (a TCP self-connect, which succeeds); held bound, it can be neither."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture(scope="session")
def etcd_server():
    """A private etcd (fresh temp data dir) shared by the whole session; tests isolate by prefix."""
    with EtcdServer() as server:
        yield server


@pytest.fixture
def etcd_endpoint(etcd_server):
    return etcd_server.endpoint


@pytest.fixture(params=["v2", "v3"])
def kv_factory(request, etcd_endpoint):
    """``make(prefix) -> KV`` on the session etcd, API v2 or v3 (``make.api``).

    Every prefix is placed under a root unique to this test, so tests never see each other's
    keys, while KVs made in the same test share that root (make("a") and make("b") are siblings).
    """
    root = f"/tests/{uuid.uuid4().hex[:12]}"
    made = []

    def make(prefix: str = "", **options):
        kv = connect(request.param, EtcdOptions(endpoints=(etcd_endpoint,), prefix=f"{root}/{prefix}".rstrip("/"), **options))
        made.append(kv)
        return kv

    make.api = request.param
    yield make
    for kv in made:
        kv.close()


@pytest.fixture
def local_job(etcd_endpoint, tmp_path, request):
    """``make(**options) -> LocalJob``: agents on loopback around the session etcd, stopped at the end.

    The run id is unique per test; on failure the agents' log tails are attached to the report."""
    from tm_launch.local.localjob import LocalJob

    jobs = []

    def make(**options):
        options.setdefault("run_id", f"t-{uuid.uuid4().hex[:10]}")
        job = LocalJob(endpoint=etcd_endpoint, workdir=str(tmp_path / options["run_id"]), **options)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.stop()
