"""`inferplane bench kv-routing`: a multi-turn workload over several replicas, one replica added and one
removed halfway, under each routing policy (issue 55, part b).

What runs is real except the model: the gateway's `Router` (kv-aware, prefix-hash, least-loaded) with
its bounded load and its `KVIndex`, and per replica the radix runtime's KV manager (`RadixKV`: the
prefix tree, the pool, LRU eviction) publishing its KV events, which reach the index as the
`KVEvents` stream's messages (after `--event-lag` requests, standing in for the stream's delay). No
forward pass runs: what a replica must compute for a request is its uncached prompt tokens, which
is what its time to first token is made of on a replica that is not queueing (prefill time is
proportional to it). The bench reports the prefix hit rate and the uncached tokens per request
(p50, p99) per policy, beside one replica holding the replicas' whole pool (what perfect routing
could reach: no conversation ever split across replicas).

Conversations take turns at random, `--in-flight` requests at a time (their blocks locked, their
replicas loaded, as in a server); each turn sends the history plus a new user message and the
answer joins the history. Each workload runs twice: with no shared prefix, and with a system
prompt all conversations share (which every prefix-hash key then starts with).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from inferplane.control_plane.routing import Deployment, Router, RouteRequest, StaticEndpointSource
from inferplane.v1 import worker_pb2
from inferplane.worker.engine.kv.events import KVEventLog
from inferplane.worker.engine.kv.radix import RadixKV
from inferplane.worker.engine.sampling import SamplingParams
from inferplane.worker.engine.sequence import Sequence
from inferplane.worker.serve.kv_event_stream import event_message, snapshot_batches

POLICIES = ("kv-aware", "prefix-hash", "least-loaded")


@dataclass
class Replica:
    """One worker's KV accounting and its events on their way to the gateway."""

    address: str
    kv: RadixKV
    position: int = 0
    pending: deque = field(default_factory=deque)  # (deliver after request n, batch)

    @classmethod
    def start(cls, address: str, blocks: int, block_size: int) -> Replica:
        return cls(address, RadixKV(blocks, block_size, events=KVEventLog(block_size)))

    def connect(self, router: Router) -> None:
        """The gateway's stream opens: the snapshot first."""
        self.position, batches = snapshot_batches(self.kv.events)
        for batch in batches:
            router.kv_index.apply(self.address, batch)

    def publish(self, now: int, lag: int) -> None:
        position, events = self.kv.events.since(self.position)
        self.position = position
        if events:
            batch = worker_pb2.KVEventBatch(instance_id=self.address, sequence=position,
                                            events=[event_message(e, self.kv.block_size) for e in events])
            self.pending.append((now + lag, batch))

    def deliver(self, router: Router, now: int) -> None:
        while self.pending and self.pending[0][0] <= now:
            router.kv_index.apply(self.address, self.pending.popleft()[1])


