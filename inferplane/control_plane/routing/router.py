"""Served model name -> deployment (A/B weight, tier) -> replica (prefix affinity under bounded load;
a LoRA adapter's requests: affinity to the adapter, so it stays loaded where its traffic goes).

Replica choice, by the deployment's routing policy (spec.routing.policy):
  - prefix-hash: no per-prefix state: a replica is a pure function of the prompt's prefix key, the
    member set and current loads (a hash ring under bounded load). Several gateway replicas agree on
    where a prefix lives without talking to each other, and a restarted gateway loses nothing.
  - kv-aware: the replica holding the longest run of the prompt's leading blocks, weighted by where
    it holds them (the KV index, fed by the workers' own events), among the replicas under the
    bounded-load cap; a prompt none holds goes as prefix-hash sends it, so affinity still forms.
    The pick is noted in the index (provisional), so a burst sharing a new prefix stays together.
  - least-loaded: the fewest requests in flight from this gateway.

Deployment choice, in order (one step wins):
  1. on a retry, the deployment of the failed attempt, if it still has an unsaturated replica
     (keeps an A/B assignment through retries);
  2. a weighted choice among primaries that are not saturated (weights renormalised over them);
  3. a weighted choice among spillover deployments that are not saturated;
  4. saturated primaries, then saturated spillover (the workers queue: better than refusing).
A deployment is saturated when each of its healthy, untried replicas is at ``max_outstanding`` in
flight (or reports ``max_waiting`` queued). The A/B split is therefore exact while no arm is saturated;
a saturated arm's excess goes to the other primaries before spillover is touched.
"""

from __future__ import annotations

import hashlib
import random
import typing
import weakref
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from inferplane.api.deployment import RoutingPolicy
from inferplane.control_plane.routing.endpoints import Endpoint, EndpointSource
from inferplane.control_plane.routing.errors import NoReplicaAvailable, UnknownModel
from inferplane.control_plane.routing.health import HealthTracker
from inferplane.control_plane.routing.kv_index import KVIndex
from inferplane.control_plane.routing.load import LoadTracker
from inferplane.control_plane.routing.prefix import block_hashes, prefix_key
from inferplane.control_plane.routing.ring import HashRing, bounded_pick, load_bound

ROUTING_POLICIES: tuple[str, ...] = typing.get_args(RoutingPolicy)

# kv-aware: the share of a prompt's blocks a replica's held run (weighted by medium) must cover for
# the request to follow it (SGLang's cache-aware router uses the same rule, at 0.5); below it the
# run is a start many prompts share, and the ring spreads them by what follows it.
KV_MATCH_SHARE = 0.5


class Tier(StrEnum):
    PRIMARY = "primary"
    SPILLOVER = "spillover"


@dataclass(eq=False)
class Deployment:
    """One deployment behind a served model name (an ``InferenceDeployment`` or a local group)."""

    name: str
    source: EndpointSource
    weight: float = 1.0
    tier: Tier = Tier.PRIMARY
    block_size: int = 16            # the workers' KV block size (``InfoResponse.block_size``)
    affinity_blocks: int = 2        # how many leading full blocks make the prefix key
    max_outstanding: int = 64       # in flight per replica (from this gateway) that counts as saturated
    max_waiting: int | None = None  # worker-reported queue length that counts as saturated
    load_epsilon: float = 0.25      # bounded-load slack: a replica may hold (1 + eps) x the average
    vnodes: int = 160
    # Replicas its owner asks for (InferenceDeployment spec.replicas, which the autoscaler also
    # sets); None: the listed endpoints are all there is to want (a local group).
    desired_replicas: int | None = None
    routing_policy: str = "prefix-hash"  # spec.routing.policy, resolved (api/resolve.routing_policy)
    # Prefill/decode disaggregation (spec.disaggregation): the pool that computes long prompts, whose
    # KV this deployment's (decode) replicas pull; a request goes there when at least
    # `min_prefill_tokens` of its prompt are not held by the decode replica picked.
    prefill: Deployment | None = None
    min_prefill_tokens: int = 512

    def __post_init__(self) -> None:
        self.tier = Tier(self.tier)
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"deployment {self.name}: routing policy must be one of {', '.join(ROUTING_POLICIES)}")
        if self.weight < 0:
            raise ValueError(f"deployment {self.name}: weight must be >= 0")
        if self.max_outstanding < 1 or self.block_size < 1 or self.affinity_blocks < 1:
            raise ValueError(f"deployment {self.name}: max_outstanding, block_size and "
                             "affinity_blocks must be >= 1")


