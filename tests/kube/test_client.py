"""Client configuration (epp.kube.client): kubeconfig by flag or $KUBECONFIG, in-cluster, and clear errors."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

import epp.server.server
from epp.datalayer.datastore import Datastore
from epp.kube.client import KubeConfigError, api_client
from epp.kube.discovery import Discovery
from epp.testing.fake_apiserver import FakeApiServer, make_pod, make_pool, make_tls
from tests.conftest import TOKEN


async def _cli_reports(
    error: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """What ``epp serve`` does when serving raises ``error``: its exit status and what it logs."""
    from epp.server.cli import main

    async def serve(settings: object, **options: object) -> None:
        raise error

    monkeypatch.setattr(epp.server.server, "serve", serve)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        # In a thread: main runs its own event loop.
        status = await asyncio.to_thread(main, ["serve", "--pool-name", "p", "--metrics-port", "-1"])
    finally:
        root.handlers[:] = handlers  # main configures logging for the whole process
        root.setLevel(level)
    return status, capsys.readouterr().err


async def _pod_names(client: object) -> list[str]:
    from kubernetes_asyncio.client import CoreV1Api

    try:
        pods = await CoreV1Api(client).list_namespaced_pod("default")
        return [pod.metadata.name for pod in pods.items]
    finally:
        await client.close()  # type: ignore[attr-defined]


async def test_kubeconfig_flag(api: FakeApiServer, kubeconfig: Path) -> None:
    api.apply(make_pod("a"))
    assert await _pod_names(await api_client(str(kubeconfig), environ={})) == ["a"]
    assert api.requests[-1].path == "/api/v1/namespaces/default/pods"


async def test_kubeconfig_from_the_environment(api: FakeApiServer, kubeconfig: Path, tmp_path: Path) -> None:
    api.apply(make_pod("a"))
    # a list of files as kubectl takes it; a missing one is skipped
    environ = {"KUBECONFIG": f"{tmp_path / 'absent'}:{kubeconfig}", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert await _pod_names(await api_client("", environ=environ)) == ["a"]


async def test_in_cluster_service_account_over_tls(tmp_path: Path) -> None:
    context, ca = make_tls(tmp_path)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "ca.crt").write_bytes(ca.read_bytes())
    async with FakeApiServer(token=TOKEN, ssl_context=context) as api:
        api.apply(make_pod("a"))
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
        client = await api_client("", environ=environ, service_account_dir=account)
        assert client.configuration.host == api.url and api.url.startswith("https://")
        assert await _pod_names(client) == ["a"]  # TLS verified against ca.crt, bearer token from the file


async def test_discovery_through_in_cluster_config(tmp_path: Path) -> None:
    context, ca = make_tls(tmp_path)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "ca.crt").write_bytes(ca.read_bytes())
    async with FakeApiServer(token=TOKEN, ssl_context=context) as api:
        api.apply(make_pool("pool", {"app": "vllm"}, [8000]))
        api.apply(make_pod("a", "10.0.0.1", labels={"app": "vllm"}))
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api.port)}
        client = await api_client("", environ=environ, service_account_dir=account)
        discovery = Discovery(Datastore(), namespace="default", pool_name="pool", client=client)
        await discovery.start()
        try:
            await discovery.wait_synced()
            assert [e.name for e in discovery.datastore.endpoints()] == ["a-rank-0"]
        finally:
            await discovery.stop()
            await client.close()


@pytest.mark.parametrize(
    ("kubeconfig", "environ", "message"),
    [
        ("/nonexistent/kubeconfig", {}, "kubeconfig /nonexistent/kubeconfig: no such file"),
        ("", {"KUBECONFIG": "/nonexistent/a:/nonexistent/b"}, "(from $KUBECONFIG): no such file"),
        ("", {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}, "in-cluster configuration"),
        ("", {"HOME": "/nonexistent-home"}, "no Kubernetes configuration: give --kubeconfig"),
    ],
)
async def test_missing_configuration_is_a_clear_error(
    kubeconfig: str,
    environ: dict[str, str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HOME", environ.get("HOME", str(tmp_path)))  # no ~/.kube/config
    with pytest.raises(KubeConfigError) as info:
        await api_client(kubeconfig, environ=environ, service_account_dir=tmp_path / "no-account")
    assert message in str(info.value)
    # The CLI's "invalid configuration", exit status 2.
    status, log = await _cli_reports(info.value, monkeypatch, capsys)
    assert status == 2
    assert f"invalid configuration: {info.value}" in log


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not yaml: [", "cannot be read"),
        ('{"apiVersion": "v1", "kind": "Config", "clusters": [], "contexts": [], "users": []}', "kubeconfig"),
    ],
)
async def test_malformed_kubeconfig_is_a_clear_error(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    with pytest.raises(KubeConfigError) as info:
        await api_client(str(path), environ={})
    assert str(path) in str(info.value) and message in str(info.value)
