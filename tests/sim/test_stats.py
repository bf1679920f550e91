from epp.sim.stats import LoraInfoHistory


def test_lora_history_is_bounded_and_most_recent_last() -> None:
    history = LoraInfoHistory()
    for i in range(40):
        history.touch(f"a{i % 20}", "")
    history.touch("a5", "b")
    # vLLM 0.32 keeps one series per combination ever seen (a gauge never cleared): all 21 stay, not the
    # 16 most recent the simulator used to keep; the bound is now far above any test's use.
    assert len(history) == 21
    assert next(reversed(history)) == ("a5", "b")
    assert max(history.items(), key=lambda kv: kv[1])[0] == ("a5", "b")
    for i in range(5000):
        history.touch(f"x{i}", "")
    assert len(history) == 4096  # still bounded: the oldest combinations go first
    assert ("a5", "b") not in history and next(reversed(history)) == ("x4999", "")
