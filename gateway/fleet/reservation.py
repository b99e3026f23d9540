"""One request's use of a version on a replica, from the scheduler's decision to the response's end.

A ``Reservation`` is taken the moment the scheduler picks a replica, before the version is loaded there
(when it must be) and before the first byte goes out: it is counted on the replica at once
(``Replica.begin``, with no await before it, so this kvgate's evictions and sweep see it) and leased
fleet-wide (``Leases.acquire``, so every other kvgate's evictions see it too). A pair's first lease is
written beside the request, not before it: no Redis round trip on the request path, at the price of a
window of one round trip in which another kvgate may still claim the name; a request that then meets a
replica without it is retried there, which loads it again (never served by another version). The
requests that wait for a load hold their reservations already and take the version over when it
lands. It is refused while this kvgate unloads that version there (``Replica.unloading``); another
kvgate's unload in progress refuses the lease in Redis (``Leases``). ``release`` lets go of both, once.
"""

from __future__ import annotations

from gateway.core.errors import VersionUnloading
from gateway.fleet.leases import Leases
from gateway.fleet.replicas import Replica


class Reservation:
    __slots__ = ("_leases", "_live", "name", "replica")

    def __init__(self, replica: Replica, name: str | None, leases: Leases) -> None:
        self.replica, self.name, self._leases = replica, name, leases
        self._live = True

    @classmethod
    def take(cls, replica: Replica, name: str | None, leases: Leases) -> Reservation:
        """Count one request on ``name`` (None: the base model) at ``replica``, here and fleet-wide;
        ``VersionUnloading`` (nothing held) while that name is being unloaded there."""
        if name is not None and name in replica.unloading:
            raise VersionUnloading(f"{name} is being unloaded from {replica.url}")
        replica.begin(name)  # counted before anything can yield to another task
        if name is not None:
            leases.acquire(replica.url, name)  # no await: its Redis write (first use) runs beside the request
        return cls(replica, name, leases)

    def release(self) -> None:
        if not self._live:
            return
        self._live = False
        self.replica.end(self.name)
        if self.name is not None:
            self._leases.release(self.replica.url, self.name)

    def __repr__(self) -> str:
        return f"Reservation({self.replica.url!r}, {self.name!r}, live={self._live})"
