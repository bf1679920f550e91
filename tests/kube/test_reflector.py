"""The reflector's own parts; its list/watch behaviour against an API server is in test_discovery.py."""

from epp.kube.reflector import Backoff


def test_backoff_grows_and_is_bounded() -> None:
    backoff = Backoff(0.1, 2.0)
    delays = [backoff.next() for _ in range(30)]
    assert all(0 < d <= 2.0 for d in delays)
    assert max(delays[:2]) <= 0.2 < max(delays[-5:])  # it grows to the cap
    backoff.reset()
    assert backoff.next() <= 0.1