@dataclass(frozen=True)
class RouteRequest:
    model: str
    token_ids: Sequence[int] | None = None  # tokenized prompt; None routes by load alone
    cache_salt: str = ""                    # the tenant's salt (see ``salt.tenant_cache_salt``)
    ab_key: str | None = None               # e.g. a user id: pins the A/B arm; None draws at random
    adapter: str = ""                       # a LoRA adapter's key (api/kv_blocks.adapter_cache_key)


@dataclass(eq=False)
class Lease:
    """A picked replica with one outstanding request counted on it until ``release``."""

    endpoint: Endpoint
    deployment: Deployment
    _load: LoadTracker = field(repr=False)
    _health: HealthTracker = field(repr=False)
    released: bool = False

    @property
    def address(self) -> str:
        return self.endpoint.address

    def release(self, success: bool | None = None) -> None:
        """End the request: ``True`` worker served it, ``False`` worker failed (counts toward
        ejection), ``None`` no verdict (client went away, request was invalid). Idempotent."""
        if self.released:
            return
        self.released = True
        self._load.release(self.address)
        if success is True:
            self._health.record_success(self.address)
        elif success is False:
            self._health.record_failure(self.address)


@dataclass
class _Candidates:
    deployment: Deployment
    endpoints: dict[str, Endpoint]
    all_addresses: frozenset[str]


