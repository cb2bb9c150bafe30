"""``OutputProcessor``: what a request's tokens become for its caller.

The step pipeline hands it each sampled token (``append``) and each step's prompt log-probs
(``prompt_logprobs``); it keeps per sample an ``OutputState`` (``Sequence.out``, defined in
``sequence.py``): the text so far, decoded incrementally (``detok.py``: a short window per
token, never the whole output), cut before a stop string, and the text each token released
(``deltas``), holding back what could still turn out to start a stop string. It decides when a
sample is done (a stop string, an EOS or stop token, ``max_tokens``, ``max_model_len``) and
builds ``RequestOutput`` objects, whole or as deltas (only what is new since the request's
previous delta output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator, List, Optional

from .detok import IncrementalDetokenizer
from .params import CompletionOutput, Logprob, RequestOutput, TokenDelta
from .sequence import OutputState  # noqa: F401  (it lived here before #55; a sequence owns it)

if TYPE_CHECKING:
    from .scheduler import Scheduled
    from .sequence import Sequence


class OutputProcessor:
    """Tokens to text, stop checks and ``RequestOutput`` objects for one engine. ``tokenizer``
    may be None (token ids only, no text); ``eos_ids`` end a sample unless it ignores EOS."""

    def __init__(self, tokenizer, eos_ids: Iterable[int], max_model_len: int):
        self.tokenizer, self.eos_ids, self.max_model_len = tokenizer, set(eos_ids), max_model_len

    # -- per token -------------------------------------------------------------------------
    def append(self, seq: "Sequence", token: int, logprob: Optional[Logprob] = None) -> None:
        """Add a sampled token, its log-prob and the text it adds, and decide whether the sample
        is done."""
        p, st = seq.params, seq.out
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        stops = p.stop_strings if self.tokenizer is not None else []
        if self.tokenizer is not None:
            st.detok = st.detok or IncrementalDetokenizer(self.tokenizer)
            piece = st.detok.step(seq.output_token_ids)
            st.text += piece
            if stops:  # only a stop string that overlaps the new text can be new
                start = max(0, len(st.text) - len(piece) - max(map(len, stops)) + 1)
                hits = [i for i in (st.text.find(x, start) for x in stops) if i >= 0]
                if hits:
                    st.text = st.text[: min(hits)]
                    seq.finish("stop")
        if not seq.finished:
            if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
                seq.finish("stop")
            elif (
                seq.num_tokens - len(seq.prompt_token_ids) >= p.max_tokens
                or seq.num_tokens >= self.max_model_len
            ):
                seq.finish("length")
            if seq.finished and self.tokenizer is not None:  # a character the last tokens left open
                st.text += st.detok.flush(seq.output_token_ids)
        # release the new text, but hold back what could still turn out to start a stop string
        hold = 0 if seq.finished or not stops else max(map(len, stops)) - 1
        upto = max(st.emitted, len(st.text) - hold)
        st.deltas.append(st.text[st.emitted : upto])
        st.emitted = upto

    @staticmethod
    def prompt_logprobs(batch: List["Scheduled"], rows: list) -> None:
        """Write a step's prompt log-probs into its sequences: per target position of the batch,
        in order, a float (the prompt token's log-prob) or ``[value, top ids..., top values...]``
        (the request also asks for its ``prompt_logprobs`` most likely tokens there)."""
        it = iter(rows)
        for s in batch:
            seq, k = s.seq, s.seq.params.prompt_logprobs or 0
            for j in range(s.targets):  # row j is the log-prob of prompt token start + j + 1
                row = next(it)
                if isinstance(row, float):
                    seq.prompt_logprobs[s.start + j] = row
                    continue
                top = (len(row) - 1) // 2
                seq.prompt_logprobs[s.start + j] = row[0]
                if k:
                    seq.prompt_top[s.start + j] = [
                        (int(t), v) for t, v in zip(row[1 : 1 + k], row[1 + top : 1 + top + k])
                    ]

    # -- what callers get ------------------------------------------------------------------
    @staticmethod
    def token_deltas(seq: "Sequence", start: int) -> Iterator[TokenDelta]:
        """One ``TokenDelta`` per output token from the ``start``-th on, up to the newest one
        when the iterator gets there (its id, the text it released; the last one of a
        finished sample carries the finish reason)."""
        deltas, i = seq.out.deltas, start
        while i < len(deltas):
            last = seq.finished and i == len(deltas) - 1
            yield TokenDelta(
                seq.output_token_ids[i], deltas[i], seq.finish_reason if last else None
            )
            i += 1

    @staticmethod
    def request_output(seqs: List["Sequence"], delta: bool = False) -> RequestOutput:
        """The ``RequestOutput`` of a request's samples. ``delta``: only what is new since its
        previous delta output (token ids, text, log-probs; prompt log-probs in the first)."""
        outs = []
        for s in seqs:
            st = s.out
            k = st.reported if delta else 0  # output tokens already reported
            start = len(s.prompt_token_ids) + k
            text = "".join(st.deltas[k:]) if delta else st.text
            lps = s.logprobs[k:] if s.params.logprobs is not None else None
            outs.append(
                CompletionOutput(
                    index=s.index,
                    token_ids=s.token_ids[start:],
                    text=text,
                    finish_reason=s.finish_reason,
                    logprobs=lps,
                )
            )
            if delta:
                st.reported = s.num_tokens - len(s.prompt_token_ids)
        first = seqs[0]
        plp = None if delta and first.out.reported_prompt else first.prompt_logprobs
        ptop = None if plp is None else first.prompt_top
        first.out.reported_prompt = first.out.reported_prompt or delta
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            token_ids=outs[0].token_ids,
            text=outs[0].text,
            finish_reason=outs[0].finish_reason,
            error=first.error,
            num_cached_tokens=first.num_cached_tokens or 0,
            logprobs=outs[0].logprobs,
            outputs=outs,
            prompt_logprobs=plp,
            prompt_top_logprobs=ptop,
        )

    # -- a request that moved in -----------------------------------------------------------
    def decode(self, ids: List[int]) -> Optional[str]:
        """The text of output tokens ``ids`` (None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def restore(self, seq: "Sequence", text: Optional[str]) -> None:
        """A sample imported with its output tokens (``text``: theirs, from ``decode``) goes on
        from there: its text so far is reported as sent, the detokenizer starts past it."""
        st, n = seq.out, len(seq.output_token_ids)
        if text is not None:
            st.text, st.detok = text, IncrementalDetokenizer(self.tokenizer, start=n)
        st.deltas, st.emitted, st.reported = [""] * n, len(st.text), n


def output_from_json(d: dict) -> RequestOutput:
    """A ``RequestOutput`` as ``dataclasses.asdict`` wrote it (torchrun followers get the
    driver's outputs)."""

    def lp(xs):
        if xs is None:
            return None
        return [Logprob(x["token_id"], x["logprob"], [tuple(t) for t in x["top"]]) for x in xs]

    outs = [CompletionOutput(**dict(o, logprobs=lp(o["logprobs"]))) for o in d.pop("outputs")]
    top = d.get("prompt_top_logprobs")  # prompt_logprobs: floats, as they are
    top = None if top is None else [None if x is None else [tuple(t) for t in x] for x in top]
    return RequestOutput(
        **dict(d, logprobs=lp(d["logprobs"]), outputs=outs, prompt_top_logprobs=top)
    )
