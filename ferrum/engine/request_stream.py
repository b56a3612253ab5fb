"""One request's outputs as an async iterator, fed by the front end's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ferrum.outputs import RequestOutput


class RequestStream:
    """One request's outputs as an async iterator. A reader that falls behind gets one output
    holding all it missed: the latest cumulative output, or the pending DELTA outputs merged. The
    final output is never skipped."""

    def __init__(
        self, request_id: str, on_close: Callable[[str], object], merge_deltas: bool
    ) -> None:
        self.request_id = request_id
        # Called with the request id when the reader's iteration ends, however it ends.
        self.on_close = on_close
        self._merge_deltas = merge_deltas
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._done = False

    def put(self, output: RequestOutput) -> None:
        if self._latest is not None and self._merge_deltas:
            self._latest.add(output)
        else:
            self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self._done:
                await self._event.wait()
                self._event.clear()
                if self._error is not None:
                    raise self._error
                output, self._latest = self._latest, None
                if output is not None:
                    self._done = output.finished
                    yield output
        finally:
            # Runs on normal end, on error, and when the reader is cancelled (client gone).
            self.on_close(self.request_id)
