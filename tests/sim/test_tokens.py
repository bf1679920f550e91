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
