"""The error answer SGLang sends for a request it rejects."""

from __future__ import annotations


class HTTPError(Exception):
    """`status`, the message SGLang would put in the body and, where SGLang sets one, the OpenAI error `type`
    (`BadRequestError` from validation, `BadRequest` from a ValueError, `InternalServerError`, ...)."""

    def __init__(self, status: int, message: str, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
