"""`each_replica`: the processes behind a configured address, each reachable alone (what a
delete notice must reach), with the name to check in a certificate where the target is an
IP address."""

from __future__ import annotations

from ragline.clients import Replica, each_replica


async def test_an_address_list_is_its_members():
    assert await each_replica("127.0.0.1:5001,127.0.0.2:5002") == [
        Replica("127.0.0.1:5001"),
        Replica("127.0.0.2:5002"),
    ]


async def test_a_name_is_every_address_it_resolves_to_named_for_the_certificate():
    replicas = await each_replica("dns:///localhost:5001")
    assert replicas == [Replica("127.0.0.1:5001", server_name="localhost")]
    assert await each_replica("localhost:5001") == replicas


async def test_one_address_or_a_socket_is_itself_and_an_unknown_name_is_tried_as_it_is():
    assert await each_replica("127.0.0.1:5001") == [Replica("127.0.0.1:5001")]
    assert await each_replica("unix:/tmp/x.sock") == [Replica("unix:/tmp/x.sock")]
    unknown = "no-such-host.invalid:5001"
    assert await each_replica(unknown) == [Replica(unknown)]
