"""A llama_cpp.Llama whose layers run elsewhere: the head's face to the user.

llama-cpp-python samples straight from a llama.cpp context's logits (`llama_sampler_sample(ctx, -1)`), so each
RingLlama keeps one real context, over the output-only window [n_layer, n_layer), and the session hands it the
logits the ring's driver computed for its rows (Window.set_logits): the driver runs the output layer once for the
rows of every request in a trip (head/batching.py). Everything above `eval` (tokenizer, chat templates, samplers,
grammars, logprobs, streaming, prefix reuse, the OpenAI-compatible server) is llama-cpp-python's own code.

Llama.__init__ would load the whole model; while it runs, its `LlamaModel` and `LlamaContext` are swapped for
two wrappers over the head's windowed model and its output-only window (for this thread only).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import llama_cpp
import llama_cpp._internals as _internals
import llama_cpp.llama as _llama_module
import numpy as np

from primaplug.core.errors import PrimaplugError
from primaplug.decoding import SamplingParams, accept_or_resample
from primaplug.engine.chat_formats import choose_chat_format
from primaplug.engine.model import ContextSettings, Model, Window
from primaplug.engine.speculative import Speculation, target_probs
from primaplug.engine.structured import json_schema_format

log = logging.getLogger(__name__)


class Session(Protocol):
    """The conversation on the ring: what the head's context hands its tokens and KV operations to
    (primaplug.head.Session fits)."""

    def eval(self, tokens: Sequence[int], pos0: int, *, all_rows: bool = False, hidden: bool = False,
             output: Callable[[np.ndarray, int], None] | None = None) -> None: ...

    def rewind(self, pos: int) -> None: ...

    def clear(self) -> None: ...

    def can_rewind(self, pos: int) -> bool: ...


_GENERATE = inspect.signature(llama_cpp.Llama.generate)
_COMPLETION = inspect.signature(llama_cpp.Llama._create_completion)
_CHAT = inspect.signature(llama_cpp.Llama.create_chat_completion)
_building = threading.local()
_swap_lock = threading.Lock()


class _HeadModel(_internals.LlamaModel):
    """llama-cpp-python's model wrapper over the head's windowed model, which it does not own."""

    def __init__(self, *, path_model: str, params: Any, verbose: bool = True) -> None:  # noqa: ARG002
        model: Model = _building.model
        self.path_model, self.params, self.verbose = path_model, params, verbose
        self._exit_stack = contextlib.ExitStack()
        self.sampler = None
        self.custom_samplers = []
        self.model = model._ptr
        self.vocab = model._vocab


class _HeadContext(_internals.LlamaContext):
    """llama-cpp-python's context wrapper over the output-only window; KV operations go to the session."""

    def __init__(self, *, model: Any, params: Any, verbose: bool = True) -> None:
        head: Model = _building.model
        settings = ContextSettings(n_ctx=params.n_ctx, n_batch=params.n_batch, n_ubatch=params.n_ubatch,
                                   n_threads=params.n_threads, n_seq_max=params.n_seq_max,
                                   embeddings=params.embeddings, pooling_type=params.pooling_type)
        n = head.layout.n_layer
        self.window: Window = head.window(n, n, settings=settings)
        self.model, self.params, self.verbose = model, params, verbose
        self._exit_stack = contextlib.ExitStack()
        self.ctx = self.window._ctx
        self.session: Session = _building.session

    # the output-only window keeps no keys or values and forgets positions as it goes (Window.forward): the KV
    # cache that matters is the ring's, which the session owns
    def kv_cache_clear(self) -> None:
        self.session.clear()

    def kv_cache_seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        if p1 >= 0:
            raise PrimaplugError(f"removing positions [{p0}, {p1}) from the middle of a conversation is not supported "
                                 "over a ring: only rewinding (removing every position from one on)")
        if not self.session.can_rewind(max(p0, 0)):
            return False  # recurrent layers cannot forget part of a conversation: llama-cpp-python then evaluates anew
        self.session.rewind(max(p0, 0))
        return True

    def kv_cache_seq_cp(self, *args: Any) -> None:
        raise PrimaplugError("copying KV cache sequences is not supported over a ring yet")

    def kv_cache_seq_keep(self, *args: Any) -> None:
        raise PrimaplugError("keeping one KV cache sequence is not supported over a ring yet")

    def kv_cache_seq_shift(self, *args: Any) -> None:
        raise PrimaplugError("shifting the KV cache is not supported over a ring yet")


class _Internals:
    """Stands in for llama_cpp._internals inside llama_cpp.llama while a RingLlama is built (this thread only)."""

    def __getattr__(self, name: str) -> Any:
        if getattr(_building, "model", None) is not None:
            if name == "LlamaModel":
                return _HeadModel
            if name == "LlamaContext":
                return _HeadContext
        return getattr(_internals, name)


@contextlib.contextmanager
def _head_parts(model: Model, session: Session) -> Iterator[None]:
    with _swap_lock:
        _building.model, _building.session = model, session
        _llama_module.internals = _Internals()  # type: ignore[assignment]
        try:
            yield
        finally:
            _llama_module.internals = _internals
            _building.model = _building.session = None


