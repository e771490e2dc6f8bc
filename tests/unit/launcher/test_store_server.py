"""``tm_launch.launcher.store_server``: the agent's TCPStore takes a generation's connections at once."""

import datetime
import threading

import torch.distributed as dist

from tm_launch.launcher import store_server


def test_a_generations_worth_of_clients_connect_at_once():
    """32 clients connecting together (16 ranks, two connections each) all get in. The client
    timeout allows two of the resolver's 5 s timeouts: each connection makes torch's client ask
    for the address's name, and this machine's resolver drops a query when about a hundred
    arrive together (earlier tests' lookups count too; see the module and store_clients)."""
    server = store_server.serve("127.0.0.1")
    errors, clients = [], []

    def connect():
        try:
            client = dist.TCPStore(
                "127.0.0.1", server.port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=15)
            )
            client.add("connected", 1)
            clients.append(client)
        except Exception as e:  # noqa: BLE001 -- collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=connect) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert server.add("connected", 0) == 32
