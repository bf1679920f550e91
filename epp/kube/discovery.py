"""Kubernetes discovery: keep the datastore equal to the ready endpoints of one InferencePool.

Two modes, as upstream:

* **InferencePool** (``--pool-name``, ``--pool-namespace``): one :class:`~epp.kube.reflector.Reflector`
  watches the pool itself (a list/watch with ``fieldSelector=metadata.name=<pool>``, so the RBAC is
  list/watch on ``inferencepools`` in one namespace); a second one watches the Pods its
  ``spec.selector.matchLabels`` selects. When the selector changes, the Pod reflector is replaced
  by one for the new selector, which re-lists; until that list arrives the previous endpoints stay
  (no empty-pool blip). When only ``targetPorts`` changes, the endpoints are recomputed from the
  Pod copy, which already holds every Pod the selector matches (a re-list would fetch the same
  Pods). A deleted pool empties the datastore (upstream clears it too); an invalid one (which the
  CRD's validation makes unlikely) is logged and the previous pool kept.
* **No CRD** (``--endpoint-selector k=v,... --endpoint-target-ports 8000,...``): only the Pod
  reflector, with the selector and ports from the flags.

After every change the whole endpoint set is recomputed (:func:`epp.kube.pods.endpoints_for`) and
handed to :meth:`Datastore.replace`, which diffs it: unchanged endpoints keep their metrics, the
scraper starts and stops loops for the rest, and readiness follows.

InferenceObjectives (InferencePool mode only, as upstream): a third reflector lists and watches
the ``inferenceobjectives`` of the pool's namespace; after every change (and when the pool's labels
change, for objectives that select pools by label) the priorities of those that reference the pool
(:func:`epp.kube.objectives.objective_priorities`) replace the discovered set of the
:class:`~epp.flowcontrol.objectives.Objectives` given as ``objectives``. Readiness does not wait for
them; a cluster without the CRD logs the reflector's retries and keeps the configured objectives.

Readiness waits for the first full sync: the datastore is not written until the pool has been
listed and, if it exists, its Pods too, so gRPC health stays NOT_SERVING until then; :attr:`synced`
and :meth:`wait_synced` say when it happened.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from epp.datalayer.datastore import Datastore
from epp.framework import Endpoint
from epp.kube.client import api_client
from epp.kube.objectives import OBJECTIVE_GROUP, OBJECTIVE_PLURAL, OBJECTIVE_VERSION, objective_priorities
from epp.kube.pods import PoolSpec, PoolSpecError, endpoints_for, pool_spec
from epp.kube.reflector import WATCH_TIMEOUT_RANGE, Backoff, ListCall, Reflector

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

    from epp.flowcontrol.objectives import Objectives

__all__ = ["POOL_GROUP", "POOL_PLURAL", "POOL_VERSION", "Discovery"]

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"


class Discovery:
    """Fills ``datastore`` from the Kubernetes API; ``await start()``, ``await stop()``.

    Give ``pool_name`` (InferencePool mode) or ``spec`` (no-CRD mode). ``client`` is for tests that
    bring their own ApiClient; otherwise one is built from ``kubeconfig`` (see :mod:`epp.kube.client`).
    """

    def __init__(
        self,
        datastore: Datastore,
        *,
        namespace: str,
        pool_name: str = "",
        spec: PoolSpec | None = None,
        kubeconfig: str = "",
        client: ApiClient | None = None,
        backoff: tuple[float, float] = (0.1, 30.0),
        watch_timeout: tuple[float, float] = WATCH_TIMEOUT_RANGE,
        objectives: Objectives | None = None,
    ) -> None:
        if bool(pool_name) == (spec is not None):
            raise ValueError("give either pool_name or spec")
        self.datastore = datastore
        self.namespace = namespace
        self.pool_name = pool_name
        self.kubeconfig = kubeconfig
        self._client = client
        self._own_client = client is None
        self._backoff = backoff
        self._watch_timeout = watch_timeout
        self._fixed = spec is not None
        self.spec: PoolSpec | None = spec
        self.pool_reflector: Reflector | None = None
        self.pod_reflector: Reflector | None = None
        self.objectives = objectives
        self.objective_reflector: Reflector | None = None
        self._pool_labels: dict[str, str] = {}
        self._pod_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._synced = asyncio.Event()
        self._missing_logged = False

    @property
    def synced(self) -> bool:
        """True once the pool (and its Pods) have been listed: the datastore is complete."""
        return self._synced.is_set()

    async def wait_synced(self) -> None:
        await self._synced.wait()

    @property
    def description(self) -> str:
        if self._fixed:
            assert self.spec is not None
            return f"pods matching {self.spec.label_selector} in namespace {self.namespace}"
        return f"InferencePool {self.namespace}/{self.pool_name}"

    @property
    def client(self) -> Any:
        """The kubernetes_asyncio ApiClient once connected (None before): other API calls share its credentials."""
        return self._client

    async def connect(self) -> None:
        """Load the client configuration; a bad one raises :class:`~epp.kube.client.KubeConfigError`."""
        if self._client is None:
            self._client = await api_client(self.kubeconfig)

    async def start(self) -> None:
        """Start watching in the background (connecting first if :meth:`connect` was not called)."""
        await self.connect()
        assert self._client is not None
        from kubernetes_asyncio.client import CoreV1Api, CustomObjectsApi

        self._core = CoreV1Api(self._client)
        if self._fixed:
            assert self.spec is not None
            self._watch_pods(self.spec)
        else:
            custom = CustomObjectsApi(self._client)
            list_pool = functools.partial(
                custom.list_namespaced_custom_object,
                POOL_GROUP,
                POOL_VERSION,
                self.namespace,
                POOL_PLURAL,
                field_selector=f"metadata.name={self.pool_name}",
            )
            self.pool_reflector = self._reflector(self.description, list_pool, self._pool_changed)
            self._spawn(self.pool_reflector.run(), "epp-discovery-pool")
            if self.objectives is not None:
                list_objectives = functools.partial(
                    custom.list_namespaced_custom_object,
                    OBJECTIVE_GROUP,
                    OBJECTIVE_VERSION,
                    self.namespace,
                    OBJECTIVE_PLURAL,
                )
                self.objective_reflector = self._reflector(
                    f"{OBJECTIVE_PLURAL} in {self.namespace}", list_objectives, self._objectives_changed
                )
                self._spawn(self.objective_reflector.run(), "epp-discovery-objectives")
        host = getattr(self._client.configuration, "host", "?")
        log.info("discovery: watching %s at %s", self.description, host)

    async def stop(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None and self._own_client:
            await self._client.close()
            self._client = None

    def _reflector(self, what: str, list_call: ListCall, on_change: Callable[[], None]) -> Reflector:
        return Reflector(
            what, list_call, on_change, backoff=Backoff(*self._backoff), watch_timeout=self._watch_timeout
        )

    def _spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_log_crash)
        return task

    def _watch_pods(self, spec: PoolSpec) -> None:
        """(Re)start the Pod reflector for ``spec``'s selector; the old one's objects stay published until the
        new one lists."""
        if self._pod_task is not None:
            self._pod_task.cancel()
        list_pods = functools.partial(
            self._core.list_namespaced_pod, self.namespace, label_selector=spec.label_selector
        )

        def on_change() -> None:  # names its own reflector, to ignore one that is being replaced
            self._pods_changed(reflector)

        reflector = self._reflector(f"pods {spec.label_selector} in {self.namespace}", list_pods, on_change)
        self.pod_reflector = reflector
        self._pod_task = self._spawn(reflector.run(), "epp-discovery-pods")

    def _stop_pods(self) -> None:
        if self._pod_task is not None:
            self._pod_task.cancel()
        self._pod_task = None
        self.pod_reflector = None

    def _objectives_changed(self) -> None:
        if self.objective_reflector is None or self.objectives is None:
            return
        table = objective_priorities(self.objective_reflector.objects.values(), self.pool_name, self._pool_labels)
        if table != self.objectives.discovered:
            log.info(
                "discovery: InferenceObjectives for %s: %s",
                self.description,
                ", ".join(f"{name}={priority}" for name, priority in sorted(table.items())) or "none",
            )
        self.objectives.set_discovered(table)

    def _pool_changed(self) -> None:
        assert self.pool_reflector is not None
        pool = self.pool_reflector.objects.get(self.pool_name)
        labels = dict(((pool or {}).get("metadata") or {}).get("labels") or {})
        if labels != self._pool_labels:
            self._pool_labels = labels
            self._objectives_changed()  # objectives may select the pool by label
        if pool is None:
            if not self._missing_logged:
                log.warning(
                    "discovery: %s does not exist (yet); the pool is empty until it does", self.description
                )
                self._missing_logged = True
            self.spec = None
            self._stop_pods()
            self._publish([])
            return
        self._missing_logged = False
        try:
            spec = pool_spec(pool)
        except PoolSpecError as exc:
            keeping = "keeping the previous pool" if self.spec else "waiting for a valid pool"
            log.error("discovery: %s; %s", exc, keeping)
            return
        previous, self.spec = self.spec, spec
        if previous is None or spec.selector != previous.selector or self.pod_reflector is None:
            log.info(
                "discovery: %s selects pods %s, target ports %s",
                self.description,
                spec.label_selector,
                ",".join(map(str, spec.target_ports)),
            )
            self._watch_pods(spec)
        elif spec.target_ports != previous.target_ports:
            log.info("discovery: %s target ports are now %s", self.description, ",".join(map(str, spec.target_ports)))
            assert self.pod_reflector is not None
            if self.pod_reflector.synced:
                self._publish(endpoints_for(self.pod_reflector.objects.values(), spec.target_ports))

    def _pods_changed(self, reflector: Reflector) -> None:
        if reflector is not self.pod_reflector or self.spec is None:
            return  # a reflector being replaced (its selector changed)
        self._publish(endpoints_for(reflector.objects.values(), self.spec.target_ports))

    def _publish(self, endpoints: list[Endpoint]) -> None:
        before = {e.name: e for e in self.datastore.endpoints()}
        after = {e.name: e for e in endpoints}
        if not self._synced.is_set():
            self._synced.set()
            log.info("discovery: first sync of %s: %d endpoint(s)", self.description, len(endpoints))
        for name in sorted(after.keys() - before.keys()):
            log.info("discovery: endpoint %s (%s) added", name, after[name].hostport)
        for name in sorted(before.keys() - after.keys()):
            log.info("discovery: endpoint %s (%s) removed", name, before[name].hostport)
        self.datastore.replace(endpoints)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("discovery task %s failed", task.get_name(), exc_info=task.exception())
