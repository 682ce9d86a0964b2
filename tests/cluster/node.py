"""A real one-node Kubernetes cluster on this machine: kubelet, containerd and runc running our images.

`tests/k8s/` has a real control plane but no node, so pods there never run. This module adds the
node: etcd, kube-apiserver, kube-controller-manager and kube-scheduler, then containerd (CRI),
the kubelet, kube-proxy (iptables) and CoreDNS, all inside one network namespace of their own
(`/run/netns/inferplane-node`). Pods get addresses from a CNI bridge; Services work through
kube-proxy; cluster DNS is CoreDNS as a node process behind the `kube-dns` Service.

Invariants:
- No 10.x address is used outside the namespace. The host reaches the API server and Services only
  through `forward()`: a listening socket made on the host's loopback and served from inside the
  namespace (`tests/cluster/forward.py`).
- Everything it starts runs in its own process session, recorded in a state file, so `down()`
  (`make cluster-down`) stops all of it, pods included, and unmounts what the kubelet mounted.
- Images are never pulled (there is no registry): they are imported into containerd from the
  archives the offline builder makes (`deploy/image/build.py`); pods use `IfNotPresent` with
  content-addressed tags.

What this machine needs, found when this was first assembled (`../shared/FACTS.md`): root lacks
CAP_SYS_RESOURCE, so containerd's CRI must not lower `oom_score_adj`
(`restrict_oom_score_adj`); cgroup v1, so the kubelet runs the cgroupfs driver with
`failCgroupV1: false`; `ip netns exec` would remount /sys and hide the cgroups, so processes
enter the namespace with `nsenter --net`.

    python -m tests.cluster.node up      # prints how to point kubectl at it
    python -m tests.cluster.node down
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.k8s.cluster import (
    AUDIT_POLICY,
    CertificateAuthority,
    Cluster,
    binaries_dir,
    kubernetes_version,
    wait_for,
)

ROOT = Path(__file__).resolve().parents[2]
NETNS = "inferplane-node"
NODE_NAME = "inferplane-node"
NODE_IP, PEER_IP = "10.200.0.2", "10.200.0.1"
POD_SUBNET, CLUSTER_CIDR = "10.244.0.0/24", "10.244.0.0/16"
SERVICE_CIDR, API_SERVICE_IP, DNS_SERVICE_IP = "10.96.0.0/16", "10.96.0.1", "10.96.0.10"
API_PORT = 6443
STATE = Path(os.environ.get("INFERPLANE_NODE_STATE", "/var/lib/inferplane-node"))
RUN = Path("/run/inferplane-node")
STATE_FILE = RUN / "cluster.json"
START_TIMEOUT = 300.0  # a loaded 2-core machine takes minutes to bring all of it up
NODE_BUILD = Path(__file__).resolve().parent / "build.sh"
ENVTEST_BUILD = ROOT / "tests" / "k8s" / "envtest" / "build.sh"
DEBIAN_TOOLS = {"runc": "runc", "iptables": "iptables", "conntrack": "conntrack", "nsenter": "util-linux",
                "ip": "iproute2"}
CNI_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")


def missing_prerequisite() -> str | None:
    """None when this machine can run the node, else what is missing (and what provides it)."""
    if os.geteuid() != 0:
        return "the one-node cluster needs root (network namespaces, containerd, mounts)"
    for tool, package in DEBIAN_TOOLS.items():
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package {package}; scripts/test_services.sh installs it)"
    absent = [p for p in CNI_PLUGINS if not (CNI_DIR / p).exists()]
    if absent:
        return f"CNI plugins {', '.join(absent)} missing in {CNI_DIR} (Debian package containernetworking-plugins)"
    if shutil.which("etcd") is None:
        return "etcd is not installed (Debian package etcd-server)"
    if shutil.which("go") is None and not (binaries_dir() / "kubelet").exists():
        return "Go is not installed: the kubelet and containerd are built from Go modules"
    return None


def build_binaries() -> tuple[Path, Path]:
    """The Kubernetes binaries and containerd + CoreDNS, built once and cached (minutes the first time)."""
    folders = []
    for script in (ENVTEST_BUILD, NODE_BUILD):
        result = subprocess.run([str(script)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{script} failed:\n{result.stderr[-4000:]}")
        folders.append(Path(result.stdout.split()[-1]))
    return folders[0], folders[1]


# ---- processes and the namespace ----------------------------------------------------------------

def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


def _in_netns(*argv: str) -> list[str]:
    # nsenter --net, not `ip netns exec`: the latter remounts /sys and hides the cgroup hierarchy.
    return ["nsenter", f"--net=/run/netns/{NETNS}", "--", *argv]


def _make_netns() -> None:
    """The node's namespace: a veth pair inside it (the kernel here has no dummy links) for the node IP."""
    _run("ip", "netns", "add", NETNS)
    _run("ip", "-n", NETNS, "link", "set", "lo", "up")
    _run("ip", "-n", NETNS, "link", "add", "node0", "type", "veth", "peer", "name", "node1")
    _run("ip", "-n", NETNS, "addr", "add", f"{NODE_IP}/24", "dev", "node0")
    _run("ip", "-n", NETNS, "addr", "add", f"{PEER_IP}/24", "dev", "node1")
    _run("ip", "-n", NETNS, "link", "set", "node0", "up")
    _run("ip", "-n", NETNS, "link", "set", "node1", "up")
    # The kubelet and kube-proxy pick the node's address from the default route.
    _run("ip", "-n", NETNS, "route", "add", "default", "via", PEER_IP, "dev", "node0")
    for setting in ("net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1",
                    "net.ipv4.conf.all.route_localnet=1"):
        _run(*_in_netns("sysctl", "-q", "-w", setting), check=False)


