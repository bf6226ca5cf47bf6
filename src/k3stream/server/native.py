"""llama-server's native completion API: `POST /completion` (and `/completions`, as llama-server routes
it), its request fields and response shapes, on the scheduler and request logic the OpenAI endpoints
use; and llama-server's answers for what k3stream does not serve: `/infill` (Kimi-K3's vocabulary has
no fill-in-the-middle tokens), embeddings, reranking and LoRA adapters (`/lora-adapters`, as without
`--lora`). Errors here are llama-server's error object
(`errors.LlamaError`). docs/server-endpoints.md describes each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request, Response
from pydantic import AfterValidator, Field, RootModel, model_validator

from k3stream.server.bodies import parse_body
from k3stream.server.endpoints_llama import llama_params
from k3stream.server.errors import APIError, LlamaError, invalid_request, not_supported
from k3stream.server.grammar import Constraint, gbnf_grammar, json_schema_grammar
from k3stream.server.kimi_output import Piece, joined
from k3stream.server.scheduler import Job, ProgressEvent, request_timings
from k3stream.server.schemas import (
    Choices,
    Integral,
    RepetitionPenalty,
    SamplingFields,
    Switch,
    check_json_schema,
    checked_prompts,
    null_is,
)

if TYPE_CHECKING:
    from k3stream.server.app import Endpoints

MAX_N_PROBS = 100
# llama-server's sampler names and letters; the ones this server runs are in NEUTRAL
SAMPLER_LETTERS = {
    "penalties": "e",
    "dry": "d",
    "top_n_sigma": "s",
    "top_k": "k",
    "typ_p": "y",
    "typical_p": "y",
    "typical": "y",
    "top_p": "p",
    "min_p": "m",
    "xtc": "x",
    "temperature": "t",
    "temp": "t",
    "infill": "i",
    "adaptive_p": "a",
}
# what leaving a sampler out of `samplers` sets: the sampler does nothing
NEUTRAL = {
    "e": {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0},
    "k": {"top_k": 0},
    "p": {"top_p": 1.0},
    "m": {"min_p": 0.0},
    "t": {"temperature": 1.0},
}
INFILL_MESSAGE = (
    "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
    "middle token is missing. "
)
EMBEDDINGS_MESSAGE = "This server does not support embeddings. k3stream has no embedding mode"
RERANK_MESSAGE = "This server does not support reranking. k3stream has no reranking mode"

PromptPieces = list[int | str]
# why a prompt past the context is refused where a request's `n_keep` asks to keep part of it
NOT_TRUNCATED = (
    "; n_keep truncates no prompt: the model's recurrent state cannot drop tokens, so there is no context "
    "shift (llama-server refuses such a prompt for a hybrid model too)"
)


class NativeCompletionRequest(SamplingFields):
    """`/completion`'s body: llama-server's fields beside the shared ones (`n_predict`, `max_tokens`,
    `temperature`, `seed`, `stop`, `logit_bias`, `cache_prompt`, `id_slot`, ...)."""

    PROMPT_ONLY = True

    prompt: str | list[int | str | list[int | str]]
    # llama-server reads any temperature (0 and below: the likeliest token) and any penalty
    temperature: (
        Annotated[float, Field(allow_inf_nan=False), AfterValidator(lambda t: max(t, 0.0))] | None
    ) = None
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    n_cmpl: Choices | None = None  # llama-server's completions per prompt (`n` is its alias)
    # null is each field's default, as llama-server reads a field (its json_value)
    n_probs: Annotated[int, Field(ge=0, le=MAX_N_PROBS), Integral, null_is(0)] = 0
    post_sampling_probs: Switch = False
    response_fields: list[str] | None = None
    return_tokens: Switch = False
    repeat_penalty: Annotated[RepetitionPenalty, null_is(1.0)] = 1.0
    repeat_last_n: Annotated[int, Field(ge=-1), Integral, null_is(64)] = 64
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    special: Switch = False  # special tokens' text in `content`
    samplers: list[str] | str | None = None
    # context shift's (a hybrid model has none: taken, echoed in `generation_settings`, and do nothing)
    n_keep: Annotated[int, Integral, null_is(0)] = 0
    n_discard: Annotated[int, Integral, null_is(0)] = 0

    @model_validator(mode="after")
    def _n_cmpl_first(self) -> NativeCompletionRequest:
        """`n_cmpl` where given, else its alias `n` (llama-server reads them in that order)."""
        if self.n_cmpl is not None:
            self.n = self.n_cmpl
        return self

    def check_supported(self) -> None:
        super().check_supported()
        # given, not empty: llama-server's json_schema {} is any JSON object
        if self.grammar is not None and self.json_schema is not None:
            raise invalid_request("grammar: give a grammar or a json_schema, not both", param="grammar")
        if self.json_schema is not None:
            check_json_schema(self.json_schema, "json_schema")
        structured = self.structured_output()
        if structured is not None and (self.grammar or self.json_schema is not None):
            message = f"{structured.param}: give one grammar: a structured output, a grammar or a json_schema"
            raise invalid_request(message, param=structured.param)
        if self.ignore_eos and (self.grammar or self.json_schema is not None):
            message = (
                "ignore_eos cannot be combined with a grammar or json_schema (the grammar ends the answer)"
            )
            raise invalid_request(message, param="ignore_eos", code="unsupported_value")
        if self.repeat_penalty != 1.0 and self.repetition_penalty not in (None, 1.0):
            message = "repeat_penalty: give repeat_penalty (llama-server's) or repetition_penalty, not both"
            raise invalid_request(message, param="repeat_penalty")
        self._sampler_letters()

    def prompts(self) -> list[PromptPieces]:
        """Each prompt as its pieces (token ids and texts), as llama-server reads `prompt`: a string, token
        ids, ids and strings mixed (one prompt), or a list of such prompts."""
        prompt = self.prompt
        if isinstance(prompt, str) or _one_prompt(prompt):
            found = [[prompt] if isinstance(prompt, str) else list(prompt)]
        elif any(isinstance(item, int) for item in prompt):
            raise invalid_request(
                "prompt: a list of prompts cannot hold token ids beside them", param="prompt"
            )
        else:
            found = [[item] if isinstance(item, str) else list(item) for item in prompt]
        return checked_prompts(found, len(found) > 1, lambda pieces: not any(pieces))

    def post_sampling(self) -> bool:
        return self.post_sampling_probs

    def sampling_overrides(self) -> dict[str, Any]:
        # llama-server's penalties sampler counts the last repeat_last_n tokens of prompt and output
        overrides: dict[str, Any] = {
            "skip_special_tokens": self.skip_special_tokens and not self.special,
            "penalty_last_n": self.repeat_last_n,
        }
        if self.repeat_penalty != 1.0:  # llama-server's: over the last repeat_last_n tokens
            overrides |= {"repetition_penalty": self.repeat_penalty, "repetition_last_n": self.repeat_last_n}
        letters = self._sampler_letters()
        for letter, neutral in NEUTRAL.items():
            if letters is not None and letter not in letters:
                overrides |= neutral
        return overrides

    def _sampler_letters(self) -> set[str] | None:
        """The samplers `samplers` names, as llama-server's letters (None: all); a 400 naming an unknown
        one."""
        if self.samplers is None:
            return None
        if isinstance(self.samplers, str):
            letters = set(self.samplers)
            unknown = next(
                (letter for letter in self.samplers if letter not in SAMPLER_LETTERS.values()), None
            )
            if unknown is not None:
                raise invalid_request(f"samplers: unknown sampler letter {unknown!r}", param="samplers")
            return letters
        for index, name in enumerate(self.samplers):
            if name not in SAMPLER_LETTERS:
                raise invalid_request(
                    f"samplers.{index}: unknown sampler {name!r}", param=f"samplers.{index}"
                )
        return {SAMPLER_LETTERS[name] for name in self.samplers}


def _one_prompt(items: list[Any]) -> bool:
    """Token ids, or token ids and texts mixed: one prompt."""
    return any(isinstance(item, int) for item in items) and all(isinstance(item, int | str) for item in items)


class NativeResult:
    """The response shapes of one prompt of a `/completion` request (`streaming.Stream` sends them)."""

    done_line = ""  # llama-server ends a native stream without `[DONE]`

    def __init__(
        self, job: Job, index: int, model: str, body: NativeCompletionRequest, prompt: str, ctx: int
    ) -> None:
        self.job = job
        self.ctx = ctx  # the served context: an answer that fills it is `truncated`, as llama-server says
        self.index = index
        self.model = model
        self.body = body
        self.prompt = prompt
        self._content = ""  # what the stream sent so far
        self._predicted = 0

    def first(self) -> None:
        return None  # a native stream starts with the first piece

    def _partial(self, content: str, tokens: list[int]) -> dict[str, Any]:
        return {
            "index": self.index,
            "content": content,
            "tokens": tokens,
            "stop": False,
            "id_slot": self.job.slot,
            "tokens_predicted": self._predicted,
            "tokens_evaluated": len(self.job.prompt_tokens),
        }

    def progress(self, event: ProgressEvent) -> dict[str, Any]:
        return {**self._partial("", []), "prompt_progress": event.as_json()}

    def piece(self, piece: Piece) -> dict[str, Any]:
        """A streamed piece: its text and token ids (always, as llama-server streams them), with
        `timings_per_token` the timings so far."""
        self._content += piece.content
        self._predicted += len(piece.tokens)
        timings = {"timings": request_timings([self.job])} if self.body.timings_per_token else {}
        return {**self._partial(piece.content, piece.tokens), **_probabilities(piece), **timings}

    def last(self, reason: str) -> dict[str, Any]:
        del reason  # the job's own finish says more (its stop type and word)
        return self._final(self._summary(Piece(content=""), self._content))

    def whole_choice(self, pieces: list[Piece], reason: str) -> dict[str, Any]:
        del reason
        total = joined(pieces)
        return self._final({**self._summary(total, total.content), **_probabilities(total)})

    def _final(self, result: dict[str, Any]) -> dict[str, Any]:
        """The final result, or with `response_fields` only those fields, as llama-server picks them: a
        path `a/b` is `result["a"]["b"]` under the key `a/b`; a path the result lacks is left out."""
        if self.body.response_fields is None:
            return result
        return {
            path: value for path in self.body.response_fields if (value := _at(result, path)) is not _MISSING
        }

    def whole(
        self, choices: list[dict[str, Any]], usage: dict[str, Any], timings: dict[str, float]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        del usage, timings  # each result carries its own
        return choices[0] if len(choices) == 1 else choices

    def error(self, error: APIError) -> LlamaError:
        return LlamaError.of(error)

    def _settings(self) -> dict[str, Any]:
        """The sampling settings as served; a prompt-only job (`n_predict: 0`) samples with 1 but
        echoes the 0 it was asked."""
        body = self.body
        settings = {
            **llama_params(self.job.logic.params),
            "repeat_last_n": body.repeat_last_n,
            "n_keep": body.n_keep,
            "n_discard": body.n_discard,
            "stream": bool(body.stream),
            "n_probs": body.n_probs,
            "post_sampling_probs": body.post_sampling_probs,
            "timings_per_token": bool(body.timings_per_token),
        }
        if self.job.prompt_only:
            settings["n_predict"] = settings["max_tokens"] = 0
        return settings

    def _summary(self, total: Piece, content: str) -> dict[str, Any]:
        """llama-server's final result: `total`'s text and tokens (none in a stream's last chunk, whose
        pieces carried them), then the request's figures."""
        job, logic = self.job, self.job.logic
        return {
            **self._partial(total.content, total.tokens if self.body.return_tokens else []),
            "stop": True,
            "model": self.model,
            "tokens_predicted": logic.completion_tokens,
            "generation_settings": self._settings(),
            "prompt": self.prompt,
            "has_new_line": "\n" in content,
            "truncated": self._context_full(),
            "stop_type": _stop_type(logic.finish_reason, logic.sequence.stop_word),
            "stopping_word": logic.sequence.stop_word,
            "tokens_cached": len(job.prompt_tokens) + max(len(job.generated) - 1, 0),
            "timings": request_timings([job]),
        }

    def _context_full(self) -> bool:
        """Whether the context ended the answer (prompt and output fill it): llama-server's `truncated`
        of a server without context shift (a hybrid model's, whose recurrent state cannot shift)."""
        logic = self.job.logic
        filled = len(self.job.prompt_tokens) + logic.completion_tokens >= self.ctx
        return logic.finish_reason == "length" and filled