@dataclass
class Outcome:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    uncached: list[int] = field(default_factory=list)

    def row(self) -> dict:
        ordered = sorted(self.uncached)
        return {"hit_rate": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
                "uncached_p50": statistics.median(ordered) if ordered else 0,
                "uncached_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 32000) for _ in range(n)]


def conversations(args: argparse.Namespace, system_tokens: int, seed: int) -> list[list[tuple[list[int], list[int]]]]:
    """Per conversation, its turns: (user message, answer) token ids."""
    rng = random.Random(seed)
    system = _tokens(rng, system_tokens)
    out = []
    for _ in range(args.conversations):
        turns = [(_tokens(rng, rng.randint(args.user_tokens // 2, args.user_tokens * 3 // 2)),
                  _tokens(rng, rng.randint(args.answer_tokens // 2, args.answer_tokens * 3 // 2)))
                 for _ in range(args.turns)]
        turns[0] = (system + turns[0][0], turns[0][1])
        out.append(turns)
    return out


def run(policy: str | None, args: argparse.Namespace, workload, seed: int) -> Outcome:
    """One policy over the workload (None: one replica with every replica's blocks)."""
    rng = random.Random(seed)
    names = [f"10.0.0.{i}:50051" for i in range(args.replicas + 1)]
    single = policy is None
    blocks = args.blocks * args.replicas if single else args.blocks
    replicas = {a: Replica.start(a, blocks, args.block_size) for a in (names[:1] if single else names[:args.replicas])}
    source = StaticEndpointSource(list(replicas))
    router = Router({"m": [Deployment("d", source, block_size=args.block_size, load_epsilon=args.load_epsilon,
                                      routing_policy=policy or "least-loaded")]}, rng=random.Random(seed))
    for replica in replicas.values():
        replica.connect(router)
    order = [c for c, turns in enumerate(workload) for _ in turns]
    rng.shuffle(order)
    next_turn = [0] * len(workload)
    history: list[list[int]] = [[] for _ in workload]
    busy: set[int] = set()  # conversations with a turn in flight: their next turn waits for it
    in_flight: deque = deque()
    outcome = Outcome()
    params = SamplingParams(max_tokens=1, temperature=0.0)
    queue = deque(order)
    now = 0
    while queue or in_flight:
        if queue and len(in_flight) < args.in_flight:
            conversation = next((c for c in queue if c not in busy), None)
        else:
            conversation = None
        if conversation is None:  # finish the oldest request: its answer joins its conversation's history
            lease, replica, seq, c, answer = in_flight.popleft()
            if replica.address in replicas:  # a removed replica's requests ended with it
                seq.output_token_ids.extend(answer)
                replica.kv.allocate(seq, len(answer))
                seq.num_computed_tokens = seq.num_tokens
                replica.kv.free(seq)
                replica.publish(now, args.event_lag)
            lease.release(True)
            history[c] += answer
            busy.discard(c)
            continue
        queue.remove(conversation)
        now += 1
        # Halfway one replica joins; a little later the first one leaves.
        if not single and not args.steady and now == len(order) // 2:
            joined = names[args.replicas]
            replicas[joined] = Replica.start(joined, blocks, args.block_size)
            source.add(joined)
            replicas[joined].connect(router)
        if not single and not args.steady and now == len(order) // 2 + len(order) // 8:
            left = names[0]
            source.remove(left)
            replicas.pop(left)
            router.kv_index.drop(left)  # its stream ended
        for replica in replicas.values():
            replica.deliver(router, now)
        user, answer = workload[conversation][next_turn[conversation]]
        next_turn[conversation] += 1
        prompt = history[conversation] + user
        history[conversation] = prompt
        lease = router.pick(RouteRequest("m", token_ids=prompt))
        replica = replicas[lease.address]
        seq = Sequence(request_id=f"r{now}", prompt_token_ids=list(prompt), params=params,
                       max_tokens=len(answer) + 1, rng_key=0)
        replica.kv.match_prefix(seq)
        outcome.prompt_tokens += len(prompt)
        outcome.cached_tokens += seq.num_cached_tokens
        outcome.uncached.append(len(prompt) - seq.num_cached_tokens)
        if not replica.kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            raise SystemExit(f"a replica's pool ({blocks} blocks) cannot hold a {len(prompt)}-token prompt: "
                             "raise --blocks")
        seq.num_computed_tokens = seq.num_tokens
        replica.kv.on_computed(seq)
        replica.publish(now, args.event_lag)
        busy.add(conversation)
        in_flight.append((lease, replica, seq, conversation, answer))
    return outcome


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="inferplane bench kv-routing", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks per replica")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=150, help="mean tokens of a user message")
    parser.add_argument("--answer-tokens", type=int, default=100, help="mean tokens of an answer")
    parser.add_argument("--system-tokens", type=int, default=256, help="the shared system prompt of the second run")
    parser.add_argument("--in-flight", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--event-lag", type=int, default=4, help="requests routed before an event reaches the index")
    parser.add_argument("--load-epsilon", type=float, default=0.25, help="the deployments' bounded-load slack")
    parser.add_argument("--steady", action="store_true",
                        help="no replica added or removed (to see what a change costs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    for label, system in (("no shared prefix", 0), (f"a {args.system_tokens}-token shared system prompt",
                                                      args.system_tokens)):
        workload = conversations(args, system, args.seed)
        rows = {"single replica (all blocks)": run(None, args, workload, args.seed).row()}
        for policy in POLICIES:
            rows[policy] = run(policy, args, workload, args.seed).row()
        best = rows["single replica (all blocks)"]["hit_rate"]
        if args.json:
            print(json.dumps({"workload": label, **rows}))
            continue
        change = "no change" if args.steady else "one added at the half, one removed soon after"
        print(f"\n{label}: {args.conversations} conversations x {args.turns} turns, {args.replicas} replicas of "
              f"{args.blocks} blocks ({change}), {args.in_flight} in flight")
        print(f"{'routing':<30}{'hit rate':>10}{'vs single':>11}{'uncached p50':>14}{'uncached p99':>14}")
        for name, row in rows.items():
            print(f"{name:<30}{row['hit_rate']:>10.3f}{row['hit_rate'] / max(best, 1e-9):>10.2f}x"
                  f"{row['uncached_p50']:>14.0f}{row['uncached_p99']:>14.0f}")


if __name__ == "__main__":
    main()
