"""OpenAI requests -> engine requests, engine outputs -> OpenAI responses and SSE streams.

Invariants:
- Everything a request can get wrong is checked here, before the engine sees it, and
  raised as an `EPDError` naming the OpenAI parameter (`model`, `messages[i].content[j]`,
  `messages` / `prompt` for a prompt longer than the context, `max_tokens` for prompt +
  max_tokens beyond the context or the KV cache).
- A stream is: a role chunk, content chunks, `finish_reason` exactly once (in the last
  content chunk), an optional usage chunk with no choices, then `data: [DONE]`.
- `usage.prompt_tokens` is the length of the prompt token ids handed to the engine and
  `usage.completion_tokens` the number of generated token ids.
- EPD: a request with `encoder_result` never loads its image parts (the proxy forwards
  them unchanged); the prompt's placeholders are expanded with the encoder's token counts
  and keyed by its `mm_hash`es (prefix caching works across requests), after
  `check_encoder_results` (400 naming `encoder_result...`). The engine pulls the features.
- Chat responses carry `epd_timings` (seconds per stage: queue, epd_migration, prefill,
  decode, total): top level when not streamed, in the finish chunk when streamed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from epd.errors import EPDError, invalid_request, not_found
from epd.llm.metrics import RequestTracker, ServerMetrics
from epd.llm.outputs import RequestOutput
from epd.llm.pd.serving import check_role, prepare_decode_chat
from epd.llm.sampling_params import SamplingParams
from epd.llm.sequence import MMItem, TokenLogprob
from epd.protocol import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionRequest,
    TopLogprob,
    Usage,
    chat_chunk,
    chat_usage_chunk,
    new_id,
    sse,
)
from epd.protocol import TokenLogprob as WireTokenLogprob

NO_VISION_MESSAGE = (
    "this LLM engine has no vision model (started with --vision none) and got a raw image. "
    "Either deploy an encoder and a proxy (`epd launch`, or `epd serve --role encoder` + "
    "`epd proxy`) and send the request to the proxy, or start this server with --vision local."
)


@dataclass
class EngineRequest:
    """A validated request, ready for `AsyncLLMEngine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    mm_items: list[MMItem] = field(default_factory=list)
    prompt_param: str = "messages"
    epd: Any = None  # epd.llm.migration.EPDRequest for requests with encoder_result
    prefill_only: bool = False  # prefill role: hand the KV over after the first token
    migration: Any = None  # decode role: the prefill's epd.protocol.MigrationRequest

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Collected:
    """A whole (non-streamed) generation."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    timings: dict[str, float] | None = None


def _extras(ereq: EngineRequest) -> dict[str, Any]:
    """The optional keyword arguments of `AsyncLLMEngine.generate` this request needs."""
    extras: dict[str, Any] = {"epd": ereq.epd} if ereq.epd else {}
    if ereq.prefill_only:
        extras["prefill_only"] = True
    if ereq.migration is not None:
        extras["migration"] = ereq.migration
    return extras


class EPDChatCompletionResponse(ChatCompletionResponse):
    epd_timings: dict[str, float] | None = None


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into responses."""

    def __init__(
        self,
        engine: Any,
        served_model_name: str,
        *,
        vision: str,
        media_config: Any,
        metrics: ServerMetrics,
        max_model_len: int,
        block_size: int,
        role: str = "llm",
    ) -> None:
        self.engine = engine
        self.role = role
        self.served_model_name = served_model_name
        self.vision = vision
        self.media_config = media_config
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.processor = engine.processor
        self.tokenizer = engine.processor.tokenizer
        self._image_tokens: int | None | bool = False  # False: not computed yet

    # -- request -> engine request ---------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise not_found(
                f"The model '{model}' does not exist; this server serves "
                f"'{self.served_model_name}'.",
                param="model",
            )

    async def prepare_chat(self, req: ChatCompletionRequest) -> EngineRequest:
        self.check_model(req.model)
        check_role(self.role, req)
        if self.role == "decode":
            return await prepare_decode_chat(self, req)
        if req.encoder_result is not None:
            return await self._prepare_epd_chat(req)
        from epd.encoder.media import collect_image_parts, load_images

        refs = collect_image_parts(
            req.messages, limit=self.media_config.limit_images_per_request
        )
        if refs and self.vision != "local":
            raise invalid_request(NO_VISION_MESSAGE, refs[0].param, "vision_not_available")
        images = []
        if refs:
            pil_images = await load_images(refs, self.media_config)
            images = await asyncio.to_thread(self.processor.preprocess_images, pil_images)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt = await asyncio.to_thread(self._tokenize_chat, messages, images)
        mm_items = [
            MMItem(offset=span.offset, length=span.length, mm_hash=img.mm_hash, image=img)
            for span, img in zip(prompt.mm_spans, images, strict=True)
        ]
        return self._finish_prepare(new_id("chatcmpl"), prompt.token_ids, req, "messages", mm_items)

    async def _prepare_epd_chat(self, req: ChatCompletionRequest) -> EngineRequest:
        """Features come from encoders: no image is loaded here (file paths included)."""
        from epd.llm.migration import check_encoder_results, epd_prompt

        epd_state = self.engine.engine.epd
        results = req.encoder_results
        if self._image_tokens is False:
            self._image_tokens = await asyncio.to_thread(self._expected_image_tokens)
        epd = check_encoder_results(
            results, listed=isinstance(req.encoder_result, list),
            hidden_size=epd_state.hidden_size, dtype=epd_state.dtype_name,
            image_tokens=self._image_tokens, mm_block_tokens=epd_state.config.mm_block_tokens,
            mm_num_blocks=epd_state.num_blocks,
        )  # fmt: skip
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            ids, mm_items = await asyncio.to_thread(epd_prompt, self.processor, messages, epd)
        except ValueError as exc:
            raise invalid_request(f"cannot build the prompt: {exc}", "encoder_result") from None
        ereq = self._finish_prepare(new_id("chatcmpl"), ids, req, "messages", mm_items)
        ereq.epd = epd
        return ereq

    def _expected_image_tokens(self) -> int | None:
        """Placeholder tokens per image for this processor (fixed-resolution archs), or
        None when it depends on the image."""
        from PIL import Image

        try:
            counts = {
                self.processor.preprocess_images([Image.new("RGB", size)])[0].num_tokens
                for size in ((64, 48), (200, 320))
            }
        except Exception:
            return None
        return counts.pop() if len(counts) == 1 else None

    def _tokenize_chat(self, messages: list[dict], images: list) -> Any:
        return self.processor.tokenize(self.processor.render(messages), images)

    def prepare_completion(self, req: CompletionRequest) -> EngineRequest:
        self.check_model(req.model)
        check_role(self.role, req)
        if isinstance(req.prompt, str):
            try:  # exactly as the HF processor tokenizes a raw prompt
                ids = list(self.processor.tokenize(req.prompt, []).token_ids)
            except (ValueError, IndexError) as exc:
                raise invalid_request(f"cannot tokenize the prompt: {exc}", "prompt") from None
        else:
            vocab = len(self.tokenizer)
            bad = [t for t in req.prompt if t >= vocab]
            if bad:
                raise invalid_request(f"token id {bad[0]} is outside the vocabulary", "prompt")
            ids = list(req.prompt)
        ereq = self._finish_prepare(new_id("cmpl"), ids, req, "prompt", [])
        ereq.migration = req.migration_request
        return ereq

    def _finish_prepare(
        self, rid: str, ids: list[int], req: Any, prompt_param: str, mm_items: list[MMItem]
    ) -> EngineRequest:
        n, ctx = len(ids), self.max_model_len
        if n == 0:
            raise invalid_request("the prompt is empty", prompt_param)
        if n >= ctx:
            raise invalid_request(
                f"the prompt has {n} tokens; the model's context length is {ctx} "
                "(and at least one token must be generated)",
                prompt_param,
                "context_length_exceeded",
            )
        opts = req.sampling_options()
        total_blocks = self.engine.stats().kv_blocks_total
        # Unset max_tokens: up to the context, capped by what the whole KV cache can hold.
        default_max = min(ctx, total_blocks * self.block_size) - n
        max_tokens = opts["max_tokens"] if opts["max_tokens"] is not None else default_max
        if max_tokens < 1:
            raise invalid_request(
                f"the prompt has {n} tokens; the KV cache holds {total_blocks * self.block_size}",
                prompt_param,
                "context_length_exceeded",
            )
        if n + max_tokens > ctx:
            raise invalid_request(
                f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                f"exceeds the model's context length of {ctx}",
                "max_tokens",
                "context_length_exceeded",
            )
        # A prefill engine holds the prompt only; decoding happens elsewhere.
        need = -(-(n + (0 if self.role == "prefill" else max_tokens)) // self.block_size)
        if need > total_blocks:
            raise invalid_request(
                f"the prompt ({n} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                f"{self.block_size} tokens; the KV cache has {total_blocks}",
                "max_tokens" if -(-n // self.block_size) < total_blocks else prompt_param,
            )
        logprobs = opts["logprobs"]
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if opts["temperature"] is None else opts["temperature"],
            top_p=1.0 if opts["top_p"] is None else opts["top_p"],
            top_k=-1 if opts["top_k"] is None else opts["top_k"],
            seed=opts["seed"],
            stop=tuple(opts["stop"]),
            stop_token_ids=tuple(opts["stop_token_ids"]),
            ignore_eos=opts["ignore_eos"],
            logprobs=logprobs is not None,
            top_logprobs=logprobs or 0,
            n=opts["n"],
        )
        sampling.validate(None, n, prompt_param)
        return EngineRequest(rid, ids, sampling, mm_items, prompt_param,
                             prefill_only=self.role == "prefill")

    # -- engine outputs -> OpenAI ----------------------------------------------------
    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat_logprobs(self, lps: Sequence[TokenLogprob]) -> ChoiceLogprobs:
        content = []
        for lp in lps:
            tok = self.token_str(lp.token_id)
            tops = [
                TopLogprob(token=(t := self.token_str(i)), logprob=v, bytes=list(t.encode()))
                for i, v in lp.top
            ]
            content.append(
                WireTokenLogprob(
                    token=tok, logprob=lp.logprob, bytes=list(tok.encode()), top_logprobs=tops
                )
            )
        return ChoiceLogprobs(content=content)

    def usage(self, num_prompt: int, num_output: int, num_cached: int) -> Usage:
        return Usage.of(num_prompt, num_output, num_cached)

    async def collect_from(self, outputs: AsyncIterator[RequestOutput]) -> Collected:
        out = Collected()
        async for o in outputs:
            out.text += o.new_text
            out.token_ids += o.new_token_ids
            out.logprobs += o.new_logprobs
            out.num_prompt_tokens, out.num_cached_tokens = o.num_prompt_tokens, o.num_cached_tokens
            if o.finished:
                out.finish_reason, out.error, out.timings = o.finish_reason, o.error, o.timings
        return out

    async def generate(
        self, ereq: EngineRequest, tracker: RequestTracker
    ) -> AsyncIterator[RequestOutput]:
        """The engine's stream for `ereq`, feeding metrics; aborts if the consumer leaves."""
        finish_reason, rejected = None, False
        try:
            async for o in self.engine.generate(
                ereq.request_id, ereq.prompt_token_ids, ereq.sampling, ereq.mm_items,
                prompt_param=ereq.prompt_param, **_extras(ereq),
            ):
                tracker.on_tokens(len(o.new_token_ids))
                if o.finished:  # a prefill's hand-over ends without an OpenAI reason
                    finish_reason = o.finish_reason or ("migrated" if o.migration else "abort")
                yield o
                if o.finished:
                    return
        except EPDError:
            rejected = True  # refused by the engine: an error response, not a finished request
            raise
        finally:
            if finish_reason is None:
                self.engine.abort(ereq.request_id)
            if not rejected:
                tracker.finish(finish_reason)

    def chat_response(self, ereq: EngineRequest, req: ChatCompletionRequest, c: Collected):
        if c.finish_reason == "error":
            raise EPDError(f"generation failed: {c.error}", type="internal_error", status=500)
        choice = ChatCompletionChoice(
            message=ChatCompletionMessage(content=c.text),
            logprobs=self.chat_logprobs(c.logprobs) if req.logprobs else None,
            finish_reason=c.finish_reason,
        )
        return EPDChatCompletionResponse(
            id=ereq.request_id,
            model=self.served_model_name,
            choices=[choice],
            usage=self.usage(c.num_prompt_tokens, len(c.token_ids), c.num_cached_tokens),
            epd_timings=c.timings,
        )

    async def chat_stream(
        self,
        ereq: EngineRequest,
        req: ChatCompletionRequest,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        rid, model = ereq.request_id, self.served_model_name
        yield sse(chat_chunk(rid, model, role="assistant", content=""))
        num_output, num_cached = 0, 0
        try:
            async for o in outputs:
                num_output, num_cached = o.num_output_tokens, o.num_cached_tokens
                if not (o.new_text or o.new_logprobs or o.finished):
                    continue
                lps = self.chat_logprobs(o.new_logprobs) if req.logprobs else None
                chunk = chat_chunk(
                    rid,
                    model,
                    content=o.new_text,
                    logprobs=lps,
                    finish_reason=o.finish_reason if o.finished else None,
                )
                if o.finished and o.timings is not None:
                    yield sse({**chunk.model_dump(mode="json"), "epd_timings": o.timings})
                else:
                    yield sse(chunk)
            if req.include_usage:
                usage = self.usage(ereq.num_prompt_tokens, num_output, num_cached)
                yield sse(chat_usage_chunk(rid, model, usage))
            yield SSE_DONE
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