_MISSING = object()


def _at(result: dict[str, Any], path: str) -> Any:
    """The value at a `/`-separated path of nested objects, or `_MISSING`."""
    value: Any = result
    for key in path.split("/"):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _stop_type(reason: str | None, word: str) -> str:
    if reason == "length":
        return "limit"
    if reason == "stop":
        return "word" if word else "eos"
    return "none"


def _probabilities(piece: Piece) -> dict[str, Any]:
    """llama-server's `completion_probabilities` of the piece's tokens (nothing without `n_probs`)."""
    return {"completion_probabilities": [entry.llama() for entry in piece.logprobs]} if piece.logprobs else {}


class NativeEndpoints:
    def __init__(self, api: Endpoints) -> None:
        self.api = api
        self.served = api.served

    async def completion(self, request: Request) -> Response:
        try:
            return await self._completion(request)
        except APIError as error:
            raise LlamaError.of(error) from None

    async def _completion(self, request: Request) -> Response:
        body = await parse_body(request, NativeCompletionRequest)
        slots = self.api.scheduler.max_batch
        if body.n > slots:
            message = (
                f"n_cmpl cannot be greater than the number of slots ({slots}); start the server with a "
                "larger --max-batch"
            )
            raise invalid_request(message, param="n_cmpl")
        await self.api.check_request(body)
        prepared = [await self.api.off_loop(self._prepare, pieces, body) for pieces in body.prompts()]
        try:
            jobs = self.api.submit_prompts(
                body,
                [(tokens, constraint) for tokens, _, constraint in prepared],
                body.token_limit(),
                top=body.n_probs or None,
            )
        except APIError as error:
            if error.code == "context_length_exceeded" and body.n_keep:
                error.message += NOT_TRUNCATED
            raise
        # completion j of prompt i is result i * n + j, as llama-server orders them
        results = [
            NativeResult(job, index, self.served.name, body, prepared[index // body.n][1], self.served.ctx)
            for index, job in enumerate(jobs)
        ]
        return await self.api.stream(jobs, results, body).respond(request, body.stream, False)

    def _prepare(
        self, pieces: PromptPieces, body: NativeCompletionRequest
    ) -> tuple[list[int], str, Constraint | None]:
        """A prompt's token ids, its text (llama-server's `prompt`: the ids decoded) and its grammar."""
        tokens = self.api.check_ids(self.served.encode_pieces(pieces))
        return tokens, self.served.tokenizer.decode(tokens), self._constraint(body)

    def _constraint(self, body: NativeCompletionRequest) -> Constraint | None:
        if body.json_schema is not None:  # {}: an object, as llama.cpp's json_schema_to_grammar makes it
            grammar, param = json_schema_grammar(body.json_schema or {"type": "object"}), "json_schema"
        elif body.grammar:
            grammar, param = gbnf_grammar(body.grammar, "grammar"), "grammar"
        else:  # vLLM's structured outputs, where the request asks for one
            return self.served.structured_constraint(body)
        return self.served.grammars.constraint(grammar, param)

    async def infill(self) -> Response:
        raise not_supported(INFILL_MESSAGE)

    async def embeddings(self) -> Response:
        raise not_supported(EMBEDDINGS_MESSAGE)

    async def rerank(self) -> Response:
        raise not_supported(RERANK_MESSAGE)

    async def lora_adapters(self) -> list[Any]:
        """llama-server's list of loaded LoRA adapters: none here, as there without `--lora`."""
        return []

    async def set_lora_adapters(self, request: Request) -> dict[str, Any]:
        """llama-server's `POST /lora-adapters` with no adapter loaded: an empty list is taken, an entry
        names an adapter that does not exist (its `invalid adapter id`, a 400 here)."""
        try:
            scales = (await parse_body(request, RootModel[Any])).root
        except APIError as error:
            raise LlamaError.of(error) from None
        if not isinstance(scales, list):
            raise LlamaError.of(invalid_request("Request body must be an array"))
        if scales:
            raise LlamaError.of(invalid_request("0: invalid adapter id (this server has no LoRA adapters)"))
        return {"success": True}


def native_router(api: Endpoints) -> APIRouter:
    native = NativeEndpoints(api)
    router = APIRouter()
    for path in ("/completion", "/completions"):
        router.post(path)(native.completion)
    router.post("/infill")(native.infill)
    for path in ("/embedding", "/embeddings", "/v1/embeddings"):
        router.post(path)(native.embeddings)
    for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking"):
        router.post(path)(native.rerank)
    router.get("/lora-adapters")(native.lora_adapters)
    router.post("/lora-adapters")(native.set_lora_adapters)
    return router
