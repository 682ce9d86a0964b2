"""Issue 58: the console in a real headless Chromium (Debian's `chromium`, driven by Playwright
through its executable path; no browser is downloaded), against `inferplane up` serving a tiny model.

A tenant signs in, streams an answer in the playground, sees its usage rise, creates a key that
then works and revokes it so that the next request with it is refused; it cannot open the operator
pages or another tenant's data, by URL or API; a cross-site form post is refused (CSRF); the
session cookie is HttpOnly and SameSite=Strict; sign-out ends the session. The platform admin sees
a deployment scale to zero and back. Every request the pages make stays on loopback (anything else
is blocked and fails the test). Each page's screenshot is taken; with INFERPLANE_UPDATE_SCREENSHOTS=1
they are written to docs/console/ (the docs show them).
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from playwright import sync_api as playwright

from inferplane.bench.tiny_model import make_tiny_model
from inferplane.control_plane import auth, tenants
from inferplane.control_plane.auth import parse_key
from inferplane.control_plane.db import init_db, session_factory
from tests.e2e.test_up_newcomer import Up
from tests.services import installed
from tests.worker.test_worker_process import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "console"
WAIT_MS = 120_000  # a busy 2-core machine: generous, never a measurement


def deployment(name: str, model: str, **spec) -> dict:
    return {"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": {"model": {"uri": model, "format": "safetensors"}, "runtime": "paged", "tenant": "default",
                     "resources": {"cpu": "1", "memory": "2Gi"},
                     "engine": {"kvCacheMemory": "64Mi", "maxModelLen": 256, "maxNumSeqs": 4}, **spec}}


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    work = tmp_path_factory.mktemp("console")
    model = make_tiny_model(work / "tiny")
    manifest = work / "deployments.yaml"
    manifest.write_text(yaml.safe_dump_all([
        deployment("tiny", model, replicas=1),
        # scales to zero when idle and back on a request: what the admin watches on the deployments page
        deployment("elastic", model, replicas=1, minReplicas=0, maxReplicas=1,
                   autoscaling={"enabled": True, "stableWindowSeconds": 6, "panicWindowSeconds": 2,
                                "scaleDownDelaySeconds": 3, "idleSeconds": 4}),
    ]))
    running = Up(manifest, work / "home")
    running.base = f"http://127.0.0.1:{running.port}"
    running.admin_key = (work / "home" / "admin-key").read_text().strip()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def browser():
    executable = installed("chromium", package="chromium")
    with playwright.sync_playwright() as p:
        # as root, in a container with whatever /dev/shm it has: no sandbox, shared memory in /tmp
        launched = p.chromium.launch(executable_path=executable,
                                     args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield launched
        launched.close()


class Shots:
    """Each page's screenshot: always taken (and checked to be a PNG), copied to docs/console/ on request."""

    def __init__(self, folder: Path):
        self.folder = folder

    def take(self, page, name: str) -> None:
        path = self.folder / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("INFERPLANE_UPDATE_SCREENSHOTS") == "1":
            DOCS.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, DOCS / path.name)


@pytest.fixture
def shots(tmp_path) -> Shots:
    return Shots(tmp_path)


def loopback_only(context) -> list[str]:
    """Blocks, and lists, every request that would leave loopback."""
    left: list[str] = []

    def check(route) -> None:
        host = urlsplit(route.request.url).hostname
        if route.request.url.startswith(("data:", "blob:")) or host in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            left.append(route.request.url)
            route.abort()

    context.route("**/*", check)
    return left


def sign_in(page, base: str, credential: str) -> None:
    page.goto(f"{base}/")  # redirected to /console/
    page.wait_for_selector("#credential", timeout=WAIT_MS)
    page.fill("#credential", credential)
    page.click("#sign-in")
    page.wait_for_selector("#sign-out:not([hidden])", timeout=WAIT_MS)


