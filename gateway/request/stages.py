"""Stages 3 to 5 of the request path (``proxy`` lists them all): from a parsed request to its ``Target``,
in memory only (the snapshot, the replicas' listings, the tokenizer), each with what it takes and gives.

- resolve: what the request names, ``Named``: a base model (any a healthy replica serves, or the
  configured one), a stored response's base, or a logical ID's entry in the snapshot; what the caller
  may not use is not found, exactly like an unknown ID.
- split: which of the ID's versions answers, ``Chosen``: the current one, or while a rollout runs the
  candidate for the share of split keys its weight says (``core/split.py``).
- tokenize: the cache namespace, the prompt's prefix keys and (with KV events) its tokens, and whether
  they are the whole prompt's (the account stage checks their count live, ``kv.live_check``): the
  ``Target`` the scheduler decides on. Both cover the prompt's leading blocks only; a large body's
  tokens and key text were computed where it was parsed (``parsing``), off the event loop.

What a stage hands the next (here, ``ParsedRequest``, ``Target``, the scheduler's ``Decision``, the
proxy's ``Outbound``) is a slotted dataclass built once per request and never changed afterwards; not a
frozen one, which costs about six times as much to build (``object.__setattr__`` per field: ~1.4 µs
against ~0.2 for five fields), a few µs a request on the path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.core.identity import base_name, is_logical_id
from gateway.core.model import Target, VersionState
from gateway.core.prefix import block_keys
from gateway.core.split import choose
from gateway.core.wire import cache_salt, cold_salt, tenant_salt
from gateway.fleet.replicas import ReplicaPool
from gateway.kv.prompt_tokens import Unrendered, Whole, of_route
from gateway.kv.tokenizers import Tokenizers
from gateway.request.auth import not_found
from gateway.request.intake import ParsedRequest
from gateway.table.callers import Caller, may_use, may_use_base
from gateway.table.snapshot import Snapshot
from gateway.telemetry.metrics import UNKNOWN, Metrics


@dataclass(slots=True)
class Named:
    """What a request names (resolve): ``state`` is the logical ID's entry, None for a base model."""

    model: str  # the logical ID or base model name ('unknown' for a stored response's follow-up)
    base: str  # the base identity a base request needs
    state: VersionState | None = None
    salt: str | None = None  # a base request's cache namespace: its caller's tenant's (None: the default)


@dataclass(slots=True)
class Chosen:
    """Which version answers (split): None for a base model; ``role`` and ``rollout`` while one runs."""

    version: VersionState | None
    role: str = ""
    rollout: str = ""


@dataclass(frozen=True, slots=True)
class Keying:
    """How prompts are keyed (tokenize): as far as ``prefix_chars``; ``tokens`` when kvgate tokenizes
    (KV events followed, more than one replica to choose from: each base's tokenizer, where found), else
    None."""

    prefix_chars: int
    tokens: Tokenizers | None


class Targeting:
    """Stages 3 to 5 over this kvgate's snapshot and replica pool; ``keying`` fixed at start."""

    def __init__(
        self,
        snapshot: Snapshot,
        pool: ReplicaPool,
        keying: Keying,
        metrics: Metrics,
        *,
        base_model: str,
        base_identity: str,
    ) -> None:
        self.snapshot = snapshot
        self.pool = pool
        self.keying = keying
        self.metrics = metrics
        self.base_model = base_model
        self.base_identity = base_identity

    def resolve(self, parsed: ParsedRequest, caller: Caller | None) -> Named:
        """A base model is any base a healthy replica serves (by its listing), or the configured one; no
        model (where the route allows none) is the configured base; a follow-up of a stored response goes
        to its replica's base (``intake`` pinned it and checked the caller owns it)."""
        if parsed.route.kind == "response":
            pin = parsed.admin.pin
            base = pin.base if pin is not None and pin.base else self.base_identity
            return Named(UNKNOWN, base)
        model = parsed.model or self.base_model
        served_bases = self.pool.base_identities()
        if model == self.base_model or model in served_bases:
            if not may_use_base(caller):
                raise not_found(model)
            base = self.base_identity if model == self.base_model else served_bases[model]
            return Named(model, base, salt=tenant_salt(base, caller.tenant) if caller is not None else None)
        state = self.snapshot.get(model) if is_logical_id(model) else None
        if state is None or not may_use(caller, model):  # a name that cannot be a logical ID, or one
            raise not_found(model)  # the caller may not use, is never served
        return Named(model, state.base, state)

    def split(self, named: Named, parsed: ParsedRequest, caller: Caller | None) -> Chosen:
        """The current version, or while a rollout runs the candidate by the request's split key (the
        rollout's: its ``user``, the caller's key id or its conversation; read from the body only then)."""
        state = named.state
        if state is None:
            return Chosen(None)
        if state.candidate is None:
            return Chosen(state)
        key_id = caller.key_id if caller is not None else None
        split = choose(state, parsed.body, key_id)
        return Chosen(split.version, split.role, split.rollout)

    def tokenize(self, named: Named, chosen: Chosen, parsed: ParsedRequest) -> Target:
        """The target: its cache namespace (the version's epoch namespace, a fresh one for a cold audit,
        the tenant's for a base request), its prefix keys and, with KV events, its tokens."""
        version = chosen.version
        if version is None:
            tokens = self.tokens(parsed, named.base)
            return Target(
                named.model, named.base, None, named.salt, [], tokens=tokens, whole=isinstance(tokens, Whole)
            )
        expected = self.pool.expected_print(version)  # a replica of another base never serves it
        if parsed.admin.cold:
            salt = cold_salt()
            return Target(
                named.model, version.base, version, salt, [], expected, (), chosen.role, chosen.rollout
            )
        salt = cache_salt(self.snapshot.generation, version)
        keys = block_keys(salt, parsed.prompt_keys(self.keying.prefix_chars))
        tokens = self.tokens(parsed, version.base)
        return Target(
            named.model, version.base, version, salt, keys, expected, tokens, chosen.role, chosen.rollout,
            whole=isinstance(tokens, Whole),
        )  # fmt: skip

    def tokens(self, parsed: ParsedRequest, base: str) -> Sequence[int]:
        """The prompt's tokens as a replica of ``base`` will see them, when kvgate tokenizes (``Keying``)
        and has that base's tokenizer; () otherwise, or when the request is not one it can reproduce
        exactly (``Unrendered``: counted by its reason, and the request is routed on the predicted index)."""
        tokenizer = self.keying.tokens.for_base(base) if self.keying.tokens is not None else None
        if tokenizer is None:
            return ()
        # a large body's, computed where it was parsed, by base_model's tokenizer (``Proxy``)
        tokens = parsed.tokens if base_name(base) == base_name(self.base_model) else None
        if tokens is None:
            tokens = of_route(tokenizer, parsed.route.path, parsed.body)
        if tokens is None:
            return ()
        if isinstance(tokens, Unrendered):
            self.metrics.child(self.metrics.prompt_unrendered, tokens.reason).inc()
            return ()
        return tokens
