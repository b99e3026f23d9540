"""Which base a ``kvgate publish`` is for, and its fingerprint: asked of the replicas themselves.

Every configured replica is asked what it serves (``/v1/models``) and fingerprinted (``fleet.base_prints``:
the base's bytes where this machine can read its directory, and the fixed probe, cold).
``--base NAME`` picks one served base; without it, the only one. Refused with a clear error: several
bases served and no ``--base``; a ``--base`` no replica serves; replicas of the base that are two bases by
``core.base_print``'s rule (other bytes; or, where bytes cannot be read, a behaviour difference that
``CONFIRM_PROBES`` prints in a row confirm): one was swapped, publish when they agree again. Replicas whose
bytes agree are one base whatever their behaviour prints say. The version records the agreed bytes and
the first replica's behaviour. When no replica answers at all, the version is published for the
configured ``base_model`` without a fingerprint, and a note says so: kvgate then holds it to the first
fingerprint it takes of that base.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace
from pathlib import Path

import aiohttp

from gateway.core import base_print
from gateway.core.errors import BadRequest
from gateway.core.identity import base_identity
from gateway.fleet.backends import AdapterListing, BackendDialect, dialect_for
from gateway.fleet.base_bytes import CACHE_FILE, BaseBytes
from gateway.fleet.base_prints import CONFIRM_WAIT_S, base_directory, probe
from gateway.settings.model import Settings


@dataclass(frozen=True, slots=True)
class ChosenBase:
    identity: str  # what the epoch table records as the version's base
    print: str  # its fingerprint, encoded ('' : none could be taken)
    note: str = ""  # said to the operator when the choice is not plain
    directory: Path | None = None  # where this machine reads its files (the adapter's fit is checked there)


@dataclass(frozen=True, slots=True)
class _Seen:
    url: str
    listing: AdapterListing
    print: str  # bytes and behaviour, encoded; '' when it cannot be fingerprinted
    why_not: str = ""
    directory: Path | None = None  # where this machine reads the base's files, when it can


async def choose_base(settings: Settings, requested: str | None) -> ChosenBase:
    timeout = aiohttp.ClientTimeout(sock_connect=settings.connect_timeout, sock_read=settings.read_timeout)
    dialect = dialect_for(settings.backend)
    bytes_ = BaseBytes(settings.data_dir / CACHE_FILE)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def look(url: str) -> _Seen | None:
            return await _look(session, dialect, url, settings, bytes_)

        found = await asyncio.gather(*(look(url) for url in settings.replicas))
        seen = [s for s in found if s is not None and s.listing.base_name is not None]
        for _ in range(1, base_print.CONFIRM_PROBES):  # a behaviour difference: confirmed, or gone
            if not _behaviour_differs(seen):
                break
            await asyncio.sleep(CONFIRM_WAIT_S)
            seen = [await look(s.url) or s for s in seen]
    if not seen:
        if requested not in (None, settings.base_model):
            raise BadRequest(f"no replica answered, so base {requested!r} cannot be checked", param="base")
        why = "no replica answered" if settings.replicas else "no replica given (--replica)"
        return ChosenBase(
            settings.base_identity,
            "",
            f"{why}: published for base {settings.base_model!r} without a fingerprint (kvgate holds it to "
            "the first fingerprint it takes of that base)",
            settings.base_model_dir_map.get(settings.base_model),
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
    directory = next((s.directory for s in of_base if s.directory is not None and s.directory.is_dir()), None)
    return ChosenBase(base_identity(requested, root), *_agreed_print(requested, of_base), directory)


def _agreed_print(name: str, of_base: list[_Seen]) -> tuple[str, str]:
    """The base's print when no two replicas are two bases (and a note): the bytes they agree on, with
    the first printed replica's behaviour."""
    printed = [(s, p) for s in of_base if (p := base_print.decode(s.print)) is not None]
    if not printed:
        reasons = "; ".join(f"{s.url}: {s.why_not}" for s in of_base)
        return "", f"base {name!r} could not be fingerprinted ({reasons}): published without a fingerprint"
    for (one, _), (other, _) in itertools.combinations(printed, 2):
        why = base_print.differs(one.print, other.print)
        if why is not None:
            described = ", ".join(f"{s.url}: {base_print.short(s.print)}" for s, _ in printed)
            raise BadRequest(
                f"the replicas serving base {name!r} have different fingerprints ({described}; {why}): one "
                "serves other weights under that name; publish once they agree",
                param="base",
            )
    bytes_ = next((p.bytes for _, p in printed if p.bytes), "")
    behaviour = next((p for _, p in printed if p.behaviour), None)
    chosen = base_print.with_bytes(behaviour, bytes_)
    return (chosen.encode() if chosen is not None else ""), ""


def _behaviour_differs(seen: list[_Seen]) -> bool:
    """Whether two replicas of one base name differ by behaviour where the bytes do not decide."""
    for one, other in itertools.combinations(seen, 2):
        if one.listing.base_name != other.listing.base_name:
            continue
        a, b = base_print.decode(one.print), base_print.decode(other.print)
        if a is not None and b is not None and not (a.bytes and b.bytes) and a.behaviour_difference(b):
            return True
    return False


async def _look(
    session: aiohttp.ClientSession, dialect: BackendDialect, url: str, settings: Settings, bytes_: BaseBytes
) -> _Seen | None:
    try:
        listing = await dialect.list_adapters(session, url)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    if listing.base_name is None:
        return None
    directory = base_directory(settings.base_model_dir_map, listing)
    digest = await bytes_.digest_async(directory) if directory is not None else None
    try:
        taken = await probe(session, dialect, url, listing.base_name, settings.base_print_tolerance)
    except (aiohttp.ClientError, TimeoutError) as exc:
        taken = f"the probe failed: {exc!r}"
    if isinstance(taken, str):
        only = base_print.with_bytes(None, digest)
        return _Seen(url, listing, only.encode() if only is not None else "", taken, directory)
    return _Seen(url, listing, replace(taken, bytes=digest or "").encode(), directory=directory)
