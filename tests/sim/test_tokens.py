import json

import numpy as np

from epp.sim.tokens import plan_output, render_chat, render_completion, tokenize


def test_four_bytes_per_token_and_shared_prefix_shares_ids() -> None:
    a, b = tokenize("abcdefgh"), tokenize("abcdXYZW")
    assert len(a) == 2 and len(tokenize("abcdefghi")) == 3
    assert a[0] == b[0] and a[1] != b[1]
    assert np.array_equal(tokenize("x" * 1000), tokenize("x" * 1000))


def test_large_prompt_tokenises() -> None:
    ids = render_completion("lorem ipsum " * 35_000)  # ~420 KB
    assert len(ids) == 1 + 105_000
    assert ids.dtype == np.uint32


def test_output_is_a_pure_function_of_the_request() -> None:
    prompt = render_completion("hello")
    kwargs = {"model": "m", "max_tokens": 50, "ignore_eos": False, "mean_output_tokens": 20}
    one, two = plan_output(prompt, seed=1, **kwargs), plan_output(prompt, seed=1, **kwargs)
    assert one.words == two.words and one.finish_reason == two.finish_reason
    assert plan_output(prompt, seed=2, **kwargs).words != one.words
    assert plan_output(prompt, seed=1, **{**kwargs, "model": "other"}).words != one.words


def test_length_stops_at_eos_or_max_tokens() -> None:
    prompt = render_completion("hello")
    forced = plan_output(prompt, model="m", seed=0, max_tokens=40, ignore_eos=True, mean_output_tokens=2)
    assert len(forced.words) == 40 and forced.finish_reason == "length"
    lengths = [
        len(plan_output(render_completion(str(i)), model="m", seed=0, max_tokens=1000, ignore_eos=False,
                        mean_output_tokens=8).words)
        for i in range(200)
    ]
    assert 4 < sum(lengths) / len(lengths) < 16  # geometric with mean 8
    short = plan_output(prompt, model="m", seed=0, max_tokens=1, ignore_eos=False, mean_output_tokens=100)
    assert len(short.words) == 1


def test_generated_text_tokenises_back_to_the_generated_ids() -> None:
    first = render_chat([("system", "be brief"), ("user", "hi there")])
    plan = plan_output(first, model="m", seed=3, max_tokens=30, ignore_eos=True, mean_output_tokens=10)
    answer = "".join(plan.words)
    assert np.array_equal(tokenize(answer), plan.token_ids)
    assert not answer.startswith(" ") and answer.endswith(".")
    # The next turn quotes the answer: prompt + answer is a prefix of the next prompt.
    second = render_chat([("system", "be brief"), ("user", "hi there"), ("assistant", answer), ("user", "more")])
    seen = np.concatenate((first, plan.token_ids))
    assert np.array_equal(second[: len(seen)], seen)


def _words(rng: np.random.Generator, n: int) -> str:
    stems = rng.integers(97, 123, size=(n, 3), dtype=np.uint8)
    return "".join(stem.tobytes().decode() + " " for stem in stems)


def test_the_model_files_tokenize_as_the_simulator_does(tmp_path) -> None:
    """A picker given write_model_files' directory computes a default simulator's ids: chats growing
    turn by turn (its answers quoted back, a turn's earlier tokens reused, not re-encoded) and
    completions, BOS included; a piece of text outside its words is one unknown token."""
    from epp.prefix.tokenize import ModelTokenizer
    from epp.sim.tokens import write_model_files

    tok = ModelTokenizer.from_dir(str(write_model_files(tmp_path / "model")))
    rng = np.random.default_rng(7)
    history = [("system", _words(rng, 600))]
    for _ in range(6):
        history.append(("user", _words(rng, 40)))
        body = json.dumps({"model": "m", "messages": [{"role": r, "content": c} for r, c in history]})
        ids = tok.request_ids("chat_completions", body.encode())
        assert np.array_equal(ids, render_chat(history))
        answer = plan_output(ids, model="m", seed=1, max_tokens=20, ignore_eos=True, mean_output_tokens=8)
        history.append(("assistant", "".join(answer.words)))
        prompt = _words(rng, 100)
        assert np.array_equal(tok.request_ids("completions", json.dumps({"prompt": prompt}).encode()),
                              render_completion(prompt))  # fmt: skip
    stats = tok.stats()
    assert stats.reused_tokens > stats.encoded_tokens and stats.unmapped == 0
    odd = tok.completion_ids("abc 12345")
    assert len(odd) == 1 + 3 and np.array_equal(odd[:2], render_completion("abc "))
