from epp.sim.stats import LoraInfoHistory


def test_lora_history_is_bounded_and_most_recent_last() -> None:
    history = LoraInfoHistory()
    for i in range(40):
        history.touch(f"a{i % 20}", "")
    history.touch("a5", "b")
    assert len(history) == 16
    assert next(reversed(history)) == ("a5", "b")
    assert max(history.items(), key=lambda kv: kv[1])[0] == ("a5", "b")
