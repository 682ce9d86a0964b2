"""Issue 29, item 3: a large answer does not hold the gateway's event loop.

`n: 128, max_tokens: 900, logprobs: true, top_logprobs: 20` made the gateway build the whole answer
(2.3 million alternatives, each token decoded by the tokenizer, 150 MB of JSON) in one stretch
once the stream had ended: `/healthz` took 10 s, every other tenant's request waited as long.

These tests drive the real request path (fast path, `Completions`, the response) with a worker
stream faked in process (each message read gives the loop a turn, as a gRPC read does), and look
at what the loop did, not at wall-clock times (the machine may be shared): how many turns the loop
got while the answer was being written, how many bytes went out in a single turn, whether a
`/healthz` asked meanwhile was answered. Times are printed for information.

`python -m tests.control_plane.test_gateway_loop 128 900 20` measures the attack's size (minutes).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from inferplane.api.tokenizer import TextTokenizer
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.gateway.catalog import ServedModel
from inferplane.control_plane.gateway.rest import create_asgi_app
from inferplane.control_plane.gateway.server import Gateway, GatewaySettings
from inferplane.v1 import worker_pb2

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"


def byte_tokenizer() -> TextTokenizer:
    """A byte-level BPE over the 256 byte symbols plus <s> and </s>: any text encodes, one token per byte."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(alphabet)}, merges=[], fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False),
                            AddedToken("</s>", special=True, normalized=False)])
    return TextTokenizer(tokenizer=tok, chat_template=CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>")


@dataclass
class Loop:
    """What the event loop did while a request ran: `turns` counts its iterations (a callback that
    puts itself back at each), with the longest iteration's CPU and wall time."""

    turns: int = 0
    longest_cpu: float = 0.0
    longest_wall: float = 0.0
    running: bool = True
    last: tuple[float, float] = (0.0, 0.0)

    def start(self) -> None:
        self.last = (time.thread_time(), time.perf_counter())
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        cpu, wall = time.thread_time(), time.perf_counter()
        self.longest_cpu = max(self.longest_cpu, cpu - self.last[0])
        self.longest_wall = max(self.longest_wall, wall - self.last[1])
        self.last = (cpu, wall)
        self.turns += 1
        if self.running:
            asyncio.get_running_loop().call_soon(self._tick)


@dataclass
class Answer:
    status: int = 0
    headers: dict = field(default_factory=dict)
    sends: list[tuple[int, int]] = field(default_factory=list)  # (loop turn, bytes) of each body message
    body: bytearray = field(default_factory=bytearray)


async def asgi_call(app, method: str, path: str, body: bytes = b"", headers: dict | None = None,
                    loop: Loop | None = None) -> Answer:
    """One request straight through the ASGI app, each body message noted with the loop turn it came in."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "", "scheme": "http",
             "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("gw", 80)}
    answer = Answer()
    finished = asyncio.Event()
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            answer.sends.append((loop.turns if loop else 0, len(message.get("body", b""))))

    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return answer


class FakeWorker:
    """`InferenceService.stream` for a synthetic answer: `tokens` steps of one token for every choice,
    each with `top` alternatives; a choice's first message scores the prompt when asked (echo).
    The messages are made beforehand (`make`), so what the loop does is the gateway's work; each
    read gives the loop a turn, as a gRPC read does."""

    def __init__(self, tokens: int, top: int) -> None:
        self.tokens, self.top = tokens, top
        self.loop: Loop | None = None
        self.messages: list[worker_pb2.GenerateResponse] = []
        self.handed: list[tuple[int, bool]] = []  # (loop turn, scored the prompt) per message

    def make(self, choices: int, n: int, scored: list[list[int]] | None) -> None:
        """The messages of `choices` choices; with `scored` (the prompts' ids), the prompts' logprobs."""
        rnd = random.Random(0)
        for step in range(self.tokens):
            for index in range(choices):
                token = rnd.randrange(33, 127)
                msg = worker_pb2.GenerateResponse(text=chr(token), token_ids=[token - 33], index=index,
                                                  logprobs=[-0.1234567 * (index + 1)])
                if self.top:
                    msg.top_logprobs.add(token_ids=[rnd.randrange(258) for _ in range(self.top)],
                                         logprobs=[-0.25 * k - 0.0123 for k in range(self.top)])
                if step == 0 and scored is not None:
                    prompt = scored[index // n]
                    msg.prompt_logprobs.extend([-1.5] * (len(prompt) - 1))
                    for _ in prompt[1:]:
                        msg.prompt_top_logprobs.add(token_ids=[rnd.randrange(258) for _ in range(self.top)],
                                                    logprobs=[-0.5] * self.top)
                if step == self.tokens - 1:
                    msg.finished, msg.finish_reason = True, "length"
                    msg.usage.completion_tokens = self.tokens
                self.messages.append(msg)

    async def stream(self, prepared):
        if not self.messages:
            scored = prepared.params.HasField("prompt_logprobs")
            self.make(prepared.choices, prepared.n, prepared.prompts if scored else None)
        for msg in self.messages:
            self.handed.append((self.loop.turns if self.loop else 0, bool(msg.prompt_logprobs)))
            yield msg
            await asyncio.sleep(0)


@dataclass
class Served:
    gateway: Gateway
    app: object
    headers: dict


def serve(tmp_path: Path) -> Served:
    gw = Gateway(GatewaySettings(db_url=f"sqlite:///{tmp_path / 'gw.db'}"))
    with gw.sessions.begin() as session:
        tenants.create_tenant(session, "t1", actor="test")
        key = auth.create_key(session, "t1", actor="test", scopes=["infer"]).secret
    gw.keys.refresh()
    gw.catalog.put(ServedModel(name="m", tokenizer=byte_tokenizer(), max_model_len=8192))
    return Served(gw, create_asgi_app(gw.context), {"content-type": "application/json",
                                                     "authorization": f"Bearer {key}"})


@pytest.fixture
def served(tmp_path):
    s = serve(tmp_path)
    yield s
    s.gateway.engine.dispose()


def request_body(chat: bool, n: int, tokens: int, top: int, stream: bool, **extra) -> tuple[str, bytes]:
    if chat:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": n, "max_tokens": tokens,
                "logprobs": True, "top_logprobs": top, "stream": stream}
        return "/v1/chat/completions", json.dumps({**body, **extra}).encode()
    body = {"model": "m", "prompt": "hi", "n": n, "max_tokens": tokens, "logprobs": top, "stream": stream}
    return "/v1/completions", json.dumps({**body, **extra}).encode()


@dataclass
class Measured:
    answer: Answer
    loop: Loop
    worker: FakeWorker
    health: list[tuple[int, float]]  # (loop turn answered, seconds from asked to answered)
    seconds: float

    def report(self, label: str) -> str:
        lateness = max((s for _, s in self.health), default=0.0)
        return (f"{label}: {len(self.answer.body) / 1e6:.1f} MB in {len(self.answer.sends)} sends, "
                f"{self.seconds:.2f} s; {self.loop.turns} loop turns, longest {self.loop.longest_cpu * 1000:.1f} ms "
                f"CPU ({self.loop.longest_wall * 1000:.0f} ms wall); /healthz asked every 5 ms: "
                f"{len(self.health)} answered, slowest {lateness * 1000:.0f} ms")


async def measure(served: Served, chat: bool, n: int, tokens: int, top: int, stream: bool, **extra) -> Measured:
    """The request, with a /healthz client asking every 5 ms (its latency counted from when it asked)."""
    worker = FakeWorker(tokens, top)
    tokenizer = served.gateway.catalog.get("m", None).tokenizer
    prompts = [tokenizer.encode(extra.get("prompt", "hi"))]
    worker.make(n, n, prompts if extra.get("echo") and not chat else None)
    served.gateway.context.inference.stream = FakeWorker(1, top).stream
    path, body = request_body(chat, 1, 1, top, stream, **extra)
    assert (await asgi_call(served.app, "POST", path, body, served.headers)).status == 200  # warm up
    assert (await asgi_call(served.app, "GET", "/healthz")).status == 200
    gc.collect()  # setting up is done: its objects are old, as in a gateway that has been up a while

    served.gateway.context.inference.stream = worker.stream
    loop = worker.loop = Loop()
    health: list[tuple[int, float]] = []
    clock = asyncio.get_running_loop().time

    async def healthz() -> None:
        due = clock()
        while loop.running:
            await asyncio.sleep(max(0.0, due - clock()))
            assert (await asgi_call(served.app, "GET", "/healthz")).status == 200
            health.append((loop.turns, clock() - due))
            due = max(due + 0.005, clock())

    loop.start()
    client = asyncio.create_task(healthz())
    start = time.perf_counter()
    path, body = request_body(chat, n, tokens, top, stream, **extra)
    try:
        answer = await asgi_call(served.app, "POST", path, body, served.headers, loop=loop)
    finally:
        loop.running = False
        await client
    return Measured(answer, loop, worker, health, time.perf_counter() - start)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_a_large_whole_answer_is_written_while_the_loop_keeps_turning(served, chat):
    n, tokens, top = 32, 120, 20 if chat else 5
    m = await measure(served, chat, n, tokens, top, stream=False)
    print(m.report(f"{'chat' if chat else 'completions'} n={n} max_tokens={tokens} top={top}, whole"))
    assert m.answer.status == 200, m.answer.body[:500]
    answer = json.loads(m.answer.body)
    assert int(m.answer.headers["content-length"]) == len(m.answer.body)
    assert [c["index"] for c in answer["choices"]] == list(range(n))
    if chat:
        content = answer["choices"][-1]["logprobs"]["content"]
        assert len(content) == tokens and all(len(e["top_logprobs"]) == top for e in content)
    else:
        logprobs = answer["choices"][-1]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == len(logprobs["top_logprobs"]) == tokens

    # Once the last message is in, the answer is written with the loop turning in between (at least
    # every 2 choices) and sent with at most 2 MiB of it in any one turn. (Before: all of it in one.)
    last_message = m.worker.handed[-1][0]
    turns_writing = m.answer.sends[0][0] - last_message
    assert turns_writing >= n // 2, f"the loop turned {turns_writing} times while {n} choices were written"
    per_turn: dict[int, int] = {}
    for turn, size in m.answer.sends:
        per_turn[turn] = per_turn.get(turn, 0) + size
    assert max(per_turn.values()) <= 2 << 20, f"{max(per_turn.values())} bytes of the answer in one loop turn"


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_long_prompts_logprobs_are_written_in_slices(served, stream):
    """With echo, a choice's first message scores the whole prompt: thousands of tokens with their
    alternatives in one message. It is written a slice at a time (before: in one stretch)."""
    prompt_tokens, top = 3000, 5
    m = await measure(served, False, 2, 3, top, stream=stream, echo=True, prompt="ab" * (prompt_tokens // 2))
    print(m.report(f"completions echo, a prompt of {prompt_tokens} tokens scored with top {top}, "
                   f"{'streamed' if stream else 'whole'}"))
    assert m.answer.status == 200, m.answer.body[:500]
    scored = [turn for turn, prompt in m.worker.handed if prompt]
    assert len(scored) == 2
    if stream:
        # Between handing over the message and sending its chunk, the loop turned.
        chunks = [turn for turn, size in m.answer.sends if size > 10_000]
        assert len(chunks) == 2
        for handed, sent in zip(scored, chunks, strict=True):
            assert sent - handed >= 4, f"a {prompt_tokens}-token message written in {sent - handed} loop turns"
        events = [json.loads(line[6:]) for line in m.answer.body.decode().split("\n\n") if line.startswith("data: {")]
        logprobs = next(e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"])
    else:
        # The next message is asked for once the one before is written: the loop turned meanwhile.
        assert m.worker.handed[1][0] - m.worker.handed[0][0] >= 4, m.worker.handed[:2]
        logprobs = json.loads(m.answer.body)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) >= prompt_tokens
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][:3] == [0, 1, 2]


def test_a_token_is_decoded_once_per_tokenizer():
    tok = byte_tokenizer()
    calls = []
    real = tok.tokenizer

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            calls.append(list(ids))
            return real.decode(ids, skip_special_tokens=skip_special_tokens)

        def get_vocab_size(self, with_added_tokens=True):
            return real.get_vocab_size(with_added_tokens=with_added_tokens)

    a, s = tok.encode("a")[0], real.token_to_id("<s>")
    tok.tokenizer = Counting()
    assert [tok.token_text(i) for i in (a, a, s, a)] == ["a", "a", "<s>", "a"]  # specials by name
    assert calls == [[a], [s]]
    assert tok.token_text(10_000) == "" and tok.token_text(10_000) == ""
    assert calls[2:] == [[10_000], [10_000]]  # an id the vocabulary does not have is not kept


# -- the answers are the JSON they were: json.dumps of OpenAI's dicts, byte for byte -------------

def _messages(choices: int, tokens: int, top: int, prompts: list[list[int]] | None, n: int) -> list:
    """Messages of 0 to 3 tokens, alternatives that decode alike (ids 256+ and lone bytes), echo scores."""
    rnd = random.Random(7)
    out = []
    for step in range(tokens):
        for index in range(choices):
            ids = [rnd.randrange(258) for _ in range(rnd.choice([0, 1, 1, 2, 3]))]
            msg = worker_pb2.GenerateResponse(token_ids=ids, index=index, logprobs=[-rnd.random() * 5 for _ in ids],
                                              text="".join(chr(65 + i % 26) + "\u00e9" for i in ids))
            for _ in ids:
                if top:
                    msg.top_logprobs.add(token_ids=[rnd.randrange(258) for _ in range(top)],
                                         logprobs=sorted((-rnd.random() * 3 for _ in range(top)), reverse=True))
            if step == 0 and prompts is not None:
                for _ in prompts[index // n][1:]:
                    msg.prompt_logprobs.append(-rnd.random())
                    msg.prompt_top_logprobs.add(token_ids=[rnd.randrange(258) for _ in range(top or 1)],
                                                logprobs=[-0.5] * (top or 1))
            if step == tokens - 1:
                msg.finished, msg.finish_reason = True, rnd.choice(["length", "stop", "abort"])
                msg.usage.completion_tokens = tokens
                msg.usage.cached_tokens = index
            out.append(msg)
    return out


class _Reference:
    """OpenAI's answers as dicts, written plainly from the messages (what the gateway did before)."""

    def __init__(self, tok: TextTokenizer, body, prompts: list[list[int]], n: int, rid: str, created: int):
        self.tok, self.body, self.prompts, self.n = tok, body, prompts, n
        self.chat = hasattr(body, "messages")
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{rid}"
        self.created = created
        self.echoes = [tok.decode(p) if not isinstance(s, str) else s
                       for s, p in zip(getattr(body, "prompts", []), prompts, strict=False)] if not self.chat \
            and body.echo else []

    def text(self, i: int) -> str:
        return self.tok.tokenizer.decode([i], skip_special_tokens=False)

    def chat_logprobs(self, msgs) -> dict | None:
        if not self.body.logprobs:
            return None

        def entry(i, lp):
            t = self.text(i)
            return {"token": t, "logprob": lp, "bytes": list(t.encode())}
        content = []
        for m in msgs:
            for k, i in enumerate(m.token_ids):
                alts = [entry(a, lp) for a, lp in zip(m.top_logprobs[k].token_ids, m.top_logprobs[k].logprobs,
                                                       strict=True)] if self.body.top_logprobs else []
                content.append({**entry(i, m.logprobs[k]), "top_logprobs": alts})
        return {"content": content}

    def text_logprobs(self, index: int, msgs, start: int) -> dict | None:
        if self.body.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if self.body.logprobs else None,
               "text_offset": []}
        for m in msgs:
            if self.echoes and m.prompt_logprobs:
                ids = self.prompts[index // self.n]
                texts = [self.text(i) for i in ids]
                out["tokens"] += texts
                out["token_logprobs"] += [None, *m.prompt_logprobs]
                out["text_offset"] += [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
                if self.body.logprobs:
                    out["top_logprobs"] += [None, *({self.text(a): lp for a, lp in zip(t.token_ids, t.logprobs,
                                                                                       strict=True)}
                                                    for t in m.prompt_top_logprobs)]
            for k, i in enumerate(m.token_ids):
                out["tokens"].append(self.text(i))
                out["token_logprobs"].append(m.logprobs[k])
                out["text_offset"].append(start)
                start += len(self.text(i))
                if self.body.logprobs:
                    t = m.top_logprobs[k]
                    out["top_logprobs"].append({self.text(a): lp for a, lp in zip(t.token_ids, t.logprobs,
                                                                                   strict=True)})
        return out

    def reason(self, m) -> str | None:
        return {"abort": "stop"}.get(m.finish_reason, m.finish_reason) or None

    def usage(self, finals) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(f.usage.completion_tokens for f in finals.values())
        cached = sum(f.usage.cached_tokens for i, f in finals.items() if i % self.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self, msgs) -> bytes:
        by_choice: dict[int, list] = {}
        for m in msgs:
            by_choice.setdefault(m.index, []).append(m)
        choices = []
        for index in sorted(by_choice):
            ms = by_choice[index]
            text = "".join(m.text for m in ms)
            if self.chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "finish_reason": self.reason(ms[-1]), "logprobs": self.chat_logprobs(ms)})
            else:
                echo = self.echoes[index // self.n] if self.echoes else ""
                choices.append({"index": index, "text": echo + text, "finish_reason": self.reason(ms[-1]),
                                "logprobs": self.text_logprobs(index, ms, len(echo))})
        out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
               "created": self.created, "model": self.body.model, "choices": choices,
               "usage": self.usage({m.index: m for m in msgs if m.finished})}
        return json.dumps(out, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()

    def chunks(self, msgs) -> list[str]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        envelope = {"id": self.id, "object": kind, "created": self.created, "model": self.body.model}
        out, roled, echoed, offsets = [], set(), set(), {}
        for m in msgs:
            if m.text or m.token_ids or m.prompt_logprobs:
                if self.chat:
                    delta = {"content": m.text}
                    if m.index not in roled:
                        delta["role"] = "assistant"
                        roled.add(m.index)
                    choice = {"index": m.index, "delta": delta, "finish_reason": None,
                              "logprobs": self.chat_logprobs([m])}
                else:
                    echo = self.echoes[m.index // self.n] if self.echoes and m.index not in echoed else ""
                    echoed.add(m.index)
                    start = offsets.get(m.index, len(self.echoes[m.index // self.n]) if self.echoes else 0)
                    logprobs = self.text_logprobs(m.index, [m], start)
                    if logprobs is not None:
                        offsets[m.index] = start + sum(len(self.text(i)) for i in m.token_ids)
                    choice = {"index": m.index, "text": echo + m.text, "finish_reason": None, "logprobs": logprobs}
                out.append(json.dumps({**envelope, "choices": [choice]}))
            if m.finished:
                final = {"index": m.index, "delta": {}, "finish_reason": self.reason(m)} if self.chat else \
                    {"index": m.index, "text": "", "finish_reason": self.reason(m), "logprobs": None}
                out.append(json.dumps({**envelope, "choices": [final]}))
        return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("chat", "logprobs", "echo"), [
    (True, (False, None), False), (True, (True, None), False), (True, (True, 0), False), (True, (True, 4), False),
    (False, None, False), (False, 0, False), (False, 3, False), (False, 3, True), (False, 0, True),
])
async def test_the_answer_is_json_dumps_of_openais_dicts_byte_for_byte(monkeypatch, stream, chat, logprobs, echo):
    """The answer's JSON is written by hand, piece by piece: it is what json.dumps gave for the same
    dicts (Starlette's compact form for a whole answer, json.dumps's defaults for stream chunks),
    with runs of tokens cut in slices and the body sent in pieces (small sizes, to cut often)."""
    from inferplane.control_plane.auth import Principal
    from inferplane.control_plane.gateway import answer_json, completions
    from inferplane.control_plane.gateway.inference import PreparedRequest
    from inferplane.control_plane.gateway.openai_types import ChatCompletionRequest, CompletionRequest

    monkeypatch.setattr(answer_json, "SLICE", 2)
    monkeypatch.setattr(answer_json, "SEND_BYTES", 100)
    monkeypatch.setattr(completions._Choice, "PIECE", 7)
    tok = byte_tokenizer()
    n = 2
    if chat:
        body = ChatCompletionRequest.model_validate({
            "model": "m\u00e9", "messages": [{"role": "user", "content": "hi"}], "n": n, "logprobs": logprobs[0],
            "top_logprobs": logprobs[1], "stream": stream})
        prompts, top = [tok.encode("hi")], logprobs[1] or 0
    else:
        body = CompletionRequest.model_validate({"model": "m", "prompt": ["h\u00e9llo \"x\"", "wo\nrld"], "n": n,
                                                 "logprobs": logprobs, "echo": echo, "stream": stream})
        prompts, top = [tok.encode(p) for p in body.prompts], logprobs or 0
    principal = Principal(subject="k", tenant_id="t", scopes=frozenset(), via="key")
    prepared = PreparedRequest("rid", principal, ServedModel("m", tok, 4096), prompts, body.sampling_params(5))
    msgs = _messages(prepared.choices, 6, top, prompts if echo and logprobs is not None else None, n)
    shape = (completions._ChatShape if chat else completions._TextShape)(body, prepared)
    reference = _Reference(tok, body, prompts, n, "rid", shape.created)
    if stream:
        written = []
        for m in msgs:
            chunk = await shape.chunk(m) if m.text or m.token_ids or m.prompt_logprobs else None
            if chunk is not None:
                written.append(chunk)
            if m.finished:
                written.append(shape.final_chunk(m))
        assert written == reference.chunks(msgs)
        return
    choices = {i: completions._Choice(shape.arrays, shape.json.item) for i in range(prepared.choices)}
    for m in msgs:
        await shape.absorb(choices[m.index], m)
    response = completions.PiecewiseJSONResponse(await shape.whole(choices))
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    await response({"type": "http"}, None, send)
    whole = b"".join(m.get("body", b"") for m in sent[1:])
    assert whole == reference.whole(msgs)
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(whole)).encode()
    assert len(sent) > 3 and all(m["more_body"] for m in sent[1:-1]) and not sent[-1].get("more_body")


async def _main(n: int, tokens: int, top: int) -> None:
    import tempfile

    for chat in (True, False):
        for stream in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                s = serve(Path(tmp))
                m = await measure(s, chat, n, tokens, top if chat else min(top, 5), stream)
                print(m.report(f"{'chat' if chat else 'completions'} n={n} max_tokens={tokens} "
                               f"top={top if chat else min(top, 5)} {'streamed' if stream else 'whole'}"), flush=True)
                s.gateway.engine.dispose()


if __name__ == "__main__":
    asyncio.run(_main(*(int(a) for a in sys.argv[1:4])))


# -- big request bodies ----------------------------------------------------------------------------------


async def test_a_big_body_is_parsed_off_the_event_loop(served, monkeypatch):
    """A 100,000-choice body costs tens of milliseconds of JSON and pydantic work: on the loop it
    held every other tenant's request and /healthz (issue 29, case 1, at the gateway). Now a body
    over OFF_LOOP_BODY_BYTES is parsed on a thread, and a small one stays on the loop."""
    import threading

    from inferplane.control_plane.gateway import fast_path

    threads: list[str] = []
    parse = fast_path._parse

    def recording(*args):
        threads.append(threading.current_thread().name)
        return parse(*args)

    monkeypatch.setattr(fast_path, "_parse", recording)
    choices = [f"c{i}" for i in range(100_000)]
    path, body = request_body(True, 1, 4, 0, False, logprobs=False, top_logprobs=None, guided_choice=choices)
    assert len(body) > fast_path.OFF_LOOP_BODY_BYTES
    answer = await asgi_call(served.app, "POST", path, body, served.headers)
    # Refused at validation (the gateway knows the bound; nothing is built or sent to a replica).
    assert answer.status == 400, answer.body[:300]
    error = json.loads(answer.body)["error"]
    assert error["param"] == "guided_choice" and "1024" in error["message"]
    small_path, small = request_body(True, 1, 4, 0, False, logprobs=False, top_logprobs=None,
                                     guided_choice=choices[:2000])
    assert len(small) < fast_path.OFF_LOOP_BODY_BYTES
    assert (await asgi_call(served.app, "POST", small_path, small, served.headers)).status == 400
    main = threading.current_thread().name
    assert threads[0] != main and threads[1] == main, threads
