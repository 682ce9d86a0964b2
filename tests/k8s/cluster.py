"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

What `setup-envtest` gives other projects, built here from Go modules (`tests/k8s/envtest/`, `make
envtest`) because no site serves prebuilt Kubernetes binaries to our machines. The API server runs
as a production one does where it matters to the operator: TLS with its own CA, bearer tokens,
`--authorization-mode=RBAC`, service-account tokens signed by its own key (so a ServiceAccount's
token is the credential the operator uses in a pod), CRDs with structural schemas and CEL, server-
side apply, admission webhooks, watches. `OwnerReferencesPermissionEnforcement` is on as on
OpenShift, so an owner reference with `blockOwnerDeletion` needs the rights that go with it.

The controller-manager runs the controllers the operator depends on: the Deployment and ReplicaSet
controllers (Deployment status), garbage collection (owner references), namespace deletion,
ServiceAccounts, EndpointSlices, PodDisruptionBudget status, and PVC protection (so that `helm
uninstall` of the chart's control-plane volume completes). There is no kubelet or scheduler:
pods are created but never run, so a test that needs ready workers marks pods Ready itself through
the status subresource (`mark_pods_ready`).

Every request made with a ServiceAccount's credentials is written to an audit log (metadata only),
so tests can show that the operator was never refused anything (`forbidden_requests`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

ENVTEST_DIR = Path(__file__).resolve().parent / "envtest"
CRD_FILES = [*sorted((Path(__file__).resolve().parents[2] / "helm" / "inferplane" / "crds").glob("*.yaml")),
             Path(__file__).resolve().parent / "monitoring-crds.yaml"]
START_TIMEOUT = 240.0  # a loaded 2-core machine takes tens of seconds to bring the API server up

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}


def kubernetes_version() -> str:
    """The Kubernetes release the envtest module pins (its requirement of k8s.io/kubernetes)."""
    for line in (ENVTEST_DIR / "go.mod").read_text().splitlines():
        words = line.replace("require", "").split()
        if len(words) >= 2 and words[0] == "k8s.io/kubernetes" and words[1].startswith("v"):
            return words[1]
    raise RuntimeError("tests/k8s/envtest/go.mod does not require k8s.io/kubernetes")


def binaries_dir() -> Path:
    """Where `tests/k8s/envtest/build.sh` puts the binaries for the pinned version."""
    cache = os.environ.get("INFERPLANE_ENVTEST_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inferplane" / "envtest")
    return Path(cache) / kubernetes_version()


def missing_binaries() -> str | None:
    """None when every binary is present, else what is missing and why."""
    folder = binaries_dir()
    absent = [name for name in ("kube-apiserver", "kube-controller-manager") if not (folder / name).exists()]
    if absent:
        return f"{', '.join(absent)} {kubernetes_version()} not built in {folder} (`make envtest` builds them)"
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian package etcd-server)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- certificates -------------------------------------------------------------------------------

@dataclass(frozen=True)
class CertificateAuthority:
    """A throw-away CA; the API server's serving certificate and the tests' webhook certificates."""

    key: rsa.RSAPrivateKey
    cert: x509.Certificate

    @classmethod
    def create(cls, name: str = "inferplane-test-ca") -> CertificateAuthority:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return cls(key, cert)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, directory: Path, name: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()
              ) -> tuple[Path, Path]:
        """A serving certificate for the given names; returns (cert file, key file)."""
        import ipaddress

        alt = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        return self._signed(directory, name, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]),
                            x509.oid.ExtendedKeyUsageOID.SERVER_AUTH, x509.SubjectAlternativeName(alt))

    def issue_client(self, directory: Path, user: str, group: str) -> tuple[Path, Path]:
        """A client certificate: the API server reads the user from CN and a group from O (the kubelet
        authenticates the API server this way)."""
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, user),
                             x509.NameAttribute(NameOID.ORGANIZATION_NAME, group)])
        return self._signed(directory, user, subject, x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH)

    def _signed(self, directory: Path, name: str, subject: x509.Name, usage: x509.ObjectIdentifier,
                *extensions: x509.ExtensionType) -> tuple[Path, Path]:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return cert_file, key_file