def csrf_fetch(page, method: str, path: str, body: dict | None = None) -> int:
    """The status of a request the page's own script makes with its session (cookie and CSRF header)."""
    return page.evaluate("""async ([method, path, body]) => {
        const session = await (await fetch('/console/api/session')).json();
        const init = {method, headers: {'X-CSRF-Token': session.csrf, 'Content-Type': 'application/json'}};
        if (body !== null) init.body = JSON.stringify(body);
        return (await fetch(path, init)).status;
    }""", [method, path, body])


def usage_requests(page) -> int:
    """The requests the usage page shows, loaded afresh."""
    if page.url.endswith("#/usage"):
        page.reload()
    else:
        page.goto(page.url.split("#")[0] + "#/usage")
    page.wait_for_selector("#usage-totals", timeout=WAIT_MS)
    return int(page.text_content("#usage-totals").split(":")[1].split("requests")[0].strip())


def test_a_tenant_in_the_console(up, browser, shots) -> None:
    admin = {"Authorization": f"Bearer {up.admin_key}"}
    with httpx.Client(base_url=up.base, timeout=60) as api:  # another tenant, whose data must stay out of reach
        assert api.post("/admin/v1/tenants", headers=admin, json={"id": "globex"}).status_code == 201
        made = api.post("/admin/v1/keys", headers=admin, json={"tenant_id": "default", "name": "tenant-admin",
                                                               "scopes": ["infer", "models:read", "admin"]})
        assert made.status_code == 201, made.text
        tenant_admin_key = made.json()["key"]
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    left = loopback_only(context)
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    sign_in(page, up.base, up.key)

    cookie = next(c for c in context.cookies() if c["name"] == "ip_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert "ip_session" not in page.evaluate("document.cookie")  # no script can read it
    secret = up.key.split("_", 2)[-1]
    assert secret not in page.content() and secret not in cookie["value"]  # the page keeps no key

    # the playground streams: the answer grows in several pieces, then TTFT and tokens/s are shown
    page.wait_for_selector("#model option[value=tiny]", state="attached", timeout=WAIT_MS)
    page.select_option("#model", "tiny")
    page.fill("#max_tokens", "24")
    page.evaluate("""() => { window.__pieces = 0; new MutationObserver((m) => { window.__pieces += m.length; })
        .observe(document.getElementById('output'), {childList: true, characterData: true, subtree: true}); }""")
    page.click("#send")
    page.wait_for_selector("#stats[data-done=true]", timeout=WAIT_MS)
    assert page.text_content("#output").strip()
    assert page.evaluate("window.__pieces") > 1
    stats = page.text_content("#stats")
    assert "TTFT" in stats and "ms" in stats and "tokens/s" in stats
    shots.take(page, "playground")
    # the JSON-schema box asks for structured output (the gateway takes it: the stream completes)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    sent: list[dict] = []
    page.route("**/v1/chat/completions", lambda route: (sent.append(route.request.post_data_json), route.continue_()))
    page.fill("#schema", json.dumps(schema))
    page.click("#send")
    page.wait_for_selector("#stats[data-done]", timeout=WAIT_MS)
    assert page.get_attribute("#stats", "data-done") == "true", page.text_content("#output")
    assert sent[-1]["response_format"] == {"type": "json_schema", "json_schema": {"name": "console", "schema": schema}}
    assert not page.query_selector("#output [role=alert]"), page.text_content("#output")
    page.unroute("**/v1/chat/completions")
    page.fill("#schema", "")

    # usage rises after requests
    before = usage_requests(page)
    with httpx.Client(base_url=up.base, timeout=120) as api:
        for _ in range(2):
            answer = api.post("/v1/completions", headers={"Authorization": f"Bearer {up.key}"},
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + 120
    while (now := usage_requests(page)) < before + 2:
        assert time.monotonic() < deadline, f"usage stayed at {now} requests (before: {before})"
        time.sleep(1)
    page.wait_for_selector("#chart-tokens canvas", timeout=WAIT_MS)  # drawn by the shipped chart library
    assert page.text_content("#limits")
    shots.take(page, "usage")

    # the banner's key is infer-only: no keys page, and the keys API refuses its session
    page.goto(f"{up.base}/console/#/keys")
    page.wait_for_selector("[role=alert]", timeout=WAIT_MS)
    assert "no page" in page.text_content("[role=alert]")
    assert csrf_fetch(page, "GET", "/admin/v1/keys") == 403
    page.click("#sign-out")
    page.wait_for_selector("#credential", timeout=WAIT_MS)
    sign_in(page, up.base, tenant_admin_key)

    # a key made in the console works at once; revoked there, the next request with it is refused
    page.goto(f"{up.base}/console/#/keys")
    page.wait_for_selector("#create-key", timeout=WAIT_MS)
    page.fill("#key-name", "made-in-the-browser")
    page.fill("#key-rpm", "600")
    page.click("#create-key-button")
    page.wait_for_selector("#new-key-secret", timeout=WAIT_MS)
    made = page.text_content("#new-key-secret").strip()
    key_id = parse_key(made)[0]
    with httpx.Client(base_url=up.base, timeout=60) as api:
        assert api.get("/v1/models", headers={"Authorization": f"Bearer {made}"}).status_code == 200
        shots.take(page, "keys")
        page.click(f"[data-revoke='{key_id}']")
        page.wait_for_selector(f"[data-revoke='{key_id}']", state="detached", timeout=WAIT_MS)
        refused = api.get("/v1/models", headers={"Authorization": f"Bearer {made}"})
        assert refused.status_code == 401, refused.text
    page.reload()
    page.wait_for_selector("#keys-table", timeout=WAIT_MS)
    assert made.split("_", 2)[-1] not in page.content()  # a reloaded page never shows a secret again

    # the other pages a tenant admin has
    for name, selector in (("adapters", "#adapters-table"), ("alerts", "#alerts-table")):
        page.goto(f"{up.base}/console/#/{name}")
        page.wait_for_selector(selector, timeout=WAIT_MS)
        shots.take(page, name)
    # a webhook the gateway may not reach (loopback) is refused with the API's 400, shown on the page
    page.fill("#webhook-url", "http://127.0.0.1:9/hook")
    page.click("#set-webhook")
    page.wait_for_selector("#webhook-form [role=alert]", timeout=WAIT_MS)
    assert page.text_content("#webhook-form [role=alert]").startswith("400")

    # no operator page and no other tenant's data, by URL or by API
    for name in ("tenants", "deployments", "health", "models"):
        page.goto(f"{up.base}/console/#/{name}")
        page.wait_for_selector("[role=alert]", timeout=WAIT_MS)
        assert "no page" in page.text_content("[role=alert]")
    for path in ("/admin/v1/tenants", "/console/api/deployments", "/console/api/health",
                 "/admin/v1/keys?tenant_id=globex", "/admin/v1/tenants/globex/webhooks"):
        assert csrf_fetch(page, "GET", path) == 403, path
    assert csrf_fetch(page, "POST", "/admin/v1/keys", {"tenant_id": "globex"}) == 403

    # a cross-site form post with the session cookie is refused and changes nothing
    with httpx.Client(base_url=up.base, timeout=60) as api:
        count = len(api.get("/admin/v1/keys", headers=admin, params={"tenant_id": "default"}).json()["data"])
        with evil_site(f"{up.base}/admin/v1/keys") as evil:
            statuses: list[int] = []
            page.on("response", lambda r: statuses.append(r.status) if "/admin/v1/keys" in r.url else None)
            page.goto(evil)
            page.wait_for_load_state("load")
            deadline = time.monotonic() + 60
            while not statuses and time.monotonic() < deadline:
                page.wait_for_timeout(200)
            assert statuses and all(s in (401, 403, 422) for s in statuses), statuses
        after = api.get("/admin/v1/keys", headers=admin, params={"tenant_id": "default"}).json()["data"]
        assert len(after) == count

    # sign-out ends the session
    page.goto(f"{up.base}/console/#/usage")
    page.wait_for_selector("#sign-out:not([hidden])", timeout=WAIT_MS)
    page.click("#sign-out")
    page.wait_for_selector("#credential", timeout=WAIT_MS)
    assert not [c for c in context.cookies() if c["name"] == "ip_session"]
    shots.take(page, "sign-in")
    assert left == [], f"the pages reached beyond loopback: {left}"
    context.close()


def test_the_platform_admin_sees_a_deployment_scale(up, browser, shots) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    left = loopback_only(context)
    page = context.new_page()
    sign_in(page, up.base, up.admin_key)
    page.wait_for_selector("#deployments-table", timeout=WAIT_MS)

    def replicas() -> str:
        cell = page.query_selector("[data-replicas=elastic]")
        return cell.text_content().strip() if cell else ""

    # idle, the elastic deployment goes to zero; a request brings a replica back; the page follows
    deadline = time.monotonic() + 180
    while replicas() != "0 / 0":
        assert time.monotonic() < deadline, f"elastic never showed zero replicas (last: {replicas()!r})"
        page.wait_for_timeout(500)
    shots.take(page, "deployments")
    table = page.text_content("#deployments-table")
    assert "paged" in table and "running" in table and "KV" in table  # each worker's own report
    elastic = page.text_content("#deployments-table tr:has([data-replicas=elastic])")
    assert "wants 0 of max 1" in elastic  # the autoscaler's last decision
    woken: list[int] = []
    waker = threading.Thread(target=lambda: woken.append(httpx.post(
        f"{up.base}/v1/completions", headers={"Authorization": f"Bearer {up.key}"}, timeout=300,
        json={"model": "elastic", "prompt": "wake up", "max_tokens": 2}).status_code))
    waker.start()
    deadline = time.monotonic() + 300
    while replicas() != "1 / 1":
        assert time.monotonic() < deadline, f"elastic never showed its replica back (last: {replicas()!r})"
        page.wait_for_timeout(500)
    waker.join(timeout=300)
    assert woken == [200]

    for name, selector in (("models", "#models-table"), ("tenants", "#tenants-table"), ("health", "#health-table")):
        page.goto(f"{up.base}/console/#/{name}")
        page.wait_for_selector(selector, timeout=WAIT_MS)
        shots.take(page, f"admin-{name}")
        if name == "tenants":  # usage across tenants, beside their limits
            assert "requests" in page.text_content("#tenants-table tr:has-text('default')")

    # a thousand keys: the keys page shows them a page at a time
    engine = init_db(f"sqlite:///{up.home / 'inferplane.db'}")
    with session_factory(engine).begin() as session:
        tenants.create_tenant(session, "many", actor="test")
        for index in range(1000):
            auth.create_key(session, "many", actor="test", name=f"bulk-{index}")
    engine.dispose()
    page.goto(f"{up.base}/console/#/keys")
    page.wait_for_selector("#keys-table", timeout=WAIT_MS)
    assert len(page.query_selector_all("#keys-table tbody tr")) == 50
    pager = page.text_content("#keys-table .pager")
    assert "page 1 of" in pager and int(pager.split("(")[1].split()[0]) >= 1000
    page.click("#keys-table .pager button:has-text('Next')")
    assert "page 2 of" in page.text_content("#keys-table .pager")
    shots.take(page, "admin-keys")
    assert {"default", "many"} <= set(page.evaluate(
        "async () => (await (await fetch('/admin/v1/keys', {headers: {'X-CSRF-Token': (await (await "
        "fetch('/console/api/session')).json()).csrf}})).json()).data.map((k) => k.tenant_id)"))
    assert left == [], f"the pages reached beyond loopback: {left}"
    context.close()


class evil_site:  # noqa: N801 - used as a context manager, reads as a phrase
    """Another origin on loopback (same site, so the browser sends the SameSite=Strict cookie; only
    the CSRF check stands between the form and the key it would create) whose page posts a form to
    `target` as soon as it loads."""

    def __init__(self, target: str):
        page = (f"<html><body><form id=f method=post action='{target}' enctype='text/plain'>"
                "<input name='{\"tenant_id\":\"default\",\"name\":\"csrf\",\"x\":\"' value='\"}'></form>"
                "<script>document.getElementById('f').submit()</script></body></html>").encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
