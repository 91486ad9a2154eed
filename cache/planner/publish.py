"""``blocktrie replay --publish``: one `KVEventPublisher` per replica.

Replica ``i`` of ``N`` publishes on its own endpoint (`replica_endpoints`):
``tcp://HOST:PORT`` gives ports ``PORT .. PORT + N - 1``; ``tcp://HOST:*``
gives each replica an ephemeral port (reported); ``ipc://PATH`` gives
``PATH`` for one replica, ``PATH-0 .. PATH-{N-1}`` for several. The topic is
empty (vLLM's default) and every batch carries ``data_parallel_rank`` = the
replica id, so one subscriber connected to several replicas can tell them
apart. Bound when the host is ``*`` (as vLLM's publisher does), connected
otherwise (a router that binds its SUB socket). pyzmq is imported only when
publishers are built.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

__all__ = ["Publishers", "replica_endpoints"]


def replica_endpoints(endpoint: str, replicas: int) -> list[str]:
    """The endpoint of each replica (see the module docstring); `ValueError` with a
    one-line reason for an address this cannot split."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) == len("ipc://"):
            raise ValueError(f"{endpoint!r} names no socket path")
        return [endpoint] if replicas == 1 else [f"{endpoint}-{i}" for i in range(replicas)]
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"expected tcp://HOST:PORT or ipc://PATH, got {endpoint!r}")
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected tcp://HOST:PORT, got {endpoint!r}")
    if port == "*":
        return [endpoint] * replicas
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"port must be 1-65535 or *, got {port!r}")
    first = int(port)
    if first + replicas - 1 > 65535:
        last = first + replicas - 1
        raise ValueError(f"{replicas} replicas need ports {first}-{last}: past 65535")
    return [f"tcp://{host}:{first + i}" for i in range(replicas)]


class Publishers:
    """`KVEventPublisher`s for the replicas, as a context manager.

    On entry it builds them (`zmq.ZMQError` when an address cannot be bound or
    connected) and waits `wait` seconds for subscribers to connect (PUB sends
    nothing to a subscriber before its subscription arrives). `publish(replica,
    events)` is the fleet replay's ``on_events`` hook. On exit it waits until
    the queues are empty (at most 10 s), waits `wait` seconds more for the
    last batches to leave, and closes. `stats()` is the report's ``publish``
    list.
    """

    def __init__(self, endpoints: Sequence[str], wait: float) -> None:
        self.endpoints = list(endpoints)
        self.wait = wait
        self._pubs: list[Any] = []

    def __enter__(self) -> Publishers:
        from cache.kv_publisher import KVEventPublisher

        try:
            for i, endpoint in enumerate(self.endpoints):
                self._pubs.append(KVEventPublisher(endpoint, data_parallel_rank=i))
        except BaseException:
            self._close()
            raise
        time.sleep(self.wait)
        return self

    def publish(self, replica: int, events: list[Any]) -> None:
        self._pubs[replica].publish(events)

    @property
    def bound(self) -> list[str]:
        """Each replica's endpoint as bound (ephemeral ports resolved)."""
        return [pub.endpoint for pub in self._pubs]

    def stats(self) -> list[dict[str, Any]]:
        return [
            {
                "replica": i,
                "endpoint": pub.endpoint,
                "published_batches": pub.published_batches,
                "dropped_batches": pub.dropped_batches,
                "dropped_events": pub.dropped_events,
            }
            for i, pub in enumerate(self._pubs)
        ]

    def _close(self) -> None:
        for pub in self._pubs:
            pub.close()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            deadline = time.monotonic() + 10.0
            while any(p.queued_batches for p in self._pubs) and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(self.wait)
        self._close()
