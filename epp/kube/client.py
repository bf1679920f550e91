"""Where the Kubernetes API is and how to authenticate to it: kubeconfig or in-cluster config.

The order is controller-runtime's (what the upstream picker does): the ``--kubeconfig`` flag, then
the ``KUBECONFIG`` environment variable, then the in-cluster service account (the
``KUBERNETES_SERVICE_HOST``/``_PORT`` environment and the mounted token and CA), then
``~/.kube/config``. The client library (kubernetes_asyncio) does the reading: kubeconfig contexts,
client certificates, exec credential plugins, and the in-cluster token, re-read from its file every
minute so rotated service-account tokens keep working.

Any failure to find or read a configuration is a :class:`KubeConfigError` that says what was tried;
it stops startup, and the CLI reports it as an invalid configuration (exit status 2), as it does the
config file's errors. It is a ``ValueError`` of its own: this layer knows nothing of the config file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

__all__ = ["SERVICE_ACCOUNT_DIR", "KubeConfigError", "api_client"]

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeConfigError(ValueError):
    """No usable Kubernetes client configuration."""


async def api_client(
    kubeconfig: str = "",
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> ApiClient:
    """An ApiClient for the first configuration found (see the module docstring)."""
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.config.config_exception import ConfigException

    environ = os.environ if environ is None else environ
    configuration = client.Configuration()
    try:
        if kubeconfig or environ.get("KUBECONFIG"):
            source = kubeconfig or environ["KUBECONFIG"]
            where = f"kubeconfig {source}" + ("" if kubeconfig else " (from $KUBECONFIG)")
            paths = [path for path in source.split(os.pathsep) if path]
            if not any(Path(path).expanduser().is_file() for path in paths):
                raise KubeConfigError(f"{where}: no such file")
            await config.load_kube_config(config_file=source, client_configuration=configuration, persist_config=False)
        elif environ.get("KUBERNETES_SERVICE_HOST"):
            where = "in-cluster configuration"
            config.load_incluster_config(
                client_configuration=configuration,
                token_filename=str(service_account_dir / "token"),
                cert_filename=str(service_account_dir / "ca.crt"),
                environ=dict(environ),
            )
        else:
            default = Path("~/.kube/config").expanduser()
            where = f"kubeconfig {default}"
            if not default.is_file():
                raise KubeConfigError(
                    "no Kubernetes configuration: give --kubeconfig or $KUBECONFIG, or run in a cluster "
                    f"(KUBERNETES_SERVICE_HOST is not set and {default} does not exist)"
                )
            await config.load_kube_config(
                config_file=str(default), client_configuration=configuration, persist_config=False
            )
    except ConfigException as exc:
        raise KubeConfigError(f"{where}: {exc}") from exc
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError) as exc:
        if isinstance(exc, KubeConfigError):
            raise
        raise KubeConfigError(f"{where}: cannot be read: {exc}") from exc
    return client.ApiClient(configuration)
