"""torch elastic's c10d rendezvous with every store it hosts listening on one address.

torch's c10d backend (and the bootstrap store its handler gives the ranks) listens on every
interface: anyone who can reach the machine could read the job's keys and write its own (the
watchdog's alarm, the text of a hang report). This backend is the same rendezvous, registered
under `NAME`, whose stores listen only on the address the job uses: loopback for a run on one
machine, the node's own address on the rendezvous network for several. Everything else is
torch's (`C10dRendezvousBackend`, `DynamicRendezvousHandler`).
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import registry
from torch.distributed.elastic.rendezvous.api import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from shardwise.distributed.store import listening_store

NAME = "shardwise-c10d"
# the handlers `_create` made in this process and still alive (`stop_heartbeats`)
_HANDLERS: weakref.WeakSet = weakref.WeakSet()


class _Backend(C10dRendezvousBackend):
    @property
    def name(self) -> str:  # torch checks the handler's backend against the name asked for
        return NAME


def _create(params: RendezvousParameters):
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    timeout = params.get_as_int("read_timeout", 60)
    if params.get_as_bool("is_host", True):
        store = listening_store(params.get("bind", host), port, timeout)
    else:
        import datetime

        store = dist.TCPStore(
            host,
            port,
            is_master=False,
            multi_tenant=True,
            timeout=datetime.timedelta(seconds=timeout),
        )
    handler = create_handler(store, _Backend(store, params.run_id), params)
    # the bootstrap store rank 0's agent hosts for the ranks (torch's own listens on every
    # interface): on this node's address (`local_addr`) only
    handler._create_tcp_store_server = lambda addr, port: listening_store(addr, port, timeout)
    _HANDLERS.add(handler)
    return handler


def stop_heartbeats() -> None:
    """Stop the keep-alive thread of every handler this process made, from this thread. torch
    elastic leaves it running when its agent is signalled (the rendezvous stays open for
    other nodes); the thread's finalizer then may run on that thread itself when the handler
    is collected there, and print "cannot join current thread" as the job exits. Call it
    while the handler is still referenced (the signal's traceback holds the agent's frames).
    Stopping twice does nothing."""
    for handler in list(_HANDLERS):
        handler._stop_heartbeats()


def register() -> str:
    """Make `NAME` a rendezvous backend of this process's torch elastic (idempotent)."""
    registry.handler_registry.register(NAME, _create)
    return NAME
