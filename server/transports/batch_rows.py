"""A batch job's row as a request: the runner the batch worker sends each row through
(``server.control.batches.batches.BatchWorker``). It lives with the transports because a row is one
more way a request arrives (an endpoint path and a JSON body read from a file instead of a socket), and
its answers are the transports' own: a row goes control plane -> here -> the transport's answer -> the
data plane's port, each room entered once.

A row runs as its job's tenant (authenticated when the job was created, its grants as they are
now), at the ``batch`` traffic class, through the same code as a live call of its endpoint: the
transports hand in one answer per endpoint pattern (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings`` from the OpenAI routes, ``/v2/models/NAME/infer`` from the REST routes), each
calling the model port (``server.dataplane.port``) as the live handler does. An overload or quota
refusal is raised (the row stays pending and is tried again); any other error is the row's answer.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable

from server.errors import InferplaneError, InvalidRequest, Overloaded, http_error
from server.tenancy.identity import CallContext, Delegation, Principal

ROW_TIMEOUT_S = 300.0  # one row's deadline once admitted (it waits for capacity without one)

RowAnswer = Callable[[re.Match, dict, CallContext], Awaitable[dict]]  # (endpoint match, body, ctx) -> the answer's JSON


class RowRunner:
    """``await runner(endpoint, body, tenant) -> (status, body)``."""

    def __init__(self, principal_of: Callable[[str], Principal], answers: Iterable[tuple[re.Pattern, RowAnswer]]):
        self._principal_of = principal_of  # the gatekeeper's: the tenant as the key ring knows it now
        self._answers = list(answers)

    async def __call__(self, endpoint: str, body: dict, tenant: str) -> tuple[int, dict]:
        try:
            principal = self._principal_of(tenant)
            ctx = CallContext(priority="batch", timeout=ROW_TIMEOUT_S, delegation=Delegation(principal))
            for pattern, answer in self._answers:
                match = pattern.fullmatch(endpoint)
                if match is not None:
                    return 200, await answer(match, body, ctx)
            raise InvalidRequest(f"endpoint {endpoint} is not a batch endpoint")
        except Overloaded:
            raise
        except InferplaneError as err:
            status, doc, _headers = http_error(err, openai=True)
            return status, doc
