"""Stop conditions of one request after it received a token (vLLM order and semantics)."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def append_text(request: Request, token_id: int) -> str:
    """Decode ``token_id`` with the request's incremental detokenizer; return the new text."""
    if request.detokenizer is None:
        return ""
    delta = request.detokenizer.add(token_id)
    request.output_text += delta
    return delta


def flush_text(request: Request) -> int:
    """Append the detokenizer's held-back tail (an incomplete character, and what came with it in
    its token) once the request ends; return its length."""
    if request.detokenizer is None:
        return 0
    tail = request.detokenizer.finish()
    request.output_text += tail
    return len(tail)


def _match_stop_string(request: Request, new_chars: int) -> bool:
    """Find a stop string that the newest characters completed; truncate the text there. Of
    several, the one that completes first wins (ties: the first listed): the text is then what
    feeding the characters one at a time would have stopped at. (vLLM takes the first listed
    that matches, which can cut at a stop string that completed after another.)"""
    text = request.output_text
    params = request.sampling_params
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop in params.stop:
        # Only a match ending inside the new characters is new; earlier text was checked already.
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx + len(stop) < best[0]):
            best = (idx + len(stop), idx, stop)
    if best is None:
        return False
    end, idx, stop = best
    request.output_text = text[: end if params.include_stop_str_in_output else idx]
    request.stop_reason = stop
    return True


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """Decode the request's newest token and return its finishing status, or None to go on.

    Order: a stop string completed by this token's text, EOS (unless ``ignore_eos``),
    ``stop_token_ids``, then length (``max_tokens`` or ``max_model_len``). The token itself always
    stays in ``output_token_ids``; a token that stops the request by its id (EOS, a stop token)
    adds no text unless ``include_stop_str_in_output``, as in vLLM and as a stop string's text.
    """
    params = request.sampling_params
    by_eos = token_id in request.eos_token_ids
    by_stop_id = not by_eos and token_id in params.stop_token_ids
    new_chars = 0
    if request.detokenizer is not None and (
        params.include_stop_str_in_output or not (by_eos or by_stop_id)
    ):
        new_chars = len(append_text(request, token_id))
    # (vLLM: a stop string matches only once more than min_tokens tokens are generated)
    strings = bool(params.stop) and len(request.output_token_ids) > params.min_tokens
    if strings and new_chars and _match_stop_string(request, new_chars):
        return RequestStatus.FINISHED_STOPPED  # the text ends at the stop string: nothing to flush
    status: RequestStatus | None = None
    if by_eos:
        if token_id != request.eos_token_id:  # another EOS id (vLLM: a stop token id)
            request.stop_reason = token_id
        status = RequestStatus.FINISHED_STOPPED
    elif by_stop_id:
        request.stop_reason = token_id
        status = RequestStatus.FINISHED_STOPPED
    elif (
        params.max_tokens is not None and len(request.output_token_ids) >= params.max_tokens
    ) or len(request.all_token_ids) >= max_model_len:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None:
        # The held-back tail is text too: a stop string in it ends the text there (it was
        # streamed whole, stop string and all, when the request ended with it held).
        flushed = flush_text(request)
        if strings and flushed and _match_stop_string(request, flushed):
            return RequestStatus.FINISHED_STOPPED
    return status