def _write_service_account_keys(directory: Path) -> tuple[Path, Path]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = directory / "sa.key", directory / "sa.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


# ---- the cluster --------------------------------------------------------------------------------

class ApiError(AssertionError):
    def __init__(self, status: int, body: Any, what: str) -> None:
        message = body.get("message") if isinstance(body, Mapping) else body
        super().__init__(f"{what}: {status} {message}")
        self.status = status
        self.body = body


@dataclass
class Cluster:
    """A running control plane and what tests need to talk to it."""

    directory: Path
    server: str
    ca: CertificateAuthority
    ca_file: Path
    admin_token: str
    audit_log: Path
    version: str
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)

    # -- processes

    def start(self, name: str, argv: list[str]) -> None:
        self.commands[name] = argv
        log = open(self.directory / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it until it exits
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
                                                start_new_session=True)

    def restart_apiserver(self) -> None:
        """Stop kube-apiserver and start it again (same port, same etcd), as an upgrade of it would.

        Every client's connections and watches break; what is stored stays.
        """
        self._stop("kube-apiserver")
        self.start("kube-apiserver", self.commands["kube-apiserver"])
        wait_for(lambda: _ready(self), START_TIMEOUT, "kube-apiserver /readyz after its restart", interval=0.5)

    # -- credentials

    def kubeconfig(self, token: str, name: str, namespace: str = "default") -> Path:
        """A kubeconfig for a bearer token (as kubectl, helm and kopf read it)."""
        path = self.directory / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": "envtest", "cluster": {"server": self.server,
                                                         "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": name, "user": {"token": token}}],
            "contexts": [{"name": name, "context": {"cluster": "envtest", "user": name, "namespace": namespace}}],
        }))
        path.chmod(0o600)
        return path

    @property
    def admin_kubeconfig(self) -> Path:
        path = self.directory / "admin.kubeconfig"
        return path if path.exists() else self.kubeconfig(self.admin_token, "admin")

    def service_account_token(self, namespace: str, name: str, seconds: int = 7200) -> str:
        """A token for the ServiceAccount, from the TokenRequest API: what a pod's projected token holds."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": seconds}}
        answer = self.call("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token", body)
        return answer["status"]["token"]

    # -- requests

    def request(self, method: str, path: str, body: Any = None, *, token: str | None = None,
                content_type: str = "application/json", params: Mapping[str, str] | None = None
                ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token or self.admin_token}", "Accept": "application/json"}
        content = None
        if body is not None:
            headers["Content-Type"] = content_type
            content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        with httpx.Client(verify=str(self.ca_file), timeout=60) as client:
            response = client.request(method, self.server + path, content=content, headers=headers, params=params)
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        return response.status_code, payload

    def call(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """request() that raises ApiError unless the answer is 2xx."""
        status, payload = self.request(method, path, body, **kwargs)
        if status >= 300:
            raise ApiError(status, payload, f"{method} {path}")
        return payload

    def get(self, path: str) -> Any | None:
        status, payload = self.request("GET", path)
        if status == 404:
            return None
        if status >= 300:
            raise ApiError(status, payload, f"GET {path}")
        return payload

    def apply(self, obj: Mapping[str, Any], *, manager: str = "inferplane-tests") -> Any:
        """Server-side apply as the admin."""
        return self.call("PATCH", object_path(obj), obj, content_type="application/apply-patch+yaml",
                         params={"fieldManager": manager, "force": "true"})

    def create_namespace(self, name: str) -> None:
        self.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def delete_namespace(self, name: str) -> None:
        self.request("DELETE", f"/api/v1/namespaces/{name}")

    def wait_gone(self, path: str, timeout: float = 60) -> None:
        wait_for(lambda: self.get(path) is None, timeout, f"{path} deleted")

    def wait_established(self, crd_name: str, timeout: float = 60) -> None:
        def established() -> bool:
            crd = self.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd_name}") or {}
            return any(c["type"] == "Established" and c["status"] == "True"
                       for c in (crd.get("status") or {}).get("conditions") or [])
        wait_for(established, timeout, f"CRD {crd_name} established")

    # -- what happened

    def audit_events(self, user: str | None = None) -> list[dict[str, Any]]:
        events = []
        if self.audit_log.exists():
            for line in self.audit_log.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if user is None or event.get("user", {}).get("username") == user:
                        events.append(event)
        return events

    def forbidden_requests(self, user: str) -> list[str]:
        """Every request of `user` that RBAC (or admission) refused with 403, as 'verb resource'."""
        refused = []
        for event in self.audit_events(user):
            if (event.get("responseStatus") or {}).get("code") == 403:
                ref = event.get("objectRef") or {}
                what = "/".join(p for p in (ref.get("apiGroup") or "core", ref.get("resource"),
                                            ref.get("subresource")) if p)
                refused.append(f"{event.get('verb')} {what} {ref.get('namespace', '')}/{ref.get('name', '')}: "
                               f"{(event.get('responseStatus') or {}).get('message', '')}")
        return refused

    def log(self, process: str) -> str:
        path = self.directory / f"{process}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def mark_pods_ready(self, namespace: str, selector: str) -> int:
        """Play the kubelet: every pod matching the label selector gets Running and Ready with an IP."""
        pods = self.call("GET", f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector})
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        for n, pod in enumerate(pods["items"], start=1):
            conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                          for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
            status = {"phase": "Running", "conditions": conditions, "podIP": f"192.0.2.{n}",
                      "podIPs": [{"ip": f"192.0.2.{n}"}], "hostIP": "192.0.2.254", "startTime": now}
            self.call("PATCH", f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status",
                      {"status": status}, content_type="application/merge-patch+json")
        return len(pods["items"])

    def stop(self) -> None:
        for name in ("kube-controller-manager", "kube-apiserver", "etcd"):
            self._stop(name)

    def _stop(self, name: str) -> None:
        process = self.processes.get(name)
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def object_path(obj: Mapping[str, Any], *, named: bool = True) -> str:
    """The REST path of an object, by the plural the tests use for each kind (no discovery needed)."""
    api_version, kind, meta = obj["apiVersion"], obj["kind"], obj["metadata"]
    plural = PLURALS.get(kind) or kind.lower() + "s"
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    namespace = meta.get("namespace")
    path = f"{base}/namespaces/{namespace}/{plural}" if namespace and kind not in CLUSTER_SCOPED else f"{base}/{plural}"
    return f"{path}/{meta['name']}" if named else path


PLURALS = {"InferenceDeployment": "inferencedeployments", "PodDisruptionBudget": "poddisruptionbudgets",
           "NetworkPolicy": "networkpolicies", "ClusterKopfPeering": "clusterkopfpeerings",
           "KopfPeering": "kopfpeerings", "ServiceMonitor": "servicemonitors", "PrometheusRule": "prometheusrules"}
CLUSTER_SCOPED = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding",
                  "ValidatingWebhookConfiguration", "ClusterKopfPeering"}


def install_crds(cluster: Cluster, files: list[Path] = CRD_FILES) -> None:
    """The chart's CRDs (InferenceDeployment, kopf peerings) and the Prometheus operator's two kinds."""
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                cluster.apply(doc)
                cluster.wait_established(doc["metadata"]["name"])


def wait_for(check: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    """Poll until check() is truthy; the machine may be slow, so callers give generous timeouts."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@contextlib.contextmanager
def running_cluster(base: Path | None = None) -> Iterator[Cluster]:
    """Start etcd, kube-apiserver and kube-controller-manager; stop them and remove their files after."""
    binaries = binaries_dir()
    version = kubernetes_version()
    directory = Path(tempfile.mkdtemp(prefix="inferplane-k8s-", dir=base))
    # etcd's data on tmpfs where there is one: a shared disk's fsync latency would set the pace.
    shm = Path("/dev/shm")
    etcd_data = Path(tempfile.mkdtemp(prefix="inferplane-etcd-", dir=shm if shm.is_dir() else directory))
    ca = CertificateAuthority.create()
    ca_file = directory / "ca.crt"
    ca_file.write_bytes(ca.pem())
    cert, key = ca.issue(directory, "apiserver", dns=("localhost", "kubernetes", "kubernetes.default.svc"),
                         ips=("127.0.0.1",))
    sa_key, sa_pub = _write_service_account_keys(directory)
    admin_token, kcm_token = secrets.token_hex(16), secrets.token_hex(16)
    # Static tokens: the admin (system:masters) and the controller-manager, which runs its
    # controllers with its own identity (--use-service-account-credentials=false).
    (directory / "tokens.csv").write_text(
        f'{admin_token},admin,admin,"system:masters"\n'
        f'{kcm_token},system:kube-controller-manager,kcm,"system:masters"\n')
    (directory / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    audit_log = directory / "audit.log"
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    cluster = Cluster(directory=directory, server=f"https://127.0.0.1:{api_port}", ca=ca, ca_file=ca_file,
                      admin_token=admin_token, audit_log=audit_log, version=version)

    try:
        cluster.start("etcd", ["etcd", "--name=envtest", f"--data-dir={etcd_data}",
                       f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                       f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                       f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                       f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                       f"--initial-cluster=envtest=http://127.0.0.1:{etcd_peer}",
                       "--logger=zap", "--log-level=warn"])
        cluster.start("kube-apiserver", [
            str(binaries / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={api_port}",
            f"--cert-dir={directory}", f"--tls-cert-file={cert}", f"--tls-private-key-file={key}",
            f"--client-ca-file={ca_file}",
            f"--token-auth-file={directory / 'tokens.csv'}", "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
            "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
            f"--audit-policy-file={directory / 'audit-policy.yaml'}", f"--audit-log-path={audit_log}",
            "--audit-log-maxbackup=1",
            "--enable-priority-and-fairness=false", "--v=1",
        ])
        wait_for(lambda: _ready(cluster), START_TIMEOUT, "kube-apiserver /readyz", interval=0.5)
        kcm_config = cluster.kubeconfig(kcm_token, "kube-controller-manager", "kube-system")
        cluster.start("kube-controller-manager", [
            str(binaries / "kube-controller-manager"),
            f"--kubeconfig={kcm_config}", "--leader-elect=false", "--use-service-account-credentials=false",
            "--controllers=" + ",".join(f"{c}-controller" for c in (
                "garbage-collector", "namespace", "serviceaccount", "deployment", "replicaset", "endpointslice",
                "disruption", "persistentvolumeclaim-protection")),
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", f"--cert-dir={directory / 'kcm-certs'}",
            "--v=1",
        ])
        # The ServiceAccount controller creating `default` in a namespace shows that the
        # controllers are running (pods cannot be created in a namespace without it).
        wait_for(lambda: cluster.get("/api/v1/namespaces/default/serviceaccounts/default") is not None,
                 START_TIMEOUT, "kube-controller-manager (default ServiceAccount)", interval=0.5)
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(etcd_data, ignore_errors=True)
        if os.environ.get("INFERPLANE_KEEP_ENVTEST"):
            print(f"envtest files kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


def _ready(cluster: Cluster) -> bool:
    for name, process in cluster.processes.items():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{cluster.log(name)[-4000:]}")
    try:
        status, _ = cluster.request("GET", "/readyz")
    except httpx.HTTPError:
        return False
    return status == 200
