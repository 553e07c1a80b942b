"""deploy/kubernetes/ checked offline, and the kubernetes connector against a recorded API contract.

No cluster runs here. The manifests are validated against the Kubernetes schemas (kubernetes-validate,
strict: unknown fields fail), and their probes, grace periods and RBAC are checked against what the
processes do. The connector talks, through the official client, to a fake API server on loopback (a
named mock at the cluster boundary) that answers only the exchanges of kubernetes_contract.json.
"""
from __future__ import annotations

import asyncio
import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import kubernetes_validate
import pytest
import yaml
from kubernetes import client

from common.worker_record import WorkerRecord
from planner.actions import Action
from planner.connectors.kubernetes import KubernetesConnector
from planner.errors import ConnectorError
from planner.fleet import Member
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
CONTRACT = json.loads((Path(__file__).parent / "kubernetes_contract.json").read_text())
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
LAST_ANSWERS_S = 5   # worker/server/cli.py: after the drain, time for the last answers


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(str(path.relative_to(DEPLOY)), doc) for path in sorted(DEPLOY.rglob("*.yaml"))
            if path.name != "kustomization.yaml" for doc in yaml.safe_load_all(path.read_text()) if doc]


def deployments() -> dict[str, dict[str, Any]]:
    return {f"{path}:{doc['metadata']['name']}": doc for path, doc in documents() if doc["kind"] == "Deployment"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(version: str) -> None:
    problems = []
    for path, doc in documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{path} {doc['kind']}: {exc.message}")
    assert not problems, problems


def test_the_validation_catches_a_broken_manifest() -> None:
    _, doc = next((p, d) for p, d in documents() if d["kind"] == "Deployment")
    broken = copy.deepcopy(doc)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["prot"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomizations_name_files_that_exist() -> None:
    for kustomization in DEPLOY.rglob("kustomization.yaml"):
        for resource in yaml.safe_load(kustomization.read_text())["resources"]:
            assert (kustomization.parent / resource).exists(), f"{kustomization}: {resource}"


@pytest.mark.parametrize("name", sorted(k for k in deployments() if re.search(r"(prefill|decode|proxy)$", k)))
def test_probes_and_grace_periods_match_the_processes(name: str) -> None:
    pod = deployments()[name]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    command = container["command"]
    want_ready = "/ready" if name.endswith("proxy") else "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == want_ready
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    if "--drain-timeout" in command:   # our worker: SIGTERM drains it, the pod must outlive the drain
        drain = float(command[command.index("--drain-timeout") + 1])
        assert pod["terminationGracePeriodSeconds"] >= drain + LAST_ANSWERS_S
    if "--shutdown-grace" in command:
        assert pod["terminationGracePeriodSeconds"] > float(command[command.index("--shutdown-grace") + 1])


def test_the_planner_may_scale_exactly_the_deployments_it_is_told_to() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in documents()}
    planner = docs[("Deployment", "neuron-di-planner")]["spec"]["template"]["spec"]
    command = planner["containers"][0]["command"]
    named = {command[command.index(f"--{role}-deployment") + 1] for role in ("prefill", "decode")}
    assert named <= {name for kind, name in docs if kind == "Deployment"}
    rule = docs[("Role", "neuron-di-planner")]["rules"][0]
    assert set(rule["resourceNames"]) == named and rule["resources"] == ["deployments/scale"]
    assert set(rule["verbs"]) == {"get", "patch"}
    assert planner["serviceAccountName"] == docs[("RoleBinding", "neuron-di-planner")]["subjects"][0]["name"]


class FakeAPIServer:
    """A Kubernetes API server that knows only the contract's exchanges, in any order; it records every
    request, and answers anything else 404."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer("GET")

            def do_PATCH(self) -> None:
                self._answer("PATCH")

            def _answer(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                request = {"method": method, "path": self.path, "content_type": self.headers.get("Content-Type"),
                           "body": body}
                outer.requests.append(request)
                known = next((e for e in CONTRACT["exchanges"] if e["method"] == method and e["path"] == self.path
                              and e.get("body") in (None, body)), None)
                reply = json.dumps(known["answer"] if known else {"kind": "Status", "code": 404}).encode()
                self.send_response(200 if known else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeEtcd:
    def __init__(self, records: list[WorkerRecord]) -> None:
        self.records = records

    async def read(self) -> list[WorkerRecord]:
        return self.records


@pytest.fixture
def api_server() -> Iterator[FakeAPIServer]:
    server = FakeAPIServer()
    yield server
    server.stop()


def test_the_connector_reads_and_scales_deployments_as_the_contract_says(api_server: FakeAPIServer) -> None:
    config = client.Configuration(host=api_server.url)
    api = client.AppsV1Api(client.ApiClient(config))
    records = [WorkerRecord("prefill", "10.0.0.1", 8100), WorkerRecord("decode", "10.0.0.2", 8200)]
    connector = KubernetesConnector(FakeEtcd(records), "serving",   # type: ignore[arg-type]
                                    {"prefill": "neuron-di-prefill", "decode": "neuron-di-decode"}, api)

    async def scenario() -> Any:
        fleet = await connector.fleet()
        decode = next(m for m in fleet.members if m.role == "decode" and m.state == "serving")
        await connector.apply([Action("start", "prefill"), Action("stop", "decode", decode)])
        return fleet

    before = asyncio.run(scenario())
    assert before.counts().prefill == 1 and before.counts().decode == 2
    assert Member("neuron-di-decode/pending-0", "decode", "starting") in before.members
    wanted = [{k: e.get(k) for k in ("method", "path", "content_type", "body")} for e in CONTRACT["exchanges"]]
    for request in api_server.requests:
        if request["method"] == "GET":
            request["content_type"] = None
    assert api_server.requests == wanted
    assert connector.replicas == {"prefill": 2, "decode": 1}


def test_a_refused_request_is_a_connector_error_naming_the_deployment(api_server: FakeAPIServer) -> None:
    api = client.AppsV1Api(client.ApiClient(client.Configuration(host=api_server.url)))
    connector = KubernetesConnector(FakeEtcd([]), "elsewhere", {"prefill": "neuron-di-prefill"}, api)  # type: ignore[arg-type]
    with pytest.raises(ConnectorError, match="'neuron-di-prefill' in namespace 'elsewhere': 404"):
        asyncio.run(connector.fleet())
