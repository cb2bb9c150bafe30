"""``LLM``: load a model, size a paged KV cache, generate with continuous batching.

    llm = LLM("path/to/hf_dir" | "model.gguf" | transformers_model, block_size=16)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    for delta in llm.stream("Hello", SamplingParams(max_tokens=8)): print(delta.text, end="")

The engine state (KV cache, prefix cache) persists across calls.
"""

from __future__ import annotations

import itertools
from typing import Iterator, List, Optional, Sequence as Seq, Union

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVCache, bytes_per_block
from ..model.loader import load_model
from .params import RequestOutput, SamplingParams, TokenDelta
from .runner import Runner, sample
from .scheduler import Scheduler
from .sequence import Sequence

Prompt = Union[str, List[int]]
DEFAULT_KV_MEMORY = 1 << 30  # 1 GiB when neither kv_cache_memory nor num_blocks is given


class LLM:
    def __init__(self, model, *, block_size: int = 16, max_model_len: Optional[int] = None,
                 kv_cache_memory: Optional[int] = None, num_blocks: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None, tokenizer=None, device=None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 enable_prefix_caching: bool = True, hash_fn=hash, paged_backend: str = "auto"):
        if kv_cache_memory is not None and num_blocks is not None:
            raise ValueError("give kv_cache_memory (bytes) or num_blocks, not both")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        if isinstance(dtype, str):
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
            dtype = getattr(torch, dtype)
        self.dtype = dtype
        self.model, self.config, tok = load_model(model, dtype=dtype, device=self.device)
        self.tokenizer = tokenizer if tokenizer is not None else tok
        cfg = self.config
        if num_blocks is None:
            num_blocks = int(kv_cache_memory or DEFAULT_KV_MEMORY) // bytes_per_block(
                cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, dtype)
        if num_blocks < 1:
            raise ValueError(f"a KV cache of {kv_cache_memory} bytes holds no block of {block_size} tokens; "
                             f"give more kv_cache_memory or a smaller block_size")
        capacity = num_blocks * block_size
        window = cfg.sliding_window or float("inf")  # within the window, full attention is exact
        if max_model_len is None:
            max_model_len = int(min(cfg.max_position_embeddings, capacity, window))
        if max_model_len > window:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's sliding_window={window}, "
                             f"which ringkv does not implement; use max_model_len <= {window}")
        if max_model_len > capacity:
            raise ValueError(f"max_model_len={max_model_len} needs more KV cache than the {num_blocks} blocks "
                             f"of {block_size} tokens ({capacity} tokens); raise kv_cache_memory/num_blocks")
        self.max_model_len = max_model_len
        self.kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size=block_size,
                          num_blocks=num_blocks, dtype=dtype, device=self.device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                   hash_fn=hash_fn)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self.runner = Runner(self.model, self.kv, self.device, paged_backend)
        self.eos_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self._ids = itertools.count()

    # -- stats -----------------------------------------------------------------------------
    @property
    def prefix_cache_hits(self) -> int:
        """Blocks served from the prefix cache so far."""
        return self.blocks.hits

    # -- requests --------------------------------------------------------------------------
    def _tokenize(self, prompt, apply_chat_template: bool) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer=... to LLM or give token ids")
            if apply_chat_template:
                return list(self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                    return_dict=False))
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def _make(self, prompt, params: SamplingParams, apply_chat_template: bool, cache_salt=None) -> Sequence:
        """A Sequence, already finished with an error if this request is invalid."""
        ids: List[int] = []
        problem = params.problem() if isinstance(params, SamplingParams) else \
            f"sampling params must be a SamplingParams, got {type(params).__name__}"
        if problem is None:
            if not isinstance(prompt, (str, list, tuple)):
                problem = f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}"
            else:
                ids = self._tokenize(prompt, apply_chat_template)
                problem = self._check_ids(ids)
        seq = Sequence(next(self._ids), prompt, ids if problem is None else [], params if problem is None
                       else SamplingParams(), cache_salt)
        seq.prompt_token_ids = ids
        if problem is not None:
            seq.finish("error", problem)
        return seq

    def _check_ids(self, ids) -> Optional[str]:
        if not ids:
            return "empty prompt: give at least one token"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return "prompt token ids must be ints"
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})"
        if len(ids) >= self.max_model_len:
            return (f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                    f"{self.max_model_len}; shorten it or raise max_model_len")
        return None

    # -- the loop --------------------------------------------------------------------------
    def _append(self, seq: Sequence, token: int) -> None:
        """Add a sampled token and decide whether the sequence is done."""
        p = seq.params
        seq.token_ids.append(token)
        n_out = seq.num_tokens - len(seq.prompt_token_ids)
        if p.stop_strings and self.tokenizer is not None:
            text = self._decode(seq.output_token_ids)
            hits = [text.find(s) for s in p.stop_strings if s in text]
            if hits:
                seq.text = text[:min(hits)]
                seq.finish("stop")
                return
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            seq.finish("stop")
        elif n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish("length")

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def step(self) -> List[Sequence]:
        """One engine step; returns the sequences that advanced by a token."""
        batch = self.scheduler.schedule()
        if not batch:
            raise RuntimeError("scheduler made no progress with requests pending (a bug)")
        logits = self.runner.run(batch)
        done = [s for s in batch if s.completes]
        for s in batch:
            s.seq.num_computed = s.start + s.n
            self.blocks.register(s.seq.block_table, s.seq.token_ids, s.seq.num_computed, s.seq.cache_salt)
        tokens = sample(logits, [s.seq for s in done])
        for s, tok in zip(done, tokens):
            self._append(s.seq, tok)
            if s.seq.finished:
                self.scheduler.finish(s.seq)
        return [s.seq for s in done]

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.finish_reason != "error" and not (seq.finish_reason == "stop" and seq.text):
            seq.text = self._decode(seq.output_token_ids)
        return RequestOutput(seq.seq_id, seq.prompt, seq.prompt_token_ids, seq.output_token_ids, seq.text,
                             seq.finish_reason, seq.error, seq.num_cached_tokens or 0)

    def _requests(self, prompts, params, apply_chat_template, cache_salt) -> List[Sequence]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # one prompt (a string or one list of token ids)
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids or a list of those, "
                            f"got {type(prompts).__name__}")
        if params is None:
            params = SamplingParams()
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                                 f"give one, or one per prompt")
        else:
            params = [params] * len(prompts)
        if isinstance(prompts, (list, tuple)) and any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ValueError("string prompts need a tokenizer: pass tokenizer=... to LLM or give token ids")
        salts = list(cache_salt) if isinstance(cache_salt, (list, tuple)) else [cache_salt] * len(prompts)
        if len(salts) != len(prompts):
            raise ValueError(f"got {len(salts)} cache salts for {len(prompts)} prompts; give one, or one per prompt")
        return [self._make(p, sp, apply_chat_template, salt) for p, sp, salt in zip(prompts, params, salts)]

    def generate(self, prompts, params: Union[SamplingParams, Seq[SamplingParams], None] = None, *,
                 use_tqdm: bool = True, apply_chat_template: bool = False,
                 cache_salt: Union[str, Seq[Optional[str]], None] = None) -> List[RequestOutput]:
        """Generate for every prompt (batched); outputs in prompt order. An invalid request
        gets ``finish_reason="error"`` and an ``error`` message; the others still complete.
        ``cache_salt`` (one, or one per prompt): prefix-cache blocks are shared only between
        requests with the same salt."""
        seqs = self._requests(prompts, params, apply_chat_template, cache_salt)
        live = [s for s in seqs if not s.finished]
        for s in live:
            self.scheduler.add(s)
        bar = None
        if use_tqdm and live:
            try:
                from tqdm import tqdm
                bar = tqdm(total=len(live), desc="generate", unit="req")
            except ImportError:
                pass
        try:
            while any(not s.finished for s in live):
                for s in self.step():
                    if s.finished and bar is not None:
                        bar.update(1)
        except BaseException:
            for s in live:  # leave the engine clean for the next call
                if not s.finished:
                    self.scheduler.finish(s)
                    s.finish("error", "aborted")
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._output(s) for s in seqs]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None, *,
               apply_chat_template: bool = False, cache_salt: Optional[str] = None) -> Iterator[TokenDelta]:
        """Yield each generated token (id and the text it adds) as soon as it is sampled.
        An invalid request raises ``ValueError``."""
        (seq,) = self._requests([prompt], params or SamplingParams(), apply_chat_template, cache_salt)
        if seq.finished:
            raise ValueError(seq.error)
        self.scheduler.add(seq)
        text = ""
        try:
            while not seq.finished:
                if seq not in self.step():
                    continue
                out = seq.output_token_ids
                new_text = seq.text if seq.finish_reason == "stop" and seq.text else self._decode(out)
                if new_text.endswith("\ufffd") and not seq.finished:
                    delta = ""  # half a character: wait for the rest
                else:
                    delta, text = new_text[len(text):], new_text
                yield TokenDelta(out[-1], delta, seq.finish_reason)
        finally:
            if not seq.finished:  # the consumer stopped early
                self.scheduler.finish(seq)
                seq.finish("error", "aborted")