class RingLlama(llama_cpp.Llama):
    """llama_cpp.Llama over a ring: `head` is the head's windowed model (vocabulary and output layer), `session`
    the conversation on the ring, `speculation` the draft that proposes tokens for the ring to verify (or None)."""

    def __init__(self, head: Model, session: Session, *, speculation: Speculation | None = None,
                 **kwargs: Any) -> None:
        if not head.output:
            raise PrimaplugError("the head's model must be loaded with output=True: the head runs the output layer")
        if kwargs.get("lora_path"):
            raise PrimaplugError("lora_path is not supported over a ring yet")
        if kwargs.get("draft_model") is not None:
            raise PrimaplugError("give primaplug.Llama the draft (draft_model=...): it builds the speculation")
        self._head, self._session = head, session
        kwargs.setdefault("flash_attn", False)
        if kwargs.get("chat_format") is None and kwargs.get("chat_handler") is None:
            chosen, self.chat_format_reason = choose_chat_format(head.layout.arch, head.layout.has_chat_template,
                                                                 head.is_special)
            if chosen is not None:
                kwargs["chat_format"] = chosen
            self.chat_format_fallback = chosen is not None  # the file has no template: a format chosen for it
            log.info("chat format: %s (%s)", chosen or "the model's own template", self.chat_format_reason)
        else:
            self.chat_format_reason = "given" if kwargs.get("chat_format") else "a chat handler given"
            self.chat_format_fallback = False
        with _head_parts(head, session):
            super().__init__(head.path, **kwargs)
        self._out: Window = self._ctx.window  # type: ignore[attr-defined]
        # the rows whose logits eval keeps in self.scores while _logits_all is on: "all", or "last" (a request's
        # logprobs without echo read only the rows before each generated token)
        self._logprob_rows = "all"
        self._keep_scores = False  # keep_logits(): every trip's rows in self.scores, without asking for more rows
        # llama-cpp-python's generate drafts through draft_model; set after __init__, which would otherwise keep
        # logits for every position of the context (n_ctx x n_vocab floats): the head keeps only a trip's rows
        self.speculation = self.draft_model = speculation

    def generate(self, tokens: Sequence[int], *args: Any, **kwargs: Any) -> Any:
        """llama_cpp.Llama.generate; with a draft, each step's drafted tokens go round the ring with the last
        sampled one, and sample() verifies them."""
        if self.speculation is not None:
            bound = _GENERATE.bind(self, tokens, *args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            sampling = a["mirostat_mode"] == 0 and a["temp"] > 0  # speculative sampling; else draw and compare
            self.speculation.start(SamplingParams(temp=a["temp"] if sampling else 0.0, top_k=a["top_k"],
                                                  top_p=a["top_p"], min_p=a["min_p"]),
                                   None if self._seed == llama_cpp.LLAMA_DEFAULT_SEED else self._seed)
        return super().generate(tokens, *args, **kwargs)

    def _create_completion(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """llama_cpp.Llama._create_completion; a request for logprobs keeps the logits of the rows they read for
        that request only (llama-cpp-python would need logits_all=True, logits for every row of every request)."""
        bound = _COMPLETION.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["logprobs"] is None or self._logits_all:
            yield from super()._create_completion(*args, **kwargs)
            return
        n_ctx = len(self.input_ids)
        if len(self.scores) < n_ctx:  # zero pages until written: memory only for the rows a request keeps
            self.scores = np.zeros((n_ctx, self._n_vocab), dtype=np.single)
        echo = bool(bound.arguments["echo"])
        if echo:
            self.n_tokens = 0  # every prompt row's logits: no prefix reuse for this one
        self._logits_all, self._logprob_rows = True, "all" if echo else "last"
        try:
            yield from super()._create_completion(*args, **kwargs)
        finally:
            self._logits_all, self._logprob_rows = False, "all"

    def create_chat_completion(self, *args: Any, **kwargs: Any) -> Any:
        """llama_cpp.Llama.create_chat_completion, with OpenAI's Structured Outputs too (`response_format` of type
        `json_schema`: engine/structured.py)."""
        bound = _CHAT.bind(self, *args, **kwargs)
        if "response_format" in bound.arguments:
            bound.arguments["response_format"] = json_schema_format(bound.arguments["response_format"])
        return super().create_chat_completion(*bound.args[1:], **bound.kwargs)

    def keep_logits(self) -> None:
        """From now on keep in self.scores the logits of the rows each trip returns anyway (the last one, and a
        draft's), at their positions, without asking the ring for more rows than generating needs (more rows
        would be computed as a batch, which rounds differently): `run --verify` compares them with plain's."""
        n_ctx = len(self.input_ids)
        if len(self.scores) < n_ctx:  # zero pages until written
            self.scores = np.zeros((n_ctx, self._n_vocab), dtype=np.single)
        self._keep_scores = True

    def eval(self, tokens: Sequence[int]) -> None:
        """Run tokens through the ring from position n_tokens (the session rewinds its prefix to there first); the
        logits land in the head's context, where llama-cpp-python's sampler reads them: of the last row, or of
        every row a drafted token's verification needs."""
        n_past, n = self.n_tokens, len(tokens)
        if n_past + n > len(self.input_ids):  # the n_ctx asked for (llama.cpp pads its own to a multiple of 256)
            # llama-cpp-python's own words for it (Llama.create_completion), so callers see one error either way
            raise ValueError(f"Requested tokens ({n_past + n}) exceed context window of {len(self.input_ids)}")
        spec = self.speculation
        pending = spec.pending if spec is not None else None
        # a trip that carries drafted tokens ends with them: their rows, and the sampled token's before them
        drafted = pending if pending is not None and pending.start + len(pending.tokens) == n_past + n else None
        wanted = 1 + len(drafted.tokens) if drafted is not None else 1
        every = self._logits_all and self._logprob_rows == "all"
        rows = n if every else min(n, wanted)

        def output(logits: np.ndarray, pos: int) -> None:
            first = n_past + n - rows
            if pos + len(logits) <= first:
                return
            logits, pos = (logits[first - pos :], first) if pos < first else (logits, pos)
            if self._logits_all or self._keep_scores:  # logprobs (and run --verify) read them here
                self.scores[pos : pos + len(logits), :] = logits
            self._out.set_logits(logits)

        t0 = time.perf_counter()
        self._session.eval(list(tokens), n_past, all_rows=rows > 1, output=output)
        if spec is not None and (drafted is not None or n == 1):
            spec.verified(n, time.perf_counter() - t0, drafted is not None)
        elif spec is not None:
            spec.prefill = (n_past, n_past + n)
        self.input_ids[n_past : n_past + n] = tokens
        self.n_tokens += n
        self._requires_eval = False

    def sample(self, *args: Any, idx: int | None = None, **kwargs: Any) -> int:
        """llama_cpp.Llama.sample; a drafted token waiting at the next position is verified: kept with probability
        min(1, p/q) or replaced from the residual (speculative sampling), or, greedy, kept when it is the target's
        own choice."""
        spec = self.speculation
        draft = spec.at(idx + 1) if spec is not None and idx is not None else None
        if draft is None:
            return super().sample(*args, idx=idx, **kwargs)
        assert spec is not None and idx is not None
        token, q = draft
        p = target_probs(self._sampler, self._ctx.ctx, idx - self.n_tokens, self._n_vocab) \
            if self._sampler is not None and not spec.params.greedy else None
        if p is None:  # greedy (or mirostat): the target draws as it would without a draft
            chosen = super().sample(*args, idx=idx, **kwargs)
            spec.decided(chosen == token)
            return chosen
        chosen, kept = accept_or_resample(p, q, token, spec.rng)
        llama_cpp.llama_sampler_accept(self._sampler.sampler, chosen)  # penalties and grammar see the token
        spec.decided(kept)
        return chosen

    def close(self) -> None:
        if getattr(self, "speculation", None) is not None:
            self.speculation.close()  # type: ignore[union-attr]
            self.speculation = self.draft_model = None
        super().close()

    def embed(self, input: str | list[str], normalize: bool = False, truncate: bool = True,  # noqa: A002 (its name)
              return_count: bool = False) -> Any:
        """llama_cpp.Llama.embed: each input goes round the ring alone (its final hidden rows come back) and the
        head's output-only window applies the output norm and the model's pooling, as llama.cpp does for the whole
        model. Needs embedding=True, as llama-cpp-python does."""
        if not self.context_params.embeddings:
            raise RuntimeError("Llama model must be created with embedding=True to call this method")
        data: list[Any] = []
        total = 0
        for text in [input] if isinstance(input, str) else input:
            tokens = self.tokenize(text.encode("utf-8"))
            if truncate:
                tokens = tokens[: self.n_batch]
            if len(tokens) > self.n_batch:
                raise ValueError(f"Requested tokens ({len(tokens)}) exceed batch size of {self.n_batch}")
            total += len(tokens)
            rows: list[np.ndarray] = []
            self._session.eval(tokens, 0, all_rows=True, hidden=True, output=lambda h, _pos, into=rows: into.append(h))
            vectors = [v.tolist() for v in self._out.embed(np.concatenate(rows))]
            if normalize:
                vectors = [_internals.normalize_embedding(v) for v in vectors]
            pooled = llama_cpp.llama_pooling_type(self._ctx.ctx) != llama_cpp.LLAMA_POOLING_TYPE_NONE
            data.append(vectors[0] if pooled else vectors)
        self.reset()  # the ring's caches no longer hold what llama-cpp-python last evaluated
        output = data[0] if isinstance(input, str) else data
        return (output, total) if return_count else output

    def save_state(self) -> Any:
        raise PrimaplugError("saving state is not supported over a ring yet (the KV cache lives on the nodes)")

    def load_state(self, state: Any) -> None:
        raise PrimaplugError("loading state is not supported over a ring yet (the KV cache lives on the nodes)")
