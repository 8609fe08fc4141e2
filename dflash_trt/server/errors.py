"""OpenAI-style error values: the serving modules return these instead of raising, and the app sends them."""

from __future__ import annotations

from dflash_trt.server.protocol import ErrorBody, ErrorResponse

BAD_REQUEST, UNAUTHORIZED, NOT_FOUND, TOO_LARGE, SERVER_ERROR, UNAVAILABLE = 400, 401, 404, 413, 500, 503

TYPES = {
    BAD_REQUEST: "invalid_request_error",
    UNAUTHORIZED: "authentication_error",
    NOT_FOUND: "not_found_error",
    TOO_LARGE: "invalid_request_error",
    SERVER_ERROR: "internal_server_error",
    UNAVAILABLE: "service_unavailable",
}


def error(message: str, param: str | None = None, status: int = BAD_REQUEST) -> ErrorResponse:
    return ErrorResponse(error=ErrorBody(message=message, type=TYPES[status], param=param, code=status))
