"""Kubernetes discovery: the pool's endpoints from an InferencePool and its Pods.

* :mod:`epp.kube.pods` - InferencePool and Pod objects to :class:`epp.datalayer.datastore.Endpoint` (pure);
* :mod:`epp.kube.reflector` - list-then-watch of one collection, through 410s, drops and restarts;
* :mod:`epp.kube.discovery` - the pool and Pod reflectors feeding the datastore;
* :mod:`epp.kube.client` - kubeconfig or in-cluster configuration.

The client library is kubernetes_asyncio: the generated client of the Kubernetes project's own
OpenAPI, released with each Kubernetes version, built on aiohttp (already the picker's HTTP stack,
so no second one), exposing every list/watch parameter (``resourceVersion``,
``allowWatchBookmarks``, ``timeoutSeconds``, selectors) and raw responses, and loading kubeconfig
(contexts, client certificates, exec plugins) and in-cluster service-account config with token
rotation. It is imported only when discovery is on: a static pool does not pay its ~0.5 s import.
"""

from epp.kube.client import KubeConfigError
from epp.kube.discovery import Discovery
from epp.kube.pods import PoolSpec, PoolSpecError, parse_selector, parse_target_ports

__all__ = ["Discovery", "KubeConfigError", "PoolSpec", "PoolSpecError", "parse_selector", "parse_target_ports"]
