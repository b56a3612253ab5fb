"""Token-level stop rules, applied as a step's tokens are appended to a request: its grammar
(ended, or refusing a token), EOS and stop token ids (once min_tokens are out), max_tokens and
max_model_len. Stop strings are the front end's (they need text)."""

from __future__ import annotations

from ferrum.logger import init_logger
from ferrum.request import Request, RequestStatus

logger = init_logger(__name__)


def append_until_stop(
    request: Request, token_ids: list[int], max_model_len: int
) -> tuple[list[int], RequestStatus | None]:
    """Appends `token_ids` to the request up to the first that finishes it: the tokens appended
    and, if it finished, why (the caller frees it)."""
    for count, token_id in enumerate(token_ids, 1):
        request.append_output_token(token_id)
        status = accept_by_grammar(request, token_id)
        if status is None:
            status = check_stop(request, token_id, max_model_len)
        if status is not None:
            return token_ids[:count], status
    return token_ids, None


def accept_by_grammar(request: Request, token_id: int) -> RequestStatus | None:
    """Advances the request's matcher; the request stops once its grammar has ended, and is
    aborted if the grammar refuses the token (the mask allowed nothing, e.g. an empty
    intersection with allowed_token_ids)."""
    grammar = request.grammar
    if grammar is None or grammar.matcher is None:
        return None
    if not grammar.matcher.accept_tokens([token_id]):
        logger.warning(
            "request %s: token %d is refused by its grammar (%s): aborted",
            request.req_id,
            token_id,
            grammar.field_name,
        )
        return RequestStatus.FINISHED_ABORTED
    if grammar.matcher.is_terminated():
        if grammar.matcher.closed_by_budget:  # valid, but cut short: as vLLM, "length"
            return RequestStatus.FINISHED_LENGTH
        if token_id != request.eos_token_id:
            request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    return None


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.all_stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
