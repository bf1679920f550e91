"""The project as a newcomer meets it: the wheel's layout, the container, the demo command."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_installs_plugins_under_the_epp_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("epp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "epp/plugins/__init__.py" in names
    assert "epp/plugins/picker/random.py" in names
    assert "epp/py.typed" in names
    assert "epp/scheduling/default-config.yaml" in names  # read at startup when no config is given
    assert "epp/prefix/_native.pyi" in names
    assert not [n for n in names if n.startswith("plugins/")]  # never a bare top-level plugins package
    assert [n for n in names if n.startswith("epp/prefix/_native.") and n.endswith((".so", ".pyd"))]  # the C extension, built
    assert not [n for n in names if n.startswith("plugins/")]  # never a bare top-level `plugins`
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "epp = epp.server.cli:main" in entry_points


def test_dockerfile_is_multi_stage_slim_non_root_with_the_upstream_ports() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(stages) >= 2 and "slim" in stages[-1]  # the build stage has a compiler; what runs is slim
    assert re.search(r"^COPY pyproject.toml setup.py ", text, re.M)  # setup.py declares the C extension
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("root", "0:", "0 ")) and user[-1] != "0"
    assert re.search(r"^EXPOSE 9002 9003 9090$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["epp", "serve"\]$', text, re.M)


def test_demo_routes_requests_through_envoy_and_reports_where_they_went() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "epp", "demo", "--once", "--port", "0", "--pods", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if re.match(r"^  \S.*\s(200|400)\s", line)]
    served = [row for row in rows if "200" in row]
    assert len(served) == 6
    # The model list is the picker's own answer (the pool's union); every other request reached a pod.
    assert [row[:2] for row in served if "picker" in row] == [["list", "models"]]
    assert all(any(cell.startswith("pod-") for cell in row) for row in served if row[:2] != ["list", "models"])
    assert any("400" in row and "picker" in row and "JSON" in " ".join(row) for row in rows)
    # The prefix effect: each prompt family's later requests follow its first to the same pod and
    # find their prefix cached there.
    summary = re.findall(r"^  (.+): first request (\d+)ms on (pod-\d+); (\d+) of the next (\d+) on", result.stdout, re.M)
    assert len(summary) == 2 and all(same == following for *_, same, following in summary), result.stdout
    hits = re.findall(r"(pod-\d+)\s+\d+ms  (\d+)/(\d+)$", result.stdout, re.M)
    assert len(hits) == 6 and sum(int(h) > 0 for _, h, _ in hits) == 4, result.stdout
