"""The prefill and decode Deployments' replicas, through the Kubernetes API (the official client).

The fleet counts each Deployment's desired replicas: pods registered in etcd serve, replicas not yet
registered are starting, registered pods past the replicas are stopping. Scaling down is the
Deployment's: it sends SIGTERM to the pods it removes, and our worker drains on SIGTERM within the pod's
terminationGracePeriodSeconds (deploy/kubernetes/). No role flips: a pod's role is its Deployment's.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from planner.actions import Action
from planner.errors import ConnectorError
from planner.fleet import EtcdWorkers, Fleet, Member

log = logging.getLogger("planner.kubernetes")
MERGE_PATCH = "application/merge-patch+json"   # the body sets spec.replicas and nothing else


def default_api() -> Any:
    """AppsV1Api for the cluster the planner runs in, else the current kubeconfig context."""
    from kubernetes import client, config

    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
    else:
        config.load_kube_config()
    return client.AppsV1Api()


class KubernetesConnector:
    can_flip = False
    can_scale = True

    def __init__(self, etcd: EtcdWorkers, namespace: str, deployments: dict[str, str], api: Any = None) -> None:
        self.etcd, self.namespace, self.deployments = etcd, namespace, deployments
        self.api = api if api is not None else default_api()
        self.replicas: dict[str, int] = {}

    async def _read_replicas(self) -> dict[str, int]:
        replicas = {}
        for role, name in self.deployments.items():
            scale = await self._call(self.api.read_namespaced_deployment_scale, name, self.namespace)
            replicas[role] = int(scale.spec.replicas or 0)
        return replicas

    async def fleet(self) -> Fleet:
        self.replicas = await self._read_replicas()
        records = [r for r in await self.etcd.read() if r.role in self.deployments]
        members: list[Member] = []
        for role, wanted in self.replicas.items():
            mine = sorted(r.address for r in records if r.role == role)
            members += [Member(a, role, "serving" if i < wanted else "stopping") for i, a in enumerate(mine)]
            members += [Member(f"{self.deployments[role]}/pending-{i}", role, "starting")
                        for i in range(wanted - len(mine))]
        return Fleet(tuple(members))

    async def apply(self, actions: list[Action]) -> None:
        replicas = dict(self.replicas or await self._read_replicas())
        for action in actions:
            if action.kind == "flip":
                raise ConnectorError(f"cannot {action}: Kubernetes pods keep their Deployment's role")
            replicas[action.role] += 1 if action.kind == "start" else -1
        for role, count in replicas.items():
            if count != self.replicas.get(role):
                name = self.deployments[role]
                await self._call(self.api.patch_namespaced_deployment_scale, name, self.namespace,
                                 {"spec": {"replicas": count}}, _content_type=MERGE_PATCH)
                log.info("deployment %s/%s scaled to %d replicas", self.namespace, name, count)
        self.replicas = replicas

    async def progress(self) -> None:
        """Nothing to follow: the Deployment controller does, and `fleet()` reads where it is."""

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return await asyncio.to_thread(method, *args, **kwargs)
        except ApiException as exc:
            raise ConnectorError(f"Kubernetes API {method.__name__} {args[0]!r} in namespace {self.namespace!r}: "
                                 f"{exc.status} {exc.reason}") from exc
        except (HTTPError, OSError) as exc:
            raise ConnectorError(f"Kubernetes API unreachable: {exc}") from exc

    def under_way(self) -> tuple[list, list]:
        return [], []

    def restore(self, flips: list, starts: list) -> None:
        """Nothing to restore: the Deployments hold the fleet's state."""

    async def close(self) -> None:
        pass