def _netns_pids() -> list[int]:
    result = _run("ip", "netns", "pids", NETNS, check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()]


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _unmount_under(*roots: Path) -> None:
    """Unmount what the kubelet and containerd mounted (tmpfs volumes, overlay root file systems)."""
    prefixes = tuple(str(r) + "/" for r in roots)
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(prefixes)), key=len, reverse=True):
        _run("umount", "-l", point, check=False)


@dataclass
class NodeCluster:
    """The running cluster as the host sees it: an API server through a forwarder, and the node's files."""

    cluster: Cluster
    kubeconfig: Path
    containerd_socket: Path
    binaries: Path
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def directory(self) -> Path:
        return self.cluster.directory

    def ctr(self, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        """containerd's own client on the node, in the namespace Kubernetes uses (k8s.io)."""
        return subprocess.run([str(self.binaries / "ctr"), "--address", str(self.containerd_socket), "-n", "k8s.io",
                               *args], check=check, capture_output=True, text=True, timeout=timeout)

    def import_image(self, archive: Path, ref: str) -> bool:
        """Import an OCI archive unless containerd already has `ref`; True when it was imported."""
        if ref in self.ctr("images", "list", "-q").stdout.split():
            return False
        self.ctr("images", "import", "--digests", str(archive))
        listed = self.ctr("images", "list", "-q").stdout.split()
        if ref not in listed:
            raise RuntimeError(f"importing {archive} did not give {ref}: containerd has {listed}")
        # Earlier builds of the same image: gigabytes each on the node's disk, and no pod will ask
        # for them again (a build's tag is its content's hash).
        repository = ref.rsplit(":", 1)[0]
        stale = [r for r in listed if r.rsplit(":", 1)[0] == repository and r != ref]
        if stale:
            self.ctr("images", "remove", "--sync", *stale, check=False)
        return True

    def forward(self, host: str, port: int) -> int:
        """A host loopback port that reaches HOST:PORT inside the node's namespace (a pod, a ClusterIP)."""
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        local_port = listener.getsockname()[1]
        log = open(self.directory / f"forward-{local_port}.log", "ab")  # noqa: SIM115 - the child owns it
        process = subprocess.Popen(
            _in_netns(sys.executable, "-m", "tests.cluster.forward", "--fd", str(listener.fileno()),
                      "--to", f"{host}:{port}"),
            pass_fds=[listener.fileno()], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        listener.close()
        self.pids[f"forward-{local_port}"] = process.pid
        _record(self)
        return local_port


def _record(node: NodeCluster) -> None:
    STATE_FILE.write_text(json.dumps({
        "directory": str(node.directory), "server": node.cluster.server, "admin_token": node.cluster.admin_token,
        "kubeconfig": str(node.kubeconfig), "containerd_socket": str(node.containerd_socket),
        "binaries": str(node.binaries), "pids": node.pids}))


def running() -> NodeCluster | None:
    """The cluster `up()` started earlier (by `make cluster` or another test session), if it still answers."""
    if not STATE_FILE.exists() or not Path(f"/run/netns/{NETNS}").exists():
        return None
    state = json.loads(STATE_FILE.read_text())
    directory = Path(state["directory"])
    ca = CertificateAuthority(
        key=serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None),  # type: ignore[arg-type]
        cert=x509.load_pem_x509_certificate((directory / "ca.crt").read_bytes()))
    cluster = Cluster(directory=directory, server=state["server"], ca=ca, ca_file=directory / "ca.crt",
                      admin_token=state["admin_token"], audit_log=directory / "audit.log",
                      version=kubernetes_version())
    node = NodeCluster(cluster=cluster, kubeconfig=Path(state["kubeconfig"]),
                       containerd_socket=Path(state["containerd_socket"]), binaries=Path(state["binaries"]),
                       pids=state["pids"])
    try:
        status, _ = cluster.request("GET", "/readyz")
    except Exception:  # noqa: BLE001 - whatever broke, it is not a usable cluster
        return None
    return node if status == 200 else None


def down() -> None:
    """Stop everything the node runs (its processes, pods and forwarders), unmount, drop the namespace."""
    pids: list[int] = []
    if STATE_FILE.exists():
        pids = [int(p) for p in json.loads(STATE_FILE.read_text()).get("pids", {}).values()]
    if Path(f"/run/netns/{NETNS}").exists():
        pids += _netns_pids()
    # The kubelet first, so it does not restart what is being stopped; then the rest, pods included.
    _kill(pids, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.2)
    if Path(f"/run/netns/{NETNS}").exists():
        pids += _netns_pids()
    _kill(pids, signal.SIGKILL)
    time.sleep(0.5)
    _unmount_under(STATE / "kubelet", STATE / "containerd", RUN)
    for entry in Path("/run/netns").glob("cni-*") if Path("/run/netns").exists() else []:
        _run("ip", "netns", "delete", entry.name, check=False)
    if Path(f"/run/netns/{NETNS}").exists():
        _run("ip", "netns", "delete", NETNS, check=False)
    STATE_FILE.unlink(missing_ok=True)


# ---- bring-up -----------------------------------------------------------------------------------

def _containerd_config(directory: Path, pause_ref: str) -> Path:
    run = RUN / "containerd"
    config = f"""version = 3
root = "{STATE / 'containerd'}"
state = "{run}"

[grpc]
  address = "{run / 'containerd.sock'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{pause_ref}'

[plugins.'io.containerd.cri.v1.runtime']
  # root here lacks CAP_SYS_RESOURCE: runc cannot lower a process's oom_score_adj
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = '{shutil.which("runc")}'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['{CNI_DIR}']
    conf_dir = '{directory / "cni"}'
"""
    path = directory / "containerd.toml"
    path.write_text(config)
    (directory / "cni").mkdir(exist_ok=True)
    (directory / "cni" / "10-inferplane.conflist").write_text(json.dumps({
        "cniVersion": "1.0.0", "name": "inferplane",
        "plugins": [
            {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": True, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]],
                      "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(STATE / "cni-ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ]}, indent=1))
    return path


def _kubelet_config(directory: Path, serving: tuple[Path, Path]) -> Path:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        # cgroup v1 with the cgroupfs hierarchy; no swap accounting here
        "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{RUN / 'containerd' / 'containerd.sock'}",
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(directory / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "address": NODE_IP, "port": 10250, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "tlsCertFile": str(serving[0]), "tlsPrivateKeyFile": str(serving[1]),
        "clusterDomain": "cluster.local", "clusterDNS": [DNS_SERVICE_IP],
        "resolvConf": str(directory / "resolv.conf"),
        "podLogsDir": str(STATE / "pod-logs"),
        # Images are imported, never pulled: garbage-collecting one would lose it for good.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
        "serializeImagePulls": False, "maxPods": 60, "protectKernelDefaults": False,
        "shutdownGracePeriod": "0s",
    }
    (directory / "resolv.conf").write_text(f"nameserver {DNS_SERVICE_IP}\n")
    path = directory / "kubelet.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _kube_proxy_config(directory: Path, kubeconfig: Path) -> Path:
    config = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "mode": "iptables", "clusterCIDR": CLUSTER_CIDR, "hostnameOverride": NODE_NAME,
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        # Replies from a Service's backend on the same bridge return through the node.
        "iptables": {"masqueradeAll": True},
        # The namespace's conntrack table is the host's: leave its size alone.
        "conntrack": {"maxPerCore": 0},
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
    }
    path = directory / "kube-proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _corefile(directory: Path, kubeconfig: Path) -> Path:
    path = directory / "Corefile"
    path.write_text(f""".:53 {{
    bind {NODE_IP}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
}}
""")
    return path


def _dns_service(cluster: Cluster) -> None:
    """kube-dns: a Service with the usual ClusterIP and an EndpointSlice naming CoreDNS on the node."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
    cluster.apply({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
                   "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [{**p, "targetPort": 53} for p in ports]}})
    cluster.apply({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                                "labels": {"kubernetes.io/service-name": "kube-dns",
                                           "endpointslice.kubernetes.io/managed-by": "inferplane-tests"}},
                   "addressType": "IPv4", "ports": ports,
                   "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}]})


def _start(node_pids: dict[str, int], directory: Path, name: str, argv: list[str],
           env: dict[str, str] | None = None) -> None:
    log = open(directory / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it until it exits
    process = subprocess.Popen(_in_netns(*argv), stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                               start_new_session=True, env=env)
    node_pids[name] = process.pid


def _alive(pids: dict[str, int], directory: Path) -> None:
    for name, pid in pids.items():
        if not Path(f"/proc/{pid}").exists():
            log = (directory / f"{name}.log").read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{name} exited:\n{log}")
        with contextlib.suppress(ChildProcessError):
            finished, status = os.waitpid(pid, os.WNOHANG)
            if finished:
                log = (directory / f"{name}.log").read_text(errors="replace")[-4000:]
                raise RuntimeError(f"{name} exited with {status}:\n{log}")


def up(pause_image: tuple[Path, str]) -> NodeCluster:
    """Start the whole node (after stopping any earlier one) and wait until it is Ready.

    `pause_image` is the sandbox image's archive and reference: containerd needs it before any pod.
    """
    reason = missing_prerequisite()
    if reason:
        raise RuntimeError(reason)
    kube_bin, node_bin = build_binaries()
    down()
    for leftover in ("kubelet", "pod-logs", "cni-ipam"):
        shutil.rmtree(STATE / leftover, ignore_errors=True)
    RUN.mkdir(parents=True, exist_ok=True)
    directory = STATE / "control-plane"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (STATE / "pod-logs").mkdir()
    _make_netns()

    ca = CertificateAuthority.create("inferplane-node-ca")
    ca_file = directory / "ca.crt"
    ca_file.write_bytes(ca.pem())
    (directory / "ca.key").write_bytes(ca.key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    api_cert, api_key = ca.issue(directory, "apiserver", ips=("127.0.0.1", NODE_IP, API_SERVICE_IP), dns=(
        "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local"))
    kubelet_serving = ca.issue(directory, "kubelet", ips=(NODE_IP,), dns=(NODE_NAME,))
    kubelet_client = ca.issue_client(directory, "kube-apiserver-kubelet-client", "system:masters")
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (directory / "sa.key").write_bytes(sa_key.private_bytes(serialization.Encoding.PEM,
                                                            serialization.PrivateFormat.PKCS8,
                                                            serialization.NoEncryption()))
    (directory / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    tokens = {user: secrets.token_hex(16) for user in ("admin", "kcm", "scheduler", "kubelet", "proxy", "coredns")}
    (directory / "tokens.csv").write_text("\n".join([
        f'{tokens["admin"]},admin,admin,"system:masters"',
        f'{tokens["kcm"]},system:kube-controller-manager,kcm,"system:masters"',
        f'{tokens["scheduler"]},system:kube-scheduler,scheduler,"system:masters"',
        f'{tokens["kubelet"]},system:node:{NODE_NAME},kubelet,"system:nodes"',
        f'{tokens["proxy"]},system:kube-proxy,proxy',
        f'{tokens["coredns"]},coredns,coredns,"system:masters"',
    ]) + "\n")
    (directory / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))

    inside = Cluster(directory=directory, server=f"https://{NODE_IP}:{API_PORT}", ca=ca, ca_file=ca_file,
                     admin_token=tokens["admin"], audit_log=directory / "audit.log", version=kubernetes_version())
    pids: dict[str, int] = {}
    etcd_data = STATE / "etcd"
    shutil.rmtree(etcd_data, ignore_errors=True)
    _start(pids, directory, "etcd", [
        "etcd", "--name=node", f"--data-dir={etcd_data}", "--listen-client-urls=http://127.0.0.1:2379",
        "--advertise-client-urls=http://127.0.0.1:2379", "--listen-peer-urls=http://127.0.0.1:2380",
        "--initial-advertise-peer-urls=http://127.0.0.1:2380", "--initial-cluster=node=http://127.0.0.1:2380",
        "--unsafe-no-fsync", "--logger=zap", "--log-level=warn"])
    _start(pids, directory, "kube-apiserver", [
        str(kube_bin / "kube-apiserver"), "--etcd-servers=http://127.0.0.1:2379",
        "--bind-address=0.0.0.0", f"--advertise-address={NODE_IP}", f"--secure-port={API_PORT}",
        f"--cert-dir={directory}", f"--tls-cert-file={api_cert}", f"--tls-private-key-file={api_key}",
        f"--client-ca-file={ca_file}", f"--token-auth-file={directory / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
        "--service-account-issuer=https://kubernetes.default.svc",
        f"--service-account-key-file={directory / 'sa.pub'}",
        f"--service-account-signing-key-file={directory / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}", "--allow-privileged=true",
        f"--kubelet-client-certificate={kubelet_client[0]}", f"--kubelet-client-key={kubelet_client[1]}",
        f"--kubelet-certificate-authority={ca_file}", "--kubelet-preferred-address-types=InternalIP",
        f"--audit-policy-file={directory / 'audit-policy.yaml'}", f"--audit-log-path={directory / 'audit.log'}",
        "--audit-log-maxbackup=1", "--enable-priority-and-fairness=false", "--v=1"])

    # The host's way in: a forwarder to the API server, and a kubeconfig for kubectl and helm.
    node = NodeCluster(cluster=inside, kubeconfig=directory / "admin.kubeconfig",
                       containerd_socket=RUN / "containerd" / "containerd.sock", binaries=node_bin, pids=pids)
    api_port = node.forward(NODE_IP, API_PORT)
    host = Cluster(directory=directory, server=f"https://127.0.0.1:{api_port}", ca=ca, ca_file=ca_file,
                   admin_token=tokens["admin"], audit_log=directory / "audit.log", version=kubernetes_version())
    node.cluster = host
    node.kubeconfig = host.kubeconfig(tokens["admin"], "admin")
    _record(node)

    def api_ready() -> bool:
        _alive({k: v for k, v in pids.items() if not k.startswith("forward")}, directory)
        try:
            return host.request("GET", "/readyz")[0] == 200
        except Exception:  # noqa: BLE001 - not up yet
            return False
    wait_for(api_ready, START_TIMEOUT, "kube-apiserver /readyz", interval=0.5)

    def kubeconfig_inside(user: str, name: str) -> Path:
        return inside.kubeconfig(tokens[user], name, "kube-system")

    _start(pids, directory, "kube-controller-manager", [
        str(kube_bin / "kube-controller-manager"), f"--kubeconfig={kubeconfig_inside('kcm', 'kcm')}",
        "--leader-elect=false", "--use-service-account-credentials=false", f"--root-ca-file={ca_file}",
        f"--service-account-private-key-file={directory / 'sa.key'}", f"--cluster-cidr={CLUSTER_CIDR}",
        "--bind-address=127.0.0.1", f"--cert-dir={directory / 'kcm-certs'}", "--v=1"])
    _start(pids, directory, "kube-scheduler", [
        str(kube_bin / "kube-scheduler"), f"--kubeconfig={kubeconfig_inside('scheduler', 'scheduler')}",
        f"--authentication-kubeconfig={directory / 'scheduler.kubeconfig'}",
        f"--authorization-kubeconfig={directory / 'scheduler.kubeconfig'}",
        "--leader-elect=false", "--bind-address=127.0.0.1", "--v=1"])
    env = {**os.environ, "PATH": f"{node_bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    (STATE / "containerd").mkdir(parents=True, exist_ok=True)
    _start(pids, directory, "containerd",
           [str(node_bin / "containerd"), f"--config={_containerd_config(directory, pause_image[1])}"], env=env)
    _record(node)
    wait_for(lambda: (_alive(pids, directory), node.containerd_socket.exists())[1], START_TIMEOUT,
             "containerd's socket")
    wait_for(lambda: node.ctr("version", check=False).returncode == 0, START_TIMEOUT, "containerd answering")
    _clear_old_pods(node)
    node.import_image(*pause_image)
    _start(pids, directory, "kubelet", [
        str(kube_bin / "kubelet"), f"--config={_kubelet_config(directory, kubelet_serving)}",
        f"--kubeconfig={kubeconfig_inside('kubelet', 'kubelet')}", f"--root-dir={STATE / 'kubelet'}",
        f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}", "--v=1"], env=env)
    _start(pids, directory, "kube-proxy", [
        str(kube_bin / "kube-proxy"),
        f"--config={_kube_proxy_config(directory, kubeconfig_inside('proxy', 'proxy'))}", "--v=1"])
    _start(pids, directory, "coredns", [
        str(node_bin / "coredns"), "-conf", str(_corefile(directory, kubeconfig_inside('coredns', 'coredns')))])
    _record(node)
    _dns_service(host)

    def node_ready() -> bool:
        _alive({k: v for k, v in pids.items() if not k.startswith("forward")}, directory)
        found = host.get(f"/api/v1/nodes/{NODE_NAME}") or {}
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in (found.get("status") or {}).get("conditions") or [])
    wait_for(node_ready, START_TIMEOUT, f"node {NODE_NAME} Ready", interval=1)
    wait_for(lambda: host.get("/api/v1/namespaces/default/serviceaccounts/default"), START_TIMEOUT,
             "the default ServiceAccount (controller-manager running)")
    return node


def _clear_old_pods(node: NodeCluster) -> None:
    """Containers and sandboxes a previous run left in containerd (the images stay: importing costs minutes)."""
    for task in node.ctr("tasks", "list", "-q", check=False).stdout.split():
        node.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        node.ctr("tasks", "delete", "-f", task, check=False)
    containers = node.ctr("containers", "list", "-q", check=False).stdout.split()
    if containers:
        node.ctr("containers", "delete", *containers, check=False)


@contextlib.contextmanager
def session(pause_image: tuple[Path, str]) -> Iterator[NodeCluster]:
    """A node for a test session: one already running (`make cluster`) is used and left running;
    otherwise one is started and stopped afterwards (INFERPLANE_KEEP_CLUSTER=1 keeps it)."""
    existing = running()
    if existing is not None:
        existing.import_image(*pause_image)
        yield existing
        return
    node = up(pause_image)
    try:
        yield node
    finally:
        if not os.environ.get("INFERPLANE_KEEP_CLUSTER"):
            down()


def describe(node: NodeCluster) -> dict[str, Any]:
    """What `make cluster` prints: where the kubeconfig is and what runs."""
    return {"kubeconfig": str(node.kubeconfig), "server": node.cluster.server, "node": NODE_NAME,
            "logs": str(node.directory), "processes": sorted(node.pids)}


def main() -> None:
    parser = argparse.ArgumentParser(description="The one-node cluster: up or down.")
    parser.add_argument("action", choices=["up", "down", "status"])
    args = parser.parse_args()
    if args.action == "down":
        down()
        print("cluster: stopped")
        return
    if args.action == "status":
        node = running()
        print(json.dumps(describe(node), indent=1) if node else "cluster: not running")
        return
    sys.path.insert(0, str(ROOT / "deploy" / "image"))
    from build import build_images  # deploy/image/build.py: the offline image builder

    images = build_images()
    node = up((Path(images["pause"]["archive"]), images["pause"]["ref"]))
    start = time.monotonic()
    imported = node.import_image(Path(images["image"]["archive"]), images["image"]["ref"])
    if imported:
        print(f"cluster: imported {images['image']['ref']} in {time.monotonic() - start:.0f} s")
    print(f"cluster: node {NODE_NAME} is Ready; logs in {node.directory}/*.log, `make cluster-down` stops it.\n"
          f"Point kubectl and helm at it, and name the image the chart should run (docs/getting-started/cluster.md):\n"
          f"export KUBECONFIG={node.kubeconfig}\n"
          f"export IMAGE={images['image']['ref']}")

if __name__ == "__main__":
    main()
