"""Which base a ``kvgate publish`` is for, and its fingerprint: asked of the replicas themselves.

Every configured replica is asked what it serves (``/v1/models``) and fingerprinted (the fixed probe,
cold; ``fleet.base_prints``). ``--base NAME`` picks one served base; without it, the only one. Refused
with a clear error: several bases served and no ``--base``; a ``--base`` no replica serves; replicas of
the base whose fingerprints differ (one was swapped: publish when they agree again). When no replica
answers at all, the version is published for the configured ``base_model`` without a fingerprint, and
a note says so: kvgate then holds it to the first fingerprint it takes of that base.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from gateway.core import base_print
from gateway.core.errors import BadRequest
from gateway.core.identity import base_identity
from gateway.fleet.backends import AdapterListing, BackendDialect, dialect_for
from gateway.fleet.base_prints import probe
from gateway.settings.model import Settings


@dataclass(frozen=True, slots=True)
class ChosenBase:
    identity: str  # what the epoch table records as the version's base
    print: str  # its fingerprint, encoded ('' : none could be taken)
    note: str = ""  # said to the operator when the choice is not plain


@dataclass(frozen=True, slots=True)
class _Seen:
    url: str
    listing: AdapterListing
    print: str  # '' when it cannot be fingerprinted
    why_not: str = ""


async def choose_base(settings: Settings, requested: str | None) -> ChosenBase:
    timeout = aiohttp.ClientTimeout(sock_connect=settings.connect_timeout, sock_read=settings.read_timeout)
    dialect = dialect_for(settings.backend)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        found = await asyncio.gather(*(_look(session, dialect, url, settings) for url in settings.replicas))
    seen = [s for s in found if s is not None and s.listing.base_name is not None]
    if not seen:
        if requested not in (None, settings.base_model):
            raise BadRequest(f"no replica answered, so base {requested!r} cannot be checked", param="base")
        why = "no replica answered" if settings.replicas else "no replica given (--replica)"
        return ChosenBase(
            settings.base_identity,
            "",
            f"{why}: published for base {settings.base_model!r} without a fingerprint (kvgate holds it to "
            "the first fingerprint it takes of that base)",
        )
    served = sorted({str(s.listing.base_name) for s in seen})
    if requested is None:
        if len(served) > 1:
            raise BadRequest(
                f"the replicas serve several bases ({', '.join(served)}): choose one with --base",
                param="base",
            )
        requested = served[0]
    if requested not in served:
        raise BadRequest(f"no replica serves base {requested!r}; served: {', '.join(served)}", param="base")
    of_base = [s for s in seen if s.listing.base_name == requested]
    root = None
    if settings.base_model_root is not None:  # the root is part of the base: only replicas of that root
        root = settings.base_model_root if requested == settings.base_model else of_base[0].listing.base_root
        of_base = [s for s in of_base if s.listing.base_root == root]
        if not of_base:
            raise BadRequest(f"no replica serves base {requested!r} from root {root!r}", param="base")
    return ChosenBase(base_identity(requested, root), *_agreed_print(requested, of_base))


def _agreed_print(name: str, of_base: list[_Seen]) -> tuple[str, str]:
    """The base's print when every replica that could be fingerprinted agrees (and a note)."""
    printed = [s for s in of_base if s.print]
    if not printed:
        reasons = "; ".join(f"{s.url}: {s.why_not}" for s in of_base)
        return "", f"base {name!r} could not be fingerprinted ({reasons}): published without a fingerprint"
    first = base_print.decode(printed[0].print)
    for other in printed[1:]:
        theirs = base_print.decode(other.print)
        if first is None or theirs is None or not first.matches(theirs):
            described = ", ".join(f"{s.url}: {base_print.short(s.print)}" for s in printed)
            raise BadRequest(
                f"the replicas serving base {name!r} have different fingerprints ({described}): one serves "
                "other weights under that name; publish once they agree",
                param="base",
            )
    return printed[0].print, ""


async def _look(
    session: aiohttp.ClientSession, dialect: BackendDialect, url: str, settings: Settings
) -> _Seen | None:
    try:
        listing = await dialect.list_adapters(session, url)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    if listing.base_name is None:
        return None
    try:
        taken = await probe(session, dialect, url, listing.base_name, settings.base_print_tolerance)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return _Seen(url, listing, "", f"the probe failed: {exc!r}")
    if isinstance(taken, str):
        return _Seen(url, listing, "", taken)
    return _Seen(url, listing, taken.encode())
