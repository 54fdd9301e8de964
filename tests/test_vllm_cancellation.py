"""vllm_serving.cancellation: a cancelled engine call is confirmed to end, and cancelled again
at the replica while it still yields (Serve's cancel is best effort and acts once)."""

import asyncio

from vllm_serving.cancellation import confirm_cancelled


class _ReplicaResult:
    def __init__(self, lost: int):
        self.lost = lost  # how many cancellations the replica misses
        self.cancels = 0

    def cancel(self) -> None:
        self.cancels += 1

    @property
    def cancelled(self) -> bool:
        return self.cancels > self.lost


class _Call:
    """An engine call streaming a token every 10 ms until its replica honours a cancel."""

    def __init__(self, lost: int):
        self._replica_result = _ReplicaResult(lost)
        self.request_id = "r"
        self.yielded = 0

    def cancel(self) -> None:
        self._replica_result.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self) -> int:
        await asyncio.sleep(0.01)
        if self._replica_result.cancelled:
            raise RuntimeError("cancelled")  # Serve raises RequestCancelledError
        self.yielded += 1
        return self.yielded


def _run(lost: int, tries: int = 3) -> tuple[bool, _Call]:
    async def main():
        call = _Call(lost)
        call.cancel()
        return await confirm_cancelled(call, grace_s=0.1, tries=tries), call

    return asyncio.run(main())


def test_an_honoured_cancel_is_confirmed_without_a_second():
    ended, call = _run(lost=0)
    assert ended and call._replica_result.cancels == 1


def test_a_lost_cancel_is_repeated_at_the_replica_until_the_call_ends():
    ended, call = _run(lost=2)
    assert ended and call._replica_result.cancels == 3
    assert call.yielded > 10  # it was drained meanwhile: no replica blocked on an unread stream


def test_a_call_that_never_ends_is_reported_and_left():
    ended, call = _run(lost=100, tries=2)
    assert not ended and call._replica_result.cancels == 3
