"""OpenAI-style error values: the serving modules return these instead of raising, and the app sends them. Each
names the request it answers; a 5xx is logged with its cause as it is made (a refusal is logged by the app as it
is sent)."""

from __future__ import annotations

import logging

from dflash_trt.server.observability import LOGGER, current_request_id
from dflash_trt.server.protocol import ErrorBody, ErrorResponse

BAD_REQUEST, UNAUTHORIZED, FORBIDDEN, NOT_FOUND, METHOD_NOT_ALLOWED = 400, 401, 403, 404, 405
TOO_LARGE, UNSUPPORTED_MEDIA_TYPE = 413, 415
SERVER_ERROR, UNAVAILABLE = 500, 503

TYPES = {
    BAD_REQUEST: "invalid_request_error",
    UNAUTHORIZED: "authentication_error",
    FORBIDDEN: "permission_error",
    NOT_FOUND: "not_found_error",
    METHOD_NOT_ALLOWED: "invalid_request_error",
    TOO_LARGE: "invalid_request_error",
    UNSUPPORTED_MEDIA_TYPE: "invalid_request_error",
    SERVER_ERROR: "internal_server_error",
    UNAVAILABLE: "service_unavailable",
}


def error(message: str, param: str | None = None, status: int = BAD_REQUEST) -> ErrorResponse:
    request_id = current_request_id.get()
    if status >= SERVER_ERROR:  # a fault is an error; a refusal at capacity (503) is the load's, a warning
        level = logging.ERROR if status == SERVER_ERROR else logging.WARNING
        LOGGER.log(level, "request %s answered %d: %s", request_id, status, message)
    body = ErrorBody(message=message, type=TYPES[status], param=param, code=status, request_id=request_id)
    return ErrorResponse(error=body)
