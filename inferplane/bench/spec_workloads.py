"""The requests `bench spec` times: four workloads, each a list of distinct chat requests.

Why these: speculative decoding pays where the output repeats text the context holds (issue 57):
- code editing: a module and a rename to apply, answered with the whole module;
- RAG: documents and a question, answered by quoting them;
- agent: a tool's JSON output, echoed back as a list;
- chat: a story on a topic, where nothing in the prompt is meant to be copied.
Each workload's requests differ (another rename, another question, other tickets, another topic), so
a request never finds its own answer in the tenant's history (the `suffix` method's memory).
"""

from __future__ import annotations

import json
import random

MODULE = '''import json
from dataclasses import dataclass


@dataclass
class Order:
    order_id: str
    customer: str
    items: list[str]
    total_cents: int


def load_orders(path: str) -> list[Order]:
    """Reads the orders file, one JSON object per line."""
    orders = []
    with open(path) as handle:
        for line in handle:
            record = json.loads(line)
            orders.append(Order(record["order_id"], record["customer"], record["items"], record["total_cents"]))
    return orders


def total_revenue(orders: list[Order]) -> int:
    """The sum of every order's total, in cents."""
    return sum(order.total_cents for order in orders)


def orders_by_customer(orders: list[Order]) -> dict[str, list[Order]]:
    """Orders grouped by the customer who placed them."""
    grouped: dict[str, list[Order]] = {}
    for order in orders:
        grouped.setdefault(order.customer, []).append(order)
    return grouped
'''

RENAMES = [("total_cents", "amount_cents"), ("customer", "client"), ("order_id", "reference"), ("items", "products"),
           ("load_orders", "read_orders"), ("total_revenue", "revenue"), ("orders_by_customer", "group_by_client"),
           ("grouped", "by_customer"), ("record", "row"), ("handle", "stream"), ("path", "filename"),
           ("Order", "Purchase"), ("line", "text"), ("order", "entry"), ("orders", "entries"),
           ("total_cents", "price_cents"), ("customer", "buyer"), ("items", "lines"), ("handle", "source"),
           ("record", "item")]

DOCUMENTS = [
    "The Mariner 10 spacecraft was launched on November 3, 1973, and became the first probe to use a gravity "
    "assist, swinging past Venus to reach Mercury. It photographed about 45 percent of Mercury's surface during "
    "three flybys in 1974 and 1975.",
    "MESSENGER entered orbit around Mercury on March 18, 2011, after a journey of more than six years that included "
    "one flyby of Earth, two of Venus and three of Mercury. It mapped the entire surface and found water ice in "
    "permanently shadowed craters near the poles.",
    "BepiColombo, a joint mission of the European Space Agency and the Japan Aerospace Exploration Agency, was "
    "launched on October 20, 2018. It carries two orbiters that are due to separate and study the planet's "
    "magnetic field and interior.",
    "The Rosetta probe reached comet 67P/Churyumov-Gerasimenko in August 2014 after a ten-year journey. Its lander, "
    "Philae, touched down on the comet's nucleus on November 12, 2014, bouncing twice before coming to rest in a "
    "shadowed spot.",
    "Voyager 1 crossed the heliopause on August 25, 2012, becoming the first human-made object to enter "
    "interstellar space. It still sends data from its plasma wave instrument, more than 24 billion kilometres "
    "from Earth.",
    "The Juno spacecraft arrived at Jupiter on July 4, 2016, and entered a polar orbit. Its microwave radiometer "
    "showed that the Great Red Spot extends about 350 kilometres below the cloud tops.",
]
QUESTIONS = [
    (1, "What did MESSENGER find near Mercury's poles, and when did it enter orbit?"),
    (0, "Which probe first used a gravity assist, and how much of Mercury did it photograph?"),
    (2, "Which agencies run BepiColombo, and what will its orbiters study?"),
    (3, "When did Philae land on the comet, and what happened when it touched down?"),
    (4, "When did Voyager 1 cross the heliopause, and how far from Earth is it?"),
    (5, "How deep does the Great Red Spot extend, according to Juno?"),
]

TICKET_TITLES = ["Disk usage alert on db-02", "Rotate TLS certificate for api.example.com",
                 "Nightly backup job failed twice", "Upgrade Redis to 7.4 on cache cluster",
                 "Latency spike on checkout service", "Expired API token in billing exporter",
                 "Add dashboards for the ingest pipeline", "Flaky integration test in payments",
                 "Memory leak in the image resizer", "DNS record missing for status page"]

TOPICS = ["a lighthouse keeper who befriends a seagull", "a robot learning to paint", "a village under the sea",
          "a clockmaker who loses track of time", "a fox that guards a library", "the last train of the night",
          "a garden growing on the moon", "a detective who is afraid of the dark", "two rival bakers",
          "a map that redraws itself", "a violin found in an attic", "a city where it never stops snowing",
          "a dragon who collects teacups", "an astronaut's first day home", "a bridge that sings",
          "a river that flows uphill", "a cat who runs a post office", "the oldest tree in the forest",
          "a kite that would not come down", "a chess game lasting a hundred years"]

WORKLOADS = ("code", "rag", "agent", "chat")


def _code(i: int) -> list[dict]:
    old, new = RENAMES[i % len(RENAMES)]
    return [{"role": "user", "content": f"Here is a Python module:\n\n```python\n{MODULE}```\n\nRename `{old}` to "
                                        f"`{new}` everywhere. Reply with the complete updated module in one code "
                                        "block."}]


def _rag(i: int) -> list[dict]:
    target, question = QUESTIONS[i % len(QUESTIONS)]
    chosen = sorted({target, (target + 1 + i) % len(DOCUMENTS), (target + 3 + i) % len(DOCUMENTS)})
    context = "\n\n".join(f"Document {n + 1}: {DOCUMENTS[d]}" for n, d in enumerate(chosen))
    return [{"role": "user", "content": f"Documents:\n\n{context}\n\nQuestion: {question}\n\nAnswer with a quotation "
                                        f"from the documents, then cite the document number."}]


def _agent(i: int) -> list[dict]:
    rng = random.Random(i)
    tickets = [{"id": f"OPS-{rng.randrange(1000, 9999)}", "title": title,
                "priority": rng.choice(["high", "medium", "low"]), "updated": f"2026-12-{rng.randrange(1, 29):02d}"}
               for title in rng.sample(TICKET_TITLES, 4)]
    return [{"role": "system", "content": "You are an assistant that calls tools and reports their results exactly."},
            {"role": "user", "content": "List the open tickets assigned to me."},
            {"role": "assistant", "content": 'Calling list_tickets(assignee="me", status="open").'},
            {"role": "user", "content": "Tool output:\n" + json.dumps(tickets, indent=1) +
                                        "\n\nShow me each ticket from the tool output with its id, title, priority "
                                        "and date."}]


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]


_BUILDERS = {"code": _code, "rag": _rag, "agent": _agent, "chat": _chat}


def requests(workload: str, count: int, offset: int = 0) -> list[list[dict]]:
    """`count` distinct chat requests of `workload`, from variant `offset` on."""
    return [_BUILDERS[workload](offset + i) for i in range(count)]
