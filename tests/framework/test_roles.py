"""epp.framework.roles: what startup reads of a plugin's declarations."""

from __future__ import annotations

from epp.framework.roles import reads_body
from plugins.producer.precise_prefix_cache import PrecisePrefixCacheProducer
from plugins.scorer.queue import QueueScorer


def test_a_plugin_reads_the_body_as_it_declares_else_if_it_is_not_one_of_epps_own() -> None:
    class Declares:
        reads_body = False

    class Silent:
        pass

    assert reads_body(Declares()) is False
    assert reads_body(Silent()) is True  # a third party's that does not say: it gets the body
    assert reads_body(QueueScorer("q")) is False  # epp's own say when they do
    assert reads_body(PrecisePrefixCacheProducer.__new__(PrecisePrefixCacheProducer)) is True