class Router:
    def __init__(self, routes: Mapping[str, Iterable[Deployment]] | None = None, *,
                 health: HealthTracker | None = None, load: LoadTracker | None = None,
                 rng: random.Random | None = None, kv_index: KVIndex | None = None) -> None:
        self.health = health or HealthTracker()
        self.load = load or LoadTracker()
        self.kv_index = kv_index or KVIndex()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (policy, outcome): the gateway's metrics
        self._rng = rng or random.Random()
        self._routes: dict[str, tuple[Deployment, ...]] = {}
        self._rings: weakref.WeakKeyDictionary[Deployment, HashRing] = weakref.WeakKeyDictionary()
        for model, deployments in (routes or {}).items():
            self.set_route(model, deployments)

    # -- configuration ---------------------------------------------------------------------------
    def set_route(self, model: str, deployments: Iterable[Deployment]) -> None:
        """Replace a served model's deployments (the registry refresh calls this)."""
        deps = tuple(deployments)
        names = [d.name for d in deps]
        if len(set(names)) != len(names):
            raise ValueError(f"model {model}: duplicate deployment names {names}")
        self._routes[model] = deps

    def remove_route(self, model: str) -> None:
        self._routes.pop(model, None)

    def models(self) -> list[str]:
        return sorted(self._routes)

    def deployments(self, model: str) -> tuple[Deployment, ...]:
        try:
            return self._routes[model]
        except KeyError:
            raise UnknownModel(model) from None

    def addresses(self) -> set[str]:
        """Every listed replica of every route, prefill pools' too: what the health poller should check."""
        return {ep.address for deps in self._routes.values() for d in deps for pool in _pools(d)
                for ep in pool.source.endpoints()}

    def kv_aware_addresses(self) -> set[str]:
        """The replicas whose deployment routes kv-aware: whose KV events the gateway follows."""
        return {ep.address for deps in self._routes.values() for d in deps if d.routing_policy == "kv-aware"
                for ep in d.source.endpoints()}

    def replica_counts(self) -> list[tuple[str, str, int, int]]:
        """(model, deployment, ready, desired) per deployment: what the gateway's metrics report."""
        counts = []
        for model, deployments in sorted(self._routes.items()):
            for d in (pool for owner in deployments for pool in _pools(owner)):
                listed = d.source.endpoints()
                ready = sum(1 for ep in listed if self.health.is_healthy(ep.address))
                desired = d.desired_replicas if d.desired_replicas is not None else len(listed)
                counts.append((model, d.name, ready, desired))
        return counts

    def has_replicas(self, model: str) -> bool:
        """Whether a request for `model` could be picked now (any healthy replica in any tier)."""
        return any(self._candidates(d, ()).endpoints for d in self._routes.get(model, ()))

    # -- picking ---------------------------------------------------------------------------------
    def pick(self, request: RouteRequest, *, exclude: Collection[str] = (),
             prefer: str | None = None) -> Lease:
        """Choose a replica and count a request on it. Raises ``UnknownModel`` or
        ``NoReplicaAvailable``; the caller must ``release`` the lease when the stream ends."""
        deployments = self.deployments(request.model)
        cands = [self._candidates(d, exclude) for d in deployments]
        usable = [c for c in cands if c.endpoints]
        if not usable:
            raise NoReplicaAvailable(request.model, tuple(exclude))
        chosen = self._choose_deployment(request, usable, prefer)
        address = self._choose_replica(request, chosen)
        self.load.acquire(address)
        return Lease(chosen.endpoints[address], chosen.deployment, self.load, self.health)

    def pick_prefill(self, d: Deployment, request: RouteRequest, *, exclude: Collection[str] = ()) -> Lease:
        """A replica of `d`'s prefill pool for `request` (by the pool's own policy: prefix-hash keeps a
        shared prefix on one prefill replica's cache), counted on it until released. Raises
        ``NoReplicaAvailable`` where the pool has none healthy, or each is at its limit (the caller
        computes the prompt on the decode replica instead of queueing it)."""
        if d.prefill is None:
            raise ValueError(f"deployment {d.name} has no prefill pool")
        candidates = self._candidates(d.prefill, exclude)
        if not candidates.endpoints or self._saturated(candidates):  # full: better computed on the decode replica
            raise NoReplicaAvailable(request.model, tuple(exclude))
        address = self._choose_replica(request, candidates)
        self.load.acquire(address)
        return Lease(candidates.endpoints[address], d.prefill, self.load, self.health)

    def uncached_tokens(self, d: Deployment, address: str, request: RouteRequest) -> int:
        """Tokens of the request's prompt that replica `address` of `d` would compute: all but the run
        of leading blocks its own KV events say it holds (known only where `d` routes kv-aware, whose
        events this gateway follows; elsewhere the whole prompt)."""
        tokens = request.token_ids or ()
        if d.routing_policy != "kv-aware" or len(tokens) <= d.block_size:
            return len(tokens)
        hashes = block_hashes(tokens[:len(tokens) - 1], d.block_size, request.cache_salt, adapter_key=request.adapter)
        return len(tokens) - self.kv_index.confirmed_run(hashes, address) * d.block_size

    def _candidates(self, d: Deployment, exclude: Collection[str]) -> _Candidates:
        listed = d.source.endpoints()
        eligible = {ep.address: ep for ep in listed
                    if ep.address not in exclude and self.health.is_healthy(ep.address)}
        return _Candidates(d, eligible, frozenset(ep.address for ep in listed))

    def _replica_saturated(self, d: Deployment, address: str) -> bool:
        if self.load.outstanding(address) >= d.max_outstanding:
            return True
        waiting = self.load.waiting(address) if d.max_waiting is not None else None
        return waiting is not None and waiting >= d.max_waiting  # type: ignore[operator]

    def _saturated(self, c: _Candidates) -> bool:
        return all(self._replica_saturated(c.deployment, a) for a in c.endpoints)

    def _choose_deployment(self, request: RouteRequest, usable: list[_Candidates],
                           prefer: str | None) -> _Candidates:
        open_ = [c for c in usable if not self._saturated(c)]
        if prefer is not None:
            for c in open_:
                if c.deployment.name == prefer:
                    return c
        for group in (open_, usable):
            for tier in (Tier.PRIMARY, Tier.SPILLOVER):
                tiered = [c for c in group if c.deployment.tier is tier]
                if tiered:
                    return self._weighted(request, tiered)
        raise AssertionError("unreachable: usable is non-empty")

    def _weighted(self, request: RouteRequest, options: list[_Candidates]) -> _Candidates:
        if len(options) == 1:
            return options[0]
        weights = [c.deployment.weight for c in options]
        total = sum(weights)
        if total <= 0:  # only zero-weight (drained) arms are left: spread evenly rather than refuse
            weights, total = [1.0] * len(options), float(len(options))
        u = _unit(request.ab_key) if request.ab_key is not None else self._rng.random()
        acc = 0.0
        for c, w in zip(options, weights, strict=True):
            acc += w / total
            if u < acc:
                return c
        return options[-1]

    def _ring(self, c: _Candidates) -> HashRing:
        ring = self._rings.get(c.deployment)
        if ring is None or ring.members != c.all_addresses:
            ring = self._rings[c.deployment] = HashRing(c.all_addresses, c.deployment.vnodes)
        return ring

    def _choose_replica(self, request: RouteRequest, c: _Candidates) -> str:
        d = c.deployment
        # A saturated replica is passed over while its siblings have room, whatever the policy says.
        room = [a for a in c.endpoints if not self._replica_saturated(d, a)] or list(c.endpoints)
        loads = {a: self.load.outstanding(a) for a in room}
        if d.routing_policy == "least-loaded":
            self.decisions[(d.routing_policy, "least_loaded")] += 1
            return self._least_loaded(loads)
        hashes: list[bytes] = []
        key: int | None = None
        if d.routing_policy == "kv-aware" and request.token_ids:
            # The blocks a worker's prefix match can use: full blocks before the last token.
            hashes = block_hashes(request.token_ids[:len(request.token_ids) - 1], d.block_size,
                                  request.cache_salt, adapter_key=request.adapter)
            picked, run = self._most_held(hashes, loads, d.load_epsilon)
            if picked is not None and run >= KV_MATCH_SHARE * len(hashes):
                self.decisions[(d.routing_policy, "held")] += 1
                self.kv_index.note_routed(picked, hashes)
                return picked
            if hashes:
                # Held, but only a small share of the prompt (a system prompt every conversation
                # starts with): the ring decides by the prompt's own blocks past that run, so new
                # conversations spread over the replicas' pools instead of piling onto the one
                # replica that happens to hold the common start.
                key = int.from_bytes(hashes[min(len(hashes), int(run) + d.affinity_blocks) - 1][:8], "big")
        if key is None and request.adapter:
            # An adapter's requests go where it is loaded (one replica, its slot warm and its prefixes
            # cached); bounded load moves the excess to the next replica on the ring, which then
            # loads it too: the adapter spreads with its traffic, not with every request.
            key = adapter_key(request.adapter)
        elif key is None:
            key = prefix_key(request.token_ids, d.block_size, request.cache_salt, d.affinity_blocks)
        picked = bounded_pick(self._ring(c), key, loads, d.load_epsilon) if key is not None else None
        outcome = "ring" if picked is not None else "least_loaded"
        picked = picked if picked is not None else self._least_loaded(loads)
        self.decisions[(d.routing_policy, outcome)] += 1
        if hashes:
            self.kv_index.note_routed(picked, hashes)
        return picked

    def _most_held(self, hashes: Sequence[bytes], loads: Mapping[str, int],
                   epsilon: float) -> tuple[str | None, float]:
        """Among the replicas under the bounded-load cap, the one whose held run of `hashes` weighs
        most (the least loaded of equals, then by address: equal on every gateway replica), and
        that run's weight; (None, 0) where none holds the first block."""
        if not hashes:
            return None, 0.0
        cap = load_bound(sum(loads.values()), len(loads), epsilon)
        runs = self.kv_index.held_runs(hashes, [a for a, n in loads.items() if n + 1 <= cap])
        if not runs:
            return None, 0.0
        best = max(runs, key=lambda a: (runs[a], -loads[a], a))
        return best, runs[best]

    def _least_loaded(self, loads: Mapping[str, int]) -> str:
        low = min(loads.values())
        return self._rng.choice(sorted(a for a, n in loads.items() if n == low))


def _pools(d: Deployment) -> tuple[Deployment, ...]:
    """A deployment and its prefill pool, if it has one."""
    return (d,) if d.prefill is None else (d, d.prefill)


def adapter_key(adapter: str) -> int:
    """Ring key of a LoRA adapter, equal on every gateway replica."""
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8, person=b"lora").digest(), "big")


def _unit(key: str) -> float:
    """Stable uniform number in [0, 1) for a key, equal on every gateway replica."""
    digest = hashlib.blake2b(key.encode(), digest_size=8, person=b"ab-split").digest()
    return int.from_bytes(digest, "big") / 2**64
