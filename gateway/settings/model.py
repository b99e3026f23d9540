"""Settings: command-line options over ``KVGATE_*`` environment variables over a TOML config file.

The config file is named by ``--config`` or ``KVGATE_CONFIG``; its keys are the field names below
(``replicas = ["http://10.0.0.5:8000"]``). ``KVGATE_REPLICAS`` takes a comma-separated list. A named file
that is missing, not a regular file, unreadable, not UTF-8 or not TOML is an error, never the defaults
(a kvgate meant to run with ``auth = "api-keys"`` must not start open).

Each field's docstring is its description, and the model is the one list of settings: each field is a
flag ``--field-name`` (``replicas`` keeps ``--replica URL``, repeated), typed by its annotation, and a
``KVGATE_FIELD_NAME`` variable. ``serve`` takes every setting; the other commands take the ones they use
(``flags.setting_names``). docs/configuration.md is generated from it too, by
``gateway/settings/reference.py``; after changing a setting::

    python -m gateway.settings.reference --write docs/configuration.md   # --check: exit 1 if it drifted
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from gateway.adapters.store import DEFAULT_MAX_BYTES
from gateway.core.identity import base_identity
from gateway.settings.config_file import read_config_file
from gateway.telemetry.top_ids import DEFAULT_RERANK_INTERVAL, DEFAULT_TOP_K


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", extra="forbid", frozen=True, use_attribute_docstrings=True
    )

    host: str = "127.0.0.1"
    """Address the gateway listens on.

    Default: loopback: a kvgate started by hand is reachable only from its own machine until it is asked to
    listen wider (the container image and deploy/ set ``0.0.0.0``)."""
    port: int = Field(8080, ge=0, le=65535)
    """Port the gateway listens on (0: any free port).

    Default: 8080, the usual unprivileged HTTP port, apart from vLLM's 8000 so both run on one host."""
    workers: int | None = Field(None, ge=1, le=256)
    """Processes serving the port (docs/workers.md); default: one per core this process may run on; 1: one.

    Default: one per core: each worker is a full fleet member (74 MB, about 8 Redis commands a second idle)
    and the proxy is CPU-bound, so a core left without one is throughput left unused; with KV events followed
    (the default) every worker routes on the same exact view, so workers no longer split cache affinity
    (docs/workers.md)."""
    replicas: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Base URLs of the replicas kvgate fronts (flag: repeat it; environment: comma-separated).

    Default: none: kvgate cannot guess where its replicas are, and ``kvgate serve`` refuses to start without
    one."""
    store: str = ".kvgate/store"
    """Content-addressed adapter store: a directory every replica sees at the same path, or an object
    store ``s3://BUCKET/PREFIX`` (endpoint, region, credentials from the ``AWS_*`` environment) that each
    replica's ``kvgate agent`` fetches from (``replica_agents``).

    Default: a directory under the working directory, so a first run needs no setup; a fleet sets a shared
    volume or an object store."""
    replica_agents: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``REPLICA_URL=AGENT_URL[|ROOT]``: the ``kvgate agent`` beside a replica, asked for a version's bytes
    before each load there, and where that replica sees the agent's directory (default ``agent_root``);
    ``*=:PORT``: every replica's agent on its own host at PORT (a container in each vLLM pod) (flag:
    repeat it; environment: comma-separated). Needed with an object store.

    Default: none: with a shared-volume store (the default) replicas read the store directly and no agent is
    needed."""
    agent_root: str = "/adapters"
    """Where every replica sees its agent's local directory (``agent_dir`` mounted in the vLLM container).

    Default: ``/adapters``, where deploy/ mounts the agent's directory in the vLLM container."""
    agent_token: SecretStr | None = None
    """Token kvgate sends every agent and each agent requires (bearer). Prefer the env var.

    Default: unset: the agent is then reachable only as its network allows; deploy/'s object-store shape sets
    one from a Secret."""
    agent_dir: Path = Path(".kvgate/agent")
    """``kvgate agent``: the local directory verified versions are kept in (``<agent_dir>/<digest>/``).

    Default: a directory under the working directory, beside the default data directory, so a first run needs
    no setup."""
    agent_host: str = "127.0.0.1"
    """``kvgate agent``: the address it listens on.

    Default: loopback: an agent started by hand is not open to the network until asked (deploy/ sets
    ``0.0.0.0``)."""
    agent_port: int = Field(8100, ge=0, le=65535)
    """``kvgate agent``: the port it listens on.

    Default: 8100, apart from kvgate's 8080/9090 and vLLM's 8000 on the same host or pod."""
    agent_replica: str = "http://127.0.0.1:8000"
    """``kvgate agent``: its replica's URL, asked what it has loaded before anything is evicted.

    Default: vLLM's default port on the same host: the agent runs beside its replica (a container in the vLLM
    pod)."""
    agent_disk_bytes: int = Field(20 << 30, ge=1)
    """``kvgate agent``: bytes of versions it keeps; past it the least recently asked, unloaded go first.

    Default: 20 GiB: hundreds of LoRA adapters of tens of MB, well inside a typical node's ephemeral disk."""
    data_dir: Path = Path(".kvgate")
    """Holds the embedded Redis (its data and socket) and the snapshot file (snapshot_file_interval).

    Default: ``.kvgate`` in the working directory, so ``kvgate serve`` and the other commands run there find
    the same embedded Redis with no setting."""
    redis_url: str | None = None
    """Use this Redis instead of the embedded one: ``redis://``, ``rediss://``, ``unix://``,
    ``redis+sentinel://HOST:PORT,.../MASTER[/DB]`` or ``redis+cluster://HOST:PORT,...`` (docs/redis.md).

    Default: unset: kvgate runs and supervises an embedded Redis in the data directory, so one machine needs
    nothing else; a fleet of kvgates shares one Redis by naming it here."""
    redis_ack_timeout: float = Field(1.0, ge=0)
    """Seconds publish, rollback and bump wait for one Redis replica to acknowledge their write (``WAIT``),
    when the master has replicas; 0: do not wait; at most half of redis_timeout.

    Default: 1 s: long enough for a replica on the same network to acknowledge, short enough that a change
    never waits long on a lagging replica (it is not refused, only not confirmed)."""
    redis_timeout: float = Field(5.0, gt=0)
    """Seconds Redis may take to answer (a stalled one is then an error, never replaced by a second one).

    Default: 5 s: far above a healthy Redis's milliseconds, short enough that a stalled one is noticed before
    clients give up."""

    backend: Literal["vllm", "sglang", "generic"] = "vllm"
    """The replicas' server kind (its dialect). ``vllm``, ``sglang``: kvgate loads and unloads adapters
    at runtime, gives each version and epoch a cache namespace (``cache_salt``, ``extra_key``) and can
    purge (``purge-all``). ``generic``: any other OpenAI-compatible server, adapters fixed at start: a
    version is served only by replicas started with its versioned name (a new version needs a restart),
    requests carry no cache namespace (versions stay apart by name alone; an epoch bump cannot
    invalidate a cache), ``purge-all`` is refused; kvgate warns of this at start.

    Default: vLLM: the server kvgate was built against and proven on (tests/vllm)."""
    invalidation: Literal["version-scoped", "purge-all"] = "version-scoped"
    """version-scoped: versioned names + per-epoch cache salts; purge-all: reset every replica's cache.

    Default: version-scoped: versioned names and salts keep versions apart without emptying anyone's cache;
    purge-all costs every tenant its cache on each change."""
    base_model: str = "base"
    """The served model name of the pool's base model: what clients send for base requests.

    Default: ``base``, the served model name the examples, tests and deploy/ give vLLM (``--served-model-name
    base``)."""
    base_model_root: str | None = None
    """If set, a replica's base must also report this ``root`` in /v1/models to be eligible.

    Default: unset: the served name identifies the base; the fingerprint (bytes or behaviour) already tells
    two bases with one name apart."""
    base_model_dirs: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``NAME=PATH``: where kvgate reads base model NAME's files to fingerprint its bytes (flag: repeat
    it; environment: comma-separated); without one, the root a replica lists is read when it is a
    directory here.

    Default: none: kvgate reads the root its replicas list when it can (the same volume at the same path),
    which needs no setting."""
    base_print_tolerance: float = Field(0.05, ge=0)
    """Least tolerance for the mean |dlogprob| over the base-fingerprint probe's top logprobs, where the
    behaviour decides (the bytes decide where both fingerprints have them).

    Default: 0.05: above the run-to-run noise of bf16 logprobs on one replica (0.0 on the CPU build, a few
    hundredths on GPUs), far below what another checkpoint changes."""

    reconcile_interval: float = Field(1.0, gt=0)
    """Seconds between heartbeats: the epoch table's checksum compared, one scrub step (changes arrive
    sooner, from the change log).

    Default: 1 s: a change that bypassed the change log is found within a second or two, at one small Redis
    call a second per kvgate."""
    change_log_length: int = Field(10_000, ge=100)
    """Change-log entries Redis keeps (XADD MAXLEN ~); a kvgate further behind reads the table in full.

    Default: 10,000 entries: minutes to hours of changes at any realistic publish rate, so a kvgate restarted
    or cut off briefly catches up from the log instead of re-reading the table."""
    scrub_page: int = Field(1_000, ge=1)
    """Logical IDs the shared scrub re-reads per heartbeat: a write that bypasses kvgate's scripts is in
    every snapshot within ceil(B / scrub_page) + 1 heartbeats (B: the next power of two >= IDs).

    Default: 1,000 IDs: one heartbeat's scrub is one small read, and a table of 100,000 IDs is scrubbed within
    about 2 minutes."""
    table_max_staleness: float | None = Field(None, gt=0)
    """Readiness: /healthz answers 503 while this kvgate's snapshot of the epoch table has not been
    confirmed current for longer than this many seconds (Redis unreachable, or the sync failing). Unset
    (the default): a stale snapshot alone never makes kvgate unready; it serves the previous version
    coherently, and every kvgate of a fleet going unready together in a Redis outage would be an
    outage. The table's age is on /healthz either way (``table.age_s``).

    Default: unset: a stale snapshot still serves coherently (versioned names), and a whole fleet going
    unready in a Redis outage would turn it into an outage."""
    snapshot_file_interval: float = Field(10.0, ge=0)
    """Seconds between writes of the snapshot file (data_dir/snapshot.msgpack, when it moved): a start
    loads it and catches up from the change log instead of reading the whole table; 0: no file.

    Default: 10 s: a restart reads at most 10 s of the change log, for a file write (only when the table
    moved) every 10 s."""
    poll_interval: float = Field(1.0, gt=0)
    """Seconds between polls of every replica's /v1/models (and sweeps of retired adapters).

    Default: 1 s: a replica that dies or restarts is seen within a second, for one ``/v1/models`` call a
    second per replica."""
    background_failure_limit: float = Field(5.0, gt=0)
    """Readiness: a background task that keeps failing (each restart, after a backoff, fails again) for
    longer than this many of its periods makes /healthz answer 503 naming it and its last error, until
    it works again (a loop: one of its steps ends; a subscriber: it runs a whole period; a task of several
    loops: each loop that failed has stepped again). Periods:
    poll_interval (replica poll, adapter sweep), reconcile_interval (snapshot sync, API key sync,
    purger), lease_ttl / 4 (leases heartbeat), canary_interval (canary), rollout_gate_interval / 4 but
    at most 1 s (rollout gate), 2 s (the embedded Redis's supervision: failing that long, restarts of
    redis-server that keep failing end ``kvgate serve`` with exit 1).

    Default: 5 periods: a task that fails once or twice (a blip) is not reported unready; one failing for 5 of
    its periods is."""
    drain_grace: float = Field(30.0, ge=0)
    """Seconds in-flight requests on a retired version get before it is unloaded (or caches purged).

    Default: 30 s: most completions finish within it; longer ones get up to max_drain."""
    max_drain: float = Field(600.0, gt=0)
    """Seconds after which a retired version is unloaded even while kvgates still lease it (counted).

    Default: 10 minutes: the longest streams (long generations) finish, and a retired version still gives back
    its slot in bounded time."""
    shutdown_timeout: float = Field(30.0, ge=0)
    """Seconds requests still running on SIGTERM get to finish (new ones are refused, /healthz is 503).

    Default: 30 s: most requests finish, and Kubernetes' default grace period (30 s, 45 s in deploy/) is not
    exceeded."""
    lease_ttl: float = Field(10.0, gt=0)
    """Seconds a kvgate's leases outlive its last heartbeat (heartbeat every quarter of it).

    Default: 10 s: a dead kvgate's leases expire in seconds, and the heartbeat (every 2.5 s) can miss three
    beats before a live one loses them."""
    gateway_id: str | None = None
    """This kvgate's id in the fleet (heartbeat and leases in Redis); default: a random one per start.

    Default: a random one per start: ids never collide between kvgates; deploy/ sets the pod's name for
    readability."""
    max_adapters_per_replica: int = Field(8, ge=1)
    """Adapters kvgate keeps loaded per replica; the least recently used idle one is evicted first.

    Default: 8: vLLM's own default ``--max-loras`` is 1 and deploy/ sets 8; kvgate must not keep more loaded
    than the replica can hold on the GPU."""
    slot_wait_timeout: float = Field(30.0, gt=0)
    """Seconds a load waits for an adapter slot while every adapter on the replica is in use (an adapter
    in use is never evicted); then 503 adapter_budget_full.

    Default: 30 s: a load waits out a burst that holds every adapter, and gives up (503) before most clients
    would."""
    max_body_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body accepted; a larger one is refused with 413.

    Default: 4 MiB: above the largest real prompts (a 128k-token context is about 0.5 MB of text) and bounds
    the memory one request can take."""
    connect_timeout: float = Field(5.0, gt=0)
    """Seconds to connect to a replica (in ``kvgate audit``: to each audited server).

    Default: 5 s: a replica on the same network connects in milliseconds; one that does not in 5 s is down,
    and the request is retried elsewhere."""
    read_timeout: float = Field(600.0, gt=0)
    """Seconds to wait for each read from a replica (in ``kvgate audit``: from each audited server).

    Default: 10 minutes between bytes: a long prefill of a large prompt sends nothing until its first
    token."""
    max_connections_per_replica: int = Field(2048, ge=0)
    """Requests kvgate runs at once on one replica (a stream holds its connection to the end); 0: no limit.

    Default: 2,048: above what one vLLM replica batches, so kvgate does not throttle a healthy replica, while
    a runaway client cannot open unbounded connections."""
    pool_wait_timeout: float = Field(10.0, gt=0)
    """Seconds a request waits for a free connection to its replica (at that limit); then 503 replica_busy.

    Default: 10 s: a burst at the limit waits briefly, and a replica that stays full answers 503 before most
    clients time out."""
    header_timeout: float = Field(10.0, gt=0)
    """Seconds a client has to send a request's line and headers (counted from connecting, or from the
    request's first byte on a kept-alive connection); then 408 and the connection is closed.

    Default: 10 s: any real client sends its headers in milliseconds; a slow-loris connection is closed."""
    body_timeout: float = Field(60.0, gt=0)
    """Seconds a client has to send a request's whole body once its headers are in; then 408 and closed.

    Default: 60 s: a 4 MB body over a slow link arrives in time; a client that stalls mid-body is closed."""
    keepalive_timeout: float = Field(60.0, gt=0)
    """Seconds an idle kept-alive client connection stays open between requests.

    Default: 60 s: above the usual client pools' idle time (so connections are reused), below the time idle
    sockets pile up."""
    max_connections_per_client: int = Field(1024, ge=0)
    """Open connections one client address may hold; more are answered 429 and closed (0: no limit).
    Behind a proxy, every client has the proxy's address: raise it, or 0.

    Default: 1,024: far above one client's needs, low enough that one address cannot take every connection."""
    load_timeout: float = Field(120.0, gt=0)
    """Seconds an adapter load may take (also the wait for another kvgate's load of it).

    Default: 2 minutes: a LoRA load takes seconds even from a cold disk; one that takes minutes is stuck."""
    lock_ttl: float = Field(150.0, gt=0)
    """Seconds a load lock lives in Redis; must exceed load_timeout, or a second kvgate could load too.

    Default: 150 s: above load_timeout (the rule below) with a margin for clock and network delays."""
    prefix_index_entries: int = Field(100_000, ge=0)
    """Prefix block keys remembered (LRU) for routing warm requests to the replica that holds them.

    Default: 100,000 block keys: a few MB of memory, enough for the recent prompts of a busy fleet."""
    kv_events: bool = True
    """Follow the KV cache events of every replica that publishes them (vLLM ``--kv-events-config``:
    every data-parallel rank's publisher, from its /kv_event_sources) and route each request to the
    replica whose reported blocks hold the longest prefix of its tokens (precise routing), for every base
    whose tokenizer kvgate has (``tokenizer``). A replica that publishes none, or whose base has no
    tokenizer, is routed on the predicted index, and /healthz and ``kvgate_routing_trust`` say so.
    false: never follow, every replica on the predicted index.

    Default: on: routing on what replicas report holding is exact and the same in every process; a kvgate with
    several workers or beside other kvgates on the predicted index splits cache affinity between them (issue
    28: 0 of 4 warm prompts found through a second kvgate, 4 of 4 with events). A replica that publishes none
    costs a failed discovery now and then, and is routed on the predicted index."""
    kv_event_endpoints: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """``REPLICA_URL=tcp://HOST:PORT[|REPLAY_ENDPOINT]``: a replica's KV event publisher (and replay
    socket), instead of what it reports at /kv_event_sources; a replica named again is its next
    data-parallel rank (flag: repeat it; environment: comma-separated).

    Default: none: kvgate finds each replica's publishers at its ``/kv_event_sources``, which needs no
    setting."""
    precise_index_entries: int = Field(1_000_000, ge=0)
    """Token blocks the precise prefix index (KV events) holds over all replicas; past it, the largest
    replica view loses its oldest blocks.

    Default: 1,000,000 token blocks: about 180 MB (182 bytes a block, measured in docs/prefix_routing.md), the
    caches of a few dozen GPUs at 16-token blocks."""
    tokenizer: Path | None = None
    """``base_model``'s ``tokenizer.json`` or model directory (with its chat template), read at start:
    one that cannot be read stops kvgate. Unset, kvgate finds each base's tokenizer itself: in its
    ``base_model_dirs`` directory, else in the root its replicas list (vLLM's ``--model`` path) when that
    is a directory here; a base whose tokenizer it cannot read is routed on the predicted index.

    Default: unset: kvgate finds each base's tokenizer itself (base_model_dirs, else the root replicas list),
    and one setting could only name one base's."""
    token_check_window: int = Field(50, ge=1, le=100_000)
    """Answers per replica the live token-count check judges: its last N to prompts kvgate tokenized
    whole, each answer's ``usage.prompt_tokens`` against kvgate's count (docs/architecture.md).

    Default: 50: a replica served with another tokenizer (which disagrees on nearly every prompt) is
    caught within 10 answers (the fewest judged), and one prompt kvgate renders otherwise weighs 2% of
    the rate."""
    token_check_max_mismatch: float = Field(0.2, ge=0, le=1)
    """A replica whose share of disagreeing answers in the window passes this is routed on the predicted
    index (its KV events ignored, the reason on /healthz) until the share falls to half of it; 1 turns
    the fallback off (checks are still counted).

    Default: 0.2: another tokenizer disagrees on nearly every prompt, while a few requests kvgate renders
    otherwise should not cost a replica its precise routing."""
    canary_interval: float = Field(0.0, ge=0)
    """Seconds between coherence canary rounds over active logical IDs; 0 turns the canary off.

    Default: off: a round costs cold and warm completions on each active ID's replicas; audits on demand
    (``kvgate audit``) and the rollout gate cover versions as they change."""
    rollout_gate_interval: float = Field(10.0, ge=0)
    """Seconds between the rollout gate's audit rounds of a running rollout, fleet-wide: one kvgate
    process holds its gate (a lease in Redis of three intervals) and audits the candidate on its
    replicas once an interval; every worker adds its requests and errors to the rollout's counts in
    Redis a quarter interval (at most 1 s) apart, which the holder compares; a fault aborts the
    rollout. 0 turns the gate off (in this kvgate: it neither counts nor audits).

    Default: 10 s: a faulty candidate is caught within seconds of traffic, for one audit round on its replicas
    each interval."""
    rollout_error_margin: float = Field(0.05, ge=0, le=1)
    """The gate aborts a rollout whose candidate's error rate exceeds the current version's by more.

    Default: 5 points: above the noise of error rates on small samples, low enough that a broken candidate
    (most of its requests failing) is aborted at once."""
    rollout_min_requests: int = Field(50, ge=1)
    """Candidate requests, across every kvgate, before the gate judges its error rate (a candidate
    whose every request failed is aborted after 3).

    Default: 50 requests: the error rate of a smaller sample says little; 50 arrive within seconds on a real
    rollout."""
    rollout_audit_tolerance: float = Field(0.01, ge=0)
    """The gate's audit counts a logprob difference as a fault only above this (or the cold runs'
    calibrated spread): audits run beside live traffic, whose batching may move logprobs slightly.

    Default: 0.01: live batching moves logprobs by less on the CPU build (0.0) and typical GPUs, while a stale
    cache moves them by tenths or more."""
    max_adapter_bytes: int = Field(DEFAULT_MAX_BYTES, ge=1)
    """Largest adapter ``kvgate publish`` stores (the sum of its file sizes); a larger one is refused.

    Default: 2 GiB: above a rank-64 LoRA of a 70B model in bf16 (about 1.7 GB) and below anything that is not
    an adapter."""
    admin_token: SecretStr | None = None
    """Admin token (header ``x-kvgate-admin-token``): pinning, cold namespaces, status. Prefer the env var.

    Default: unset: the admin surface (pinning, status, /metrics on the public port) is refused until an
    operator sets one; nothing is open by default."""
    auth: Literal["off", "api-keys"] = "off"
    """Callers: off (anyone may use any logical ID) or api-keys (``Authorization: Bearer``: kvgate keys).

    Default: off: a first run and a private network need no keys; a fleet shared by tenants turns api-keys on
    (docs/tenants.md)."""
    auth_max_staleness: float = Field(60.0, gt=0)
    """With api-keys: seconds kvgate trusts its copy of the keys while Redis is unreachable (then every
    keyed request gets 503, and so does /healthz: kvgate cannot serve what it accepts).

    Default: 60 s: a revoked key stops working within a minute of Redis being back, and a Redis blip does not
    turn every keyed request away."""
    admin_host: str = "127.0.0.1"
    """Address of the admin listener (see admin_port).

    Default: loopback: the admin listener, when on, is not open to the network until asked (deploy/ sets
    ``0.0.0.0`` behind its NetworkPolicy)."""
    admin_port: int | None = Field(None, ge=0, le=65535)
    """If set, /kvgate/status and /metrics are served on this port (with the API; /metrics without a
    token, for Prometheus), 404 on the public one. Unset, both stay on the public port behind the admin
    token: /metrics names logical IDs (the tenants), so it takes ``x-kvgate-admin-token`` or
    ``Authorization: Bearer <admin token>`` (a scrape config's ``authorization``), and without an
    admin token it is refused.

    Default: unset: one listener to run and probe; a fleet with API keys should set it to keep /metrics
    (tenant names) off the public port."""
    expose_replica_urls: bool = False
    """Name replicas by URL in ``x-kvgate-replica`` (default: a stable id; /kvgate/status maps id to URL).

    Default: off: replica URLs are internal addresses; answers name a stable id, which /kvgate/status maps to
    the URL for the admin."""
    metrics_top_k: int = Field(DEFAULT_TOP_K, ge=0)
    """Logical IDs with /metrics counters of their own: the top K by traffic; the rest count as ``other``.

    Default: 100 IDs: bounded series per counter for Prometheus, while the IDs that carry the traffic keep
    their own."""
    metrics_rerank_interval: float = Field(DEFAULT_RERANK_INTERVAL, gt=0)
    """Seconds between re-rankings of the top K (a demoted ID's series: frozen one interval, then dropped).

    Default: 5 minutes: the ranking follows shifts in traffic without churning series on every burst."""

    @field_validator("replicas", mode="before")
    @classmethod
    def _split_replicas(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list):
            return [str(url).strip().rstrip("/") for url in value]
        return value

    @field_validator("store", mode="before")
    @classmethod
    def _store_location(cls, value: Any) -> Any:
        return str(value) if isinstance(value, Path) else value

    @field_validator("kv_event_endpoints", "base_model_dirs", "replica_agents", mode="before")
    @classmethod
    def _split_entries(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        form = {"kv_event_endpoints": "REPLICA_URL=tcp://HOST:PORT", "base_model_dirs": "NAME=PATH",
                "replica_agents": "REPLICA_URL=AGENT_URL[|ROOT]"}[str(info.field_name)]  # fmt: skip
        for entry in value if isinstance(value, list) else []:
            key, _, rest = str(entry).partition("=")
            ok = (
                rest.startswith(("tcp://", "ipc://"))
                if info.field_name == "kv_event_endpoints"
                else bool(rest)
            )
            if not key or not ok:
                raise ValueError(f"{info.field_name} entries are {form}, not {entry!r}")
        return value

    @property
    def agent_map(self) -> dict[str, tuple[str, str]]:
        """Replica URL -> (its agent's URL, where the replica sees the agent's directory)."""
        found = {}
        for url, _, rest in (entry.partition("=") for entry in self.replica_agents):
            agent, _, root = rest.partition("|")
            for replica in self.replicas if url == "*" else [url.rstrip("/")]:
                here = f"{replica.rpartition(':')[0]}{agent}" if url == "*" else agent
                found[replica] = (here.rstrip("/"), (root or self.agent_root).rstrip("/"))
        return found

    @property
    def base_model_dir_map(self) -> dict[str, Path]:
        """Base name -> the directory its files are read from (``base_model_dirs``)."""
        return {name: Path(path) for name, _, path in (e.partition("=") for e in self.base_model_dirs)}

    @model_validator(mode="after")
    def _drain_within_bound(self) -> Self:
        """`max_drain` is at least `drain_grace`."""
        if self.max_drain < self.drain_grace:
            raise ValueError(
                f"max_drain ({self.max_drain:g} s) must be at least drain_grace ({self.drain_grace:g} s)"
            )
        return self

    @model_validator(mode="after")
    def _lock_outlives_load(self) -> Self:
        """`lock_ttl` exceeds `load_timeout` (a lock that expires mid-load lets a second kvgate load too)."""
        if self.lock_ttl <= self.load_timeout:
            raise ValueError(
                f"lock_ttl ({self.lock_ttl:g} s) must exceed load_timeout ({self.load_timeout:g} s): "
                "a load lock that expires mid-load lets a second kvgate load the same adapter"
            )
        return self

    @model_validator(mode="after")
    def _keys_outlive_a_reconcile(self) -> Self:
        """With `auth = "api-keys"`, `auth_max_staleness` exceeds `reconcile_interval`."""
        if self.auth == "api-keys" and self.auth_max_staleness <= self.reconcile_interval:
            raise ValueError(
                f"auth_max_staleness ({self.auth_max_staleness:g} s) must exceed reconcile_interval "
                f"({self.reconcile_interval:g} s): keys are re-read every reconcile_interval"
            )
        return self

    @model_validator(mode="after")
    def _admin_listener_apart(self) -> Self:
        """`admin_host`:`admin_port` differs from `host`:`port` (the admin listener is a second one)."""
        if self.admin_port and (self.admin_host, self.admin_port) == (self.host, self.port):
            raise ValueError(f"admin_port ({self.admin_port}) must differ from port: it is a second listener")
        return self

    @property
    def ack_within(self) -> float:
        """How long a change waits for a replica's ``WAIT``: within the client's wait for any answer."""
        return min(self.redis_ack_timeout, self.redis_timeout / 2)

    @property
    def base_identity(self) -> str:
        """The pool's base model identity, recorded with every published version."""
        return base_identity(self.base_model, self.base_model_root)


def load_settings(overrides: Mapping[str, Any], config_file: Path | None) -> Settings:
    """Build settings with precedence: ``overrides`` (CLI) > environment > config file > defaults.

    A named ``config_file`` that cannot be read as TOML raises ``BadRequest`` (``read_config_file``)."""
    from_file = read_config_file(config_file) if config_file is not None else None

    class _WithFile(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
            if from_file is not None:
                sources += (InitSettingsSource(settings_cls, init_kwargs=from_file),)
            return sources

    return _WithFile(**{k: v for k, v in overrides.items() if v is not None})
