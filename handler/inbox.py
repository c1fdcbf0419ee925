"""A chat request's inbox: the engine's outputs for its choices, taken a step's worth at a time.

The engine hands every request's outputs of a step to the event loop in one callback (engine/worker.py), which
calls put_nowait once per output. An asyncio.Queue would then cost its bookkeeping per output and a get per
output; the inbox appends, wakes its one reader only on the first output since the last take, and take() returns
everything that arrived in one list.
"""
import asyncio


class Inbox:
    __slots__ = ("_outputs", "_waiter")

    def __init__(self):
        self._outputs: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, output) -> None:
        """On the event loop's thread, as asyncio.Queue's."""
        self._outputs.append(output)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a cancelled reader has gone
                waiter.set_result(None)

    async def take(self) -> list:
        """Every output that arrived since the last take, waiting for one if none has."""
        if not self._outputs:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        outputs, self._outputs = self._outputs, []
        return outputs
