"""Engine outputs -> legacy `/v1/completions` responses and SSE streams.

Same stream invariants as chat (see serving_chat): `finish_reason` exactly once, in the
last text chunk; an optional usage chunk with no choices; then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from epd.errors import EPDError
from epd.llm.outputs import RequestOutput
from epd.llm.sequence import TokenLogprob
from epd.llm.serving_chat import Collected, EngineRequest, OpenAIServing
from epd.protocol import (
    SSE_DONE,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    completion_chunk,
    sse,
)


def completion_logprobs(
    serving: OpenAIServing, lps: Sequence[TokenLogprob], text_offset: int = 0
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = text_offset
    for lp in lps:
        tok = serving.token_str(lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({serving.token_str(i): v for i, v in lp.top} or None)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


def completion_response(
    serving: OpenAIServing, ereq: EngineRequest, req: CompletionRequest, c: Collected
) -> CompletionResponse:
    if c.finish_reason == "error":
        raise EPDError(f"generation failed: {c.error}", type="internal_error", status=500)
    lps = completion_logprobs(serving, c.logprobs) if req.logprobs is not None else None
    return CompletionResponse(
        id=ereq.request_id,
        model=serving.served_model_name,
        choices=[CompletionChoice(text=c.text, logprobs=lps, finish_reason=c.finish_reason)],
        usage=serving.usage(c.num_prompt_tokens, len(c.token_ids), c.num_cached_tokens),
    )


async def completion_stream(
    serving: OpenAIServing,
    ereq: EngineRequest,
    req: CompletionRequest,
    outputs: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    rid, model = ereq.request_id, serving.served_model_name
    num_output, num_cached, offset = 0, 0, 0
    try:
        async for o in outputs:
            num_output, num_cached = o.num_output_tokens, o.num_cached_tokens
            if not (o.new_text or o.new_logprobs or o.finished):
                continue
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(serving, o.new_logprobs, offset)
            offset += len(o.new_text)
            yield sse(
                completion_chunk(
                    rid,
                    model,
                    text=o.new_text,
                    logprobs=lps,
                    finish_reason=o.finish_reason if o.finished else None,
                )
            )
        if req.include_usage:
            usage = serving.usage(ereq.num_prompt_tokens, num_output, num_cached)
            yield sse(completion_chunk(rid, model, usage=usage))
        yield SSE_DONE
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
