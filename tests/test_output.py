"""The output processor alone (no model): text, stop strings and their hold-back, finish checks,
deltas, log-probs and RequestOutputs, and that a token costs a short decode, never the whole
output."""

from dataclasses import asdict

from ringkv.engine.output import OutputProcessor, output_from_json
from ringkv.engine.params import Logprob, SamplingParams
from ringkv.engine.sequence import Sequence


class Letters:
    """ids <-> letters (0 = "a"); remembers the longest id list it decoded."""

    eos_token_id = None

    def __init__(self):
        self.longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return "".join(chr(97 + i % 26) for i in ids)


def ids(text):
    return [ord(c) - 97 for c in text]


def sample(params, prompt="ab", rid="r"):
    return Sequence(
        seq_id=0, prompt=prompt, prompt_token_ids=ids(prompt), params=params, request_id=rid
    )


def feed(proc, seq, text):
    for t in ids(text):
        if seq.finished:
            break
        proc.append(seq, t)


def test_stop_string_is_cut_and_its_prefix_held_back():
    tok = Letters()
    proc = OutputProcessor(tok, [], max_model_len=1000)
    seq = sample(SamplingParams(max_tokens=50, stop=["xyz"]))
    feed(proc, seq, "abcxy")
    # the last len("xyz") - 1 characters may start "xyz": held back
    assert seq.out.text == "abcxy" and "".join(seq.out.deltas) == "abc"
    feed(proc, seq, "q")
    assert "".join(seq.out.deltas) == "abcx" and not seq.finished
    feed(proc, seq, "xyzzz")
    assert seq.finish_reason == "stop" and seq.out.text == "abcxyq"
    assert "".join(seq.out.deltas) == seq.out.text  # every character released once
    assert len(seq.out.deltas) == len(seq.output_token_ids)  # one delta per token
    assert tok.longest <= 2  # a window per token, never the whole output


def test_eos_stop_tokens_and_length_finish():
    proc = OutputProcessor(Letters(), [4], max_model_len=10)
    seq = sample(SamplingParams(max_tokens=50))
    feed(proc, seq, "abcde")
    assert seq.finish_reason == "stop" and seq.output_token_ids == ids("abcde")
    seq = sample(SamplingParams(max_tokens=50, ignore_eos=True, stop_token_ids=[5]))
    feed(proc, seq, "abcdef")
    assert seq.finish_reason == "stop" and seq.out.text == "abcdef"
    seq = sample(SamplingParams(max_tokens=3, ignore_eos=True))
    feed(proc, seq, "abcdef")
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 3
    seq = sample(SamplingParams(max_tokens=50, ignore_eos=True))  # max_model_len: 2 + 8
    feed(proc, seq, "abcdefghijkl")
    assert seq.finish_reason == "length" and seq.num_tokens == 10


def test_deltas_add_up_to_the_whole_output_and_prompt_logprobs_come_once():
    proc = OutputProcessor(Letters(), [], max_model_len=1000)
    seq = sample(SamplingParams(max_tokens=4, logprobs=0, prompt_logprobs=0), prompt="abc")
    seq.prompt_logprobs[:] = [-1.0, -2.0]
    parts = []
    for i, t in enumerate(ids("wxyz")):
        proc.append(seq, t, Logprob(t, -0.5 * i))
        parts.append(proc.request_output([seq], delta=True))
    whole = proc.request_output([seq])
    assert "".join(p.text for p in parts) == whole.text == "wxyz"
    assert sum((p.token_ids for p in parts), []) == whole.token_ids == ids("wxyz")
    assert sum((p.logprobs for p in parts), []) == whole.logprobs
    assert parts[0].prompt_logprobs == [-1.0, -2.0] and parts[1].prompt_logprobs is None
    assert [p.finished for p in parts] == [False, False, False, True]
    assert output_from_json(asdict(whole)) == whole  # what torchrun followers get
    deltas = list(proc.token_deltas(seq, 1))
    assert [(d.token_id, d.text, d.finish_reason) for d in deltas] == [
        (ids("x")[0], "x", None),
        (ids("y")[0], "y", None),
        (ids("z")[0], "z", "length"),
    ]


def test_a_restored_sample_goes_on_from_its_text():
    tok = Letters()
    proc = OutputProcessor(tok, [], max_model_len=1000)
    seq = sample(SamplingParams(max_tokens=50))
    seq.token_ids += ids("hello")  # what an import brings
    proc.restore(seq, proc.decode(seq.output_token_ids))
    assert proc.request_output([seq], delta=True).text == ""  # reported where it came from
    tok.longest = 0
    feed(proc, seq, "you")
    assert seq.out.text == "helloyou" and proc.request_output([seq], delta=True).text == "you"
    assert tok.longest <= 2
